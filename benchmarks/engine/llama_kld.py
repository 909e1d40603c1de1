"""llama.cpp's own measure of how far a quantized run is from its base, for the accuracy benchmarks
(benchmarks/engine/gguf_accuracy.py: a quantized GGUF against the F32 one; kv_accuracy.py: a quantized
KV cache against a float32 one): ``llama-perplexity`` of the pinned build run once on the base saving
its logits (``--kl-divergence-base``) and once on the tested configuration against them
(``--kl-divergence``), on the same text, context and chunks (the second half of each chunk scored).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.peers import llama_build

# llama-perplexity prints a figure near zero in exponent form (e.g. "-1.2e-06 ± 4.5e-06", f16 KV at 4k)
# and "nan" for an uncertainty it cannot estimate (one chunk of an f16 cache that changed nothing).
_NUM = r"(-?(?:[0-9.]+(?:e[-+]?[0-9]+)?|nan))"
_PATTERNS = {
    "same_top": rf"Same top p:\s+{_NUM}\s+±\s+{_NUM}",
    "ln_ratio": rf"Mean\s+ln\(PPL\(Q\)/PPL\(base\)\)\s*:\s+{_NUM}\s+±\s+{_NUM}",
    "mean_kld": rf"Mean\s+KLD:\s+{_NUM}\s+±\s+{_NUM}",
    "max_kld": rf"Maximum KLD:\s+{_NUM}",
    "ppl": rf"Mean PPL\(Q\)\s*:\s+{_NUM}",
    "ppl_base": rf"Mean PPL\(base\)\s*:\s+{_NUM}",
}


@dataclass(slots=True)
class LlamaKLD:
    """The tested run against the base, as llama-perplexity prints it."""

    same_top: float  # percent of scored tokens whose top-1 matches the base's
    same_top_err: float
    ln_ratio: float  # ln(PPL tested / PPL base)
    ln_ratio_err: float
    mean_kld: float
    mean_kld_err: float
    max_kld: float
    ppl: float  # the tested run's perplexity
    ppl_base: float

    def line(self) -> str:
        return (
            f"same_top1={self.same_top / 100:.4f} (+- {self.same_top_err / 100:.4f}) "
            f"ln_ppl_ratio={self.ln_ratio:.5f} (+- {self.ln_ratio_err:.5f}) "
            f"mean_kld={self.mean_kld:.6f} (+- {self.mean_kld_err:.6f}) max_kld={self.max_kld:.5f}"
        )


def _perplexity(argv: list[str]) -> str:
    done = subprocess.run([str(llama_build.tool_binary("llama-perplexity")), *argv], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"llama-perplexity failed ({done.returncode}): {(done.stdout + done.stderr)[-800:]}")
    return done.stdout + done.stderr


def compare(base: list[str], tested: list[str], text: Path, ctx: int, chunks: int = 1, threads: int = 2) -> LlamaKLD:
    """``tested`` against ``base``, each llama-perplexity's model and cache arguments (``-m F.gguf``,
    ``-ctk q8_0 -ctv q8_0 -fa on``), on the first ``chunks`` windows of ``ctx`` tokens of ``text``."""
    common = ["-f", str(text), "-c", str(ctx), "--chunks", str(chunks), "-b", str(ctx), "-t", str(threads)]
    with tempfile.TemporaryDirectory(prefix="pdserve-llama-kld-") as tmp:
        logits = str(Path(tmp) / "base.kld")
        _perplexity([*base, *common, "--kl-divergence-base", logits])
        out = _perplexity([*tested, *common, "--kl-divergence-base", logits, "--kl-divergence"])
    found = {}
    for name, pattern in _PATTERNS.items():
        match = re.search(pattern, out)
        if match is None:
            raise RuntimeError(f"llama-perplexity printed no {name}: {out[-800:]}")
        found[name] = [float(g) for g in match.groups()]
    return LlamaKLD(
        *found["same_top"],
        *found["ln_ratio"],
        *found["mean_kld"],
        found["max_kld"][0],
        found["ppl"][0],
        found["ppl_base"][0],
    )


def kv_args(gguf: Path, kv: str) -> list[str]:
    """A KV cache type on ``gguf``, flash attention on as llama.cpp needs for a quantized V."""
    return ["-m", str(gguf), "-fa", "on", "-ctk", kv, "-ctv", kv]
