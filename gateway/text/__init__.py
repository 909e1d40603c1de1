"""Text handling: tokenizer, incremental detokenizer, stop strings, reasoning and tool-call parsers."""
