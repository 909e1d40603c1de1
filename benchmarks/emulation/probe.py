"""What one emulated CPU makes of pdserve, run inside ``qemu-x86_64 -cpu MODEL`` by
benchmarks/emulation/check.py (scripts/cpu-emulation-check): the builds chosen at start and a tiny GGUF
model served end to end. Prints one line ``PROBE {json}`` at the end; what it asserts is the checker's.

- ``builds``: the instruction-set macros the compiler resolved ``-march=native`` to (kernels/cpu/build.py's
  reading of the CPU), the quantized kernels' code path and the f32 kernels' packed width, the
  instruction levels the tests will build, and torch's own dispatch level.
- ``model``: the greedy tokens of a tiny Mistral stored as ``--qtype`` (tests/gguf_factory.py's file, as
  llama.cpp writes it) on the quantized C kernels, and on the dequantizing path (float32 weights, torch
  matmuls: the path whose tokens are transformers' on the file, tests/test_gguf_architectures.py), with
  and ``start_log``: the start's log lines that name the kernels and the forms timed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from gguf import GGMLQuantizationType

from kernels.cpu import build
from kernels.cpu import native as cpu_native
from kernels.cpu import quant as cpu_quant

# the prompts and length of tests/test_gguf_triton_path.py: logit gaps far above the kernels' rounding
PROMPTS = [[5, 6, 7, 8, 9, 10], [300]]
MAX_TOKENS = 6
_START_LOGS = ("quantized C kernels", "quantized matmul forms", "CPU matmul forms by weight", "C kernels built")


class _Kept(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if message.startswith(_START_LOGS):
            self.lines.append(message)


def builds() -> dict:
    compiler = shutil.which(os.environ.get("CC", "cc"))
    isa = ("__AVX", "__FMA", "__F16C", "__SSE4")
    features = sorted(f for f in build.native_features(compiler) if f.startswith(isa))
    quant, native = cpu_quant.load(), cpu_native.load()
    return {
        "compiler": compiler,
        "native_features": features,
        "quant": None if quant is None else {"file": quant.name, "code_path": quant.instructions},
        "native": None if native is None else {"file": native.name, "linear_block": native.linear_block},
        "levels": list(cpu_quant.levels_here()),
        "torch_capability": torch.backends.cpu.get_cpu_capability(),
    }


def model(qtype: str) -> dict:
    # imported here: the engine and the test factories cost seconds under emulation, and builds() needs neither
    from engine.llm import LLM
    from engine.quant.apply import quantized_modules
    from engine.sampling.params import SamplingParams
    from tests.gguf_factory import dequantizing, write_gguf
    from tests.invariants import assert_no_leak
    from tests.model_factory import tiny_model_dir

    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        got = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy)]
        assert_no_leak(llm.engine.block_manager)
        return got

    with tempfile.TemporaryDirectory() as tmp:
        gguf_file = write_gguf(
            tiny_model_dir("mistral"), "mistral", Path(tmp) / "tiny.gguf", GGMLQuantizationType[qtype]
        )
        llm = LLM(str(gguf_file), kv_cache_memory_mb=8)
        quantized = len(quantized_modules(llm.engine.runner.model))
        kernel_tokens = tokens(llm)
        with dequantizing():
            plain = LLM(str(gguf_file), kv_cache_memory_mb=8)
        dequantized_tokens = tokens(plain)
    return {
        "qtype": qtype,
        "quantized_modules": quantized,
        "kernel_tokens": kernel_tokens,
        "dequantized_tokens": dequantized_tokens,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--qtype", default="Q8_0", choices=("Q8_0", "Q4_0", "Q4_1"))
    parser.add_argument("--builds-only", action="store_true", help="skip the model")
    args = parser.parse_args(argv)
    kept = _Kept()
    logging.getLogger().addHandler(kept)
    logging.getLogger().setLevel(logging.INFO)
    report = {"builds": builds()}
    if not args.builds_only:
        report["model"] = model(args.qtype)
    report["start_log"] = kept.lines
    print("PROBE " + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
