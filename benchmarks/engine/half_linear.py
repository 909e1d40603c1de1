"""How to round activations for BF16 weights, by the numbers: vdpbf16ps on x split in two bf16 halves
(kernels/cpu/half.c's BF16) against x rounded to bf16 once (llama.cpp's, HALF_BF16_ONCE), beside F16
(float32 x) and the float32 C linear of the same weights widened at load (what pdserve ran before).

Speed: one pass over SmolLM2-135M's projections (30 layers of qkv 960x576, o 576x576, gate/up 3072x576,
down 576x1536) and its 49152x576 LM head at each row count, the forms alternated in one process, the
best of ``--repeats`` passes each. Accuracy: each form's relative error against float64 with x exact,
on the layer shapes, x and W as a trained model's (x ~ N(0, 1), W ~ N(0, 0.02)).

    python -m benchmarks.engine.half_linear [--rows 1,4,16,64,256] [--repeats 5] [--threads N]
"""

from __future__ import annotations

import argparse
import time

import torch

from kernels.cpu import half
from kernels.cpu.native import load as load_native

LAYER = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's projections (out, in)
HEAD = (49152, 576)


def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randn(*shape, generator=g) * 0.02 for shape in LAYER * 30 + [HEAD]]


def _forms(lib: half.HalfLibrary, weights: list[torch.Tensor]) -> dict:
    """form name -> (one call per weight, for x of any rows)"""
    bf16 = [w.bfloat16().view(torch.uint8) for w in weights]
    f16 = [w.half().view(torch.uint8) for w in weights]
    native = load_native()
    packed = [native.pack_linear(w.bfloat16().float()) for w in weights]
    return {
        "bf16 split": lambda i, x: lib.linear("BF16", x, bf16[i], x.shape[1]),
        "bf16 once": lambda i, x: lib.linear(half.BF16_ONCE, x, bf16[i], x.shape[1]),
        "f16": lambda i, x: lib.linear("F16", x, f16[i], x.shape[1]),
        "f32 C linear": lambda i, x: native.linear(x, packed[i]),
    }


def speed(rows_list: list[int], repeats: int) -> None:
    lib = half.load()
    weights = _weights()
    forms = _forms(lib, weights)
    xs = {k: torch.randn(max(rows_list), k) for k in (576, 1536)}
    print(f"kernels: {lib.instructions}; threads {torch.get_num_threads()}; a whole-model pass, ms (best of {repeats})")
    for rows in rows_list:
        best = dict.fromkeys(forms, float("inf"))
        for _ in range(repeats + 1):  # the first round warms up
            for name, call in forms.items():
                start = time.perf_counter()
                for i, w in enumerate(weights):
                    call(i, xs[w.shape[1]][:rows])
                best[name] = min(best[name], time.perf_counter() - start)
        base = best["bf16 split"]
        cells = ", ".join(f"{n} {t * 1e3:.2f} ({t / base:.2f}x)" for n, t in best.items())
        print(f"rows {rows:>3}: {cells}", flush=True)


def accuracy() -> None:
    lib = half.load()
    g = torch.Generator().manual_seed(1)
    for out_f, in_f in LAYER:
        w = (torch.randn(out_f, in_f, generator=g) * 0.02).bfloat16()
        x = torch.randn(16, in_f, generator=g)
        exact = x.double() @ w.double().T
        errors = {}
        for name, tag in (("bf16 split", "BF16"), ("bf16 once", half.BF16_ONCE)):
            y = lib.linear(tag, x, w.view(torch.uint8), in_f).double()
            errors[name] = ((y - exact).norm() / exact.norm()).item()
        y32 = (x @ w.float().T).double()
        errors["f32 matmul"] = ((y32 - exact).norm() / exact.norm()).item()
        print(f"{out_f}x{in_f}: relative error " + ", ".join(f"{n} {e:.2e}" for n, e in errors.items()), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.engine.half_linear", description=__doc__)
    p.add_argument("--rows", default="1,4,16,64,256")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    accuracy()
    speed([int(r) for r in args.rows.split(",")], args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
