"""The matmul floor of a workload on this machine: its wall time if nothing but the matmuls it cannot
avoid took time, each at the speed this machine has for the row count it runs at.

The roofline (benchmarks/engine/roofline.py) prices every FLOP at the rate of a 512-row matmul. A decode step
has only as many rows as sequences still decoding, and at a few dozen rows a matmul is bound by
streaming the weights rather than by arithmetic, so on a machine with fast arithmetic a decode-heavy
workload stays far below the roofline whatever the engine does. The floor makes that visible:

    floor = ideal time of the required FLOPs           (roofline.workload_flops / peak)
          - ideal time of the decode steps' projections (the part that cannot run at the peak)
          + the measured time of those projections      (every layer's and the LM head, per step)

Decode step t = 1 .. max(L) - 1 has ``#{requests with L > t}`` rows: the most favourable schedule,
with every request decoding in one batch from the first step (fewer rows per step never costs less
per token). Each row count is timed with weights of the model's shapes, one copy per layer (so a step
streams all of them, as the model does), in the fastest of the plain, the transposed and the packed
product and the C linear on its own copy (engine/model/cpu_linear.py, kernels/cpu/linear.c), best of ``repeats``.
``ideal / floor`` is the highest roofline fraction an
engine running these steps on this machine could show.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.engine.roofline import DecoderShape, linear_flops
from engine.model.cpu_linear import LM_HEAD_SLICE_ROWS, best_seconds, linear_packed, linear_transposed, pack_weight
from kernels.cpu import native as cpu_native


@dataclass(slots=True, frozen=True)
class MatmulFloor:
    ideal_s: float  # required FLOPs at the peak rate
    decode_ideal_s: float  # the decode steps' projections at the peak rate (part of ideal_s)
    decode_measured_s: float  # the same projections as measured at their row counts
    num_decode_steps: int

    @property
    def floor_s(self) -> float:
        return self.ideal_s - self.decode_ideal_s + self.decode_measured_s

    @property
    def roofline_at_floor(self) -> float:
        return self.ideal_s / self.floor_s


def decode_rows(output_lens: list[int]) -> list[int]:
    """Rows of each decode step when every request decodes from the first step: a request with L
    output tokens samples the first of them in prefill and decodes at steps 1 .. L - 1."""
    return [sum(1 for n in output_lens if n > t) for t in range(1, max(output_lens, default=1))]


def matmul_floor(
    shape: DecoderShape, lengths: list[tuple[int, int]], required_flops: float, flops_per_s: float, repeats: int = 2
) -> MatmulFloor:
    """``lengths``: (prompt_len, output_len) per request; ``required_flops``/``flops_per_s`` as in the roofline."""
    rows = decode_rows([out for _, out in lengths])
    decode_flops = sum(linear_flops(shape, n, n) for n in rows)
    step_s = _measure_steps(shape, sorted(set(rows)), repeats)
    measured = sum(step_s[n] * count for n, count in Counter(rows).items())
    return MatmulFloor(required_flops / flops_per_s, decode_flops / flops_per_s, measured, len(rows))


def _measure_steps(shape: DecoderShape, row_counts: list[int], repeats: int) -> dict[int, float]:
    """Seconds of one decode step's projections and LM head at each row count."""
    gen = torch.Generator().manual_seed(0)
    layers = [
        [torch.randn(d_out, d_in, generator=gen) for d_in, d_out in shape.linear_shapes()]
        for _ in range(shape.num_layers)
    ]  # [out, in] each, as nn.Linear holds them
    lm_head = torch.randn(shape.vocab_size, shape.hidden_size, generator=gen)
    packed_layers = [[pack_weight(w) for w in weights] for weights in layers]
    packed_lm_head = pack_weight(lm_head)
    native = cpu_native.load()
    if native is not None and not all(native.takes_weight(w) for w in layers[0] + [lm_head]):
        native = None
    c_layers = [[native.pack_linear(w) for w in weights] for weights in layers] if native is not None else []
    c_lm_head = native.pack_linear(lm_head) if native is not None else None
    seconds = {}
    for n in row_counts:
        inputs = {d_in: torch.randn(n, d_in, generator=gen) for d_in, _ in shape.linear_shapes()}

        def plain() -> None:
            for weights in layers:
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)
            F.linear(inputs[shape.hidden_size], lm_head)

        def transposed() -> None:
            for weights in layers:
                for w in weights:
                    linear_transposed(inputs[w.shape[1]], w)
            linear_transposed(inputs[shape.hidden_size], lm_head, LM_HEAD_SLICE_ROWS)

        def packed() -> None:
            for weights in packed_layers:
                for w, p in zip(layers[0], weights):
                    linear_packed(inputs[w.shape[1]], p)
            linear_packed(inputs[shape.hidden_size], packed_lm_head)

        def c() -> None:
            for weights in c_layers:
                for w in weights:
                    native.linear(inputs[w.shape[1]], w)  # packed [out / NR, in, NR]
            native.linear(inputs[shape.hidden_size], c_lm_head)

        forms = (plain, transposed) if packed_lm_head is None else (plain, transposed, packed)
        seconds[n] = min(best_seconds(form, repeats) for form in forms + ((c,) if native is not None else ()))
    return seconds
