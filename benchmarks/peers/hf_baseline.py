"""The transformers baselines pdserve is measured against: one request at a time, and static batching.

Both decode greedily and never stop at EOS, which is what pdserve's ``ignore_eos`` means: EOS may be
sampled, it just does not end the request. (``min_new_tokens`` would instead *mask* EOS until the
length is reached, which changes the greedy token whenever EOS is the argmax, so the cross-check of
token ids would fail for a reason that is not a bug.) EOS is switched off by a generation config with
no ``eos_token_id``; the work done — exactly ``max_new_tokens`` steps — is the same either way.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedModel
from transformers.generation.streamers import BaseStreamer

from benchmarks.common.device_choice import BenchDevice
from benchmarks.common.metrics import RequestTimeline
from benchmarks.common.workload import BenchRequest, SystemResult

CPU_FP32 = BenchDevice("cpu", "float32")


def load_hf_model(model_dir: str | Path, bench: BenchDevice = CPU_FP32) -> PreTrainedModel:
    """The checkpoint on the device and in the dtype pdserve is run with (``bench``)."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=bench.torch_dtype)
    return model.to(bench.device).eval()


def _greedy_config(max_new_tokens: int, pad_token_id: int, suppress_ids: list[int] | None) -> GenerationConfig:
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=None,  # never stop early: every row runs exactly max_new_tokens steps
        pad_token_id=pad_token_id,
        suppress_tokens=suppress_ids or None,  # logits -inf: never chosen
    )


def _pad_id(model: PreTrainedModel) -> int:
    pad = model.config.pad_token_id
    return 0 if pad is None else int(pad)


@torch.inference_mode()
def generate_batch(
    model: PreTrainedModel,
    prompts: list[tuple[int, ...]],
    max_new_tokens: int,
    suppress_ids: list[int] | None = None,
    streamer: BaseStreamer | None = None,
) -> list[list[int]]:
    """Greedy ``max_new_tokens`` for each prompt in one left-padded ``generate`` call; ``suppress_ids``
    are never chosen (to compare with a server whose ignore_eos masks EOS instead of sampling past it);
    ``streamer`` gets the prompts, then each step's tokens (``StepClock`` times them)."""
    pad_id = _pad_id(model)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)  # [batch, width]
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)  # 0 on the left padding
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        attention_mask[row, width - len(prompt) :] = 1
    out = model.generate(
        input_ids=input_ids.to(model.device),
        attention_mask=attention_mask.to(model.device),
        generation_config=_greedy_config(max_new_tokens, pad_id, suppress_ids),
        streamer=streamer,
    )  # [batch, width + max_new_tokens]
    return out[:, width:].tolist()


def _timed(fn) -> tuple[object, float, float]:
    wall0, cpu0 = time.perf_counter(), time.process_time()
    value = fn()
    return value, time.perf_counter() - wall0, time.process_time() - cpu0


def run_one_at_a_time(model: PreTrainedModel, requests: list[BenchRequest]) -> SystemResult:
    """``generate`` per request in arrival order, no padding: the unbatched reference."""

    def run() -> dict[int, list[int]]:
        return {r.index: generate_batch(model, [r.prompt_token_ids], r.output_len)[0] for r in requests}

    outputs, wall_s, cpu_s = _timed(run)
    return SystemResult(
        "hf one-at-a-time", len(requests), sum(len(o) for o in outputs.values()), wall_s, cpu_s, outputs
    )


def run_static_batching(model: PreTrainedModel, requests: list[BenchRequest], batch_size: int = 16) -> SystemResult:
    """Batches of ``batch_size`` in arrival order, each run until its longest request is done.

    Rows that wanted fewer tokens keep decoding with the batch; those extra tokens are the cost of
    static batching and are not counted as output.
    """

    def run() -> dict[int, list[int]]:
        outputs = {}
        for start in range(0, len(requests), batch_size):
            batch = requests[start : start + batch_size]
            longest = max(r.output_len for r in batch)
            rows = generate_batch(model, [r.prompt_token_ids for r in batch], longest)
            for r, row in zip(batch, rows):
                outputs[r.index] = row[: r.output_len]  # only the requested tokens
        return outputs

    outputs, wall_s, cpu_s = _timed(run)
    return SystemResult(
        f"hf static batch={batch_size}", len(requests), sum(len(o) for o in outputs.values()), wall_s, cpu_s, outputs
    )


class StepClock(BaseStreamer):
    """When each decoding step's tokens came out of ``generate``: its first ``put`` is the prompts
    (before the prefill), each later one a step's new token for every row."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.step_s: list[float] = []  # time.perf_counter() as each step's tokens arrive, in order

    def put(self, value) -> None:
        if self.num_puts:
            self.step_s.append(time.perf_counter())
        self.num_puts += 1

    def end(self) -> None:
        pass


def timed_static_batching(
    model: PreTrainedModel, requests: list[BenchRequest], batch_size: int, tag: str
) -> tuple[list[RequestTimeline], float]:
    """``run_static_batching``'s batches, each request's timeline as a streaming client would have seen
    it had it been sent when its batch started (a closed loop of ``batch_size`` whose streams all wait
    for the slowest): a chunk per step up to its own output length. Returns them and the wall time."""
    timelines = []
    start = time.perf_counter()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        clock = StepClock()
        sent = time.perf_counter()
        generate_batch(model, [r.prompt_token_ids for r in batch], max(r.output_len for r in batch), streamer=clock)
        for r in batch:
            chunks = clock.step_s[: r.output_len]
            timelines.append(RequestTimeline(r.index, tag, r.prompt_len, r.output_len, sent, chunks, len(chunks)))
    return timelines, time.perf_counter() - start
