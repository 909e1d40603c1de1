"""The serving benchmark: pdserve against llama-server and transformers (`python -m benchmarks.serve`)."""
