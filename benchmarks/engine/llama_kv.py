"""llama.cpp's quantized KV cache on the same model and text, for benchmarks/engine/kv_accuracy.py:
``llama-perplexity`` of the pinned build run once with a base KV type saving its logits
(``--kl-divergence-base``) and once with the tested type against them (``--kl-divergence``).

Like pdserve's table, the base is a float32 KV cache (``-ctk f32 -ctv f32``): llama.cpp's own default
base would be its f16 cache, itself a rounding of the float32 one. Flash attention on, as llama.cpp
needs for a quantized V.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers import llama_build

# llama-perplexity prints a figure near zero in exponent form (e.g. "-1.2e-06 ± 4.5e-06", f16 KV at 4k).
_NUM = r"(-?(?:[0-9.]+(?:e[-+]?[0-9]+)?|nan))"
_PATTERNS = {
    "same_top": rf"Same top p:\s+{_NUM}\s+±\s+{_NUM}",
    "ln_ratio": rf"Mean\s+ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s+{_NUM}\s+±\s+{_NUM}",
    "mean_kld": rf"Mean\s+KLD:\s+{_NUM}",
    "max_kld": rf"Maximum KLD:\s+{_NUM}",
}


@dataclass(slots=True)
class LlamaKV:
    """One tested KV type against the base, as llama-perplexity prints it."""

    same_top: float  # percent of scored tokens whose top-1 matches the base's
    same_top_err: float
    ln_ratio: float  # ln(PPL tested / PPL base)
    ln_ratio_err: float
    mean_kld: float
    max_kld: float

    def line(self) -> str:
        return (
            f"same_top1={self.same_top / 100:.4f} (+- {self.same_top_err / 100:.4f}) "
            f"ln_ppl_ratio={self.ln_ratio:.5f} (+- {self.ln_ratio_err:.5f}) "
            f"mean_kld={self.mean_kld:.5f} max_kld={self.max_kld:.5f}"
        )


def _perplexity(gguf: Path, text: Path, ctx: int, kv: str, threads: int, extra: list[str]) -> str:
    argv = [str(llama_build.tool_binary("llama-perplexity")), "-m", str(gguf), "-f", str(text)]
    argv += ["-c", str(ctx), "--chunks", "1", "-fa", "on", "-ctk", kv, "-ctv", kv, "-t", str(threads), *extra]
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {(done.stdout + done.stderr)[-800:]}")
    return done.stdout + done.stderr


def compare(gguf: Path, text: Path, ctx: int, tested: str, base: str = "f32", threads: int = 2) -> LlamaKV:
    """``tested`` KV (a -ctk/-ctv type) against ``base`` on the first window of ``ctx`` tokens."""
    with tempfile.TemporaryDirectory(prefix="pdserve-llama-kv-") as tmp:
        logits = str(Path(tmp) / "base.kld")
        _perplexity(gguf, text, ctx, base, threads, ["--kl-divergence-base", logits])
        out = _perplexity(gguf, text, ctx, tested, threads, ["--kl-divergence-base", logits, "--kl-divergence"])
    found = {}
    for name, pattern in _PATTERNS.items():
        match = re.search(pattern, out)
        if match is None:
            raise RuntimeError(f"llama-perplexity printed no {name}: {out[-800:]}")
        found[name] = [float(g) for g in match.groups()]
    return LlamaKV(
        found["same_top"][0],
        found["same_top"][1],
        found["ln_ratio"][0],
        found["ln_ratio"][1],
        found["mean_kld"][0],
        found["max_kld"][0],
    )
