"""P/D on one machine: a prefill and a decode worker as separate processes, KV over the machine's
transport, against the single engine. ``python -m benchmarks.transfer.pd_parity [--device cuda|cpu] [--json FILE]``

1. The single engine (``LLM`` in this process, same device and dtype) generates greedily for each
   prompt; then it is freed.
2. ``pdserve serve --prefill 1 --decode 1`` starts (gateway + 2 workers), CUDA: ``transfer.transport:
   cuda_ipc`` (a window per transfer on the decode GPU, mapped into the prefill worker; two device copies),
   CPU: ``shm``; ``local_prefill_max_tokens: 0`` so every prompt goes through the prefill worker.
3. The same prompts, one at a time, through the OpenAI completions API (token-id prompts, greedy,
   ignore_eos, ``return_tokens_as_token_ids``): the served tokens must equal the engine's.
4. From /metrics, each series required (a missing name is an error, never 0): the decode worker's
   transfers (bytes, first write to commit), the prefill worker's (the copy itself, timed with CUDA
   events on CUDA; the exposed tail from the last chunk's commit to its ack; the whole span) and the
   gateway's ``vllm:time_to_first_token_seconds``. copy_gbps = copied bytes / copy seconds;
   exposed_share_of_ttft = exposed seconds / TTFT seconds, summed over the requests. A TTFT or transfer
   count other than one per request fails the run.

Last line: ``pd_equal=<equal>/<requests> copy_gbps=<x> exposed_share_of_ttft=<y> ttft_count=<n>``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch
from prometheus_client.parser import text_string_to_metric_families

from benchmarks.common.device_choice import BenchDevice, add_device_args, choose_device
from benchmarks.common.metric_text import metric_sums

PROMPT_LENGTHS = [4096, 2048, 1024, 512, 129, 17]
QUICK_PROMPT_LENGTHS = [300, 129, 17]
NEW_TOKENS = 32


# The decode worker's view of a transfer (first write to commit), the prefill worker's (the copy itself,
# the tail after the last chunk, the whole span: kvtransfer/copy_timing.py) and the gateway's TTFT.
DECODE_SERIES = {"pdserve:kv_transfer_bytes_sum", "pdserve:kv_transfer_seconds_sum", "pdserve:kv_transfer_bytes_count"}
PREFILL_SERIES = {
    "pdserve:kv_transfer_copy_bytes_total",
    "pdserve:kv_transfer_copy_seconds_sum",
    "pdserve:kv_transfer_exposed_seconds_sum",
    "pdserve:kv_transfer_span_seconds_sum",
    "pdserve:kv_transfer_span_seconds_count",
}
GATEWAY_SERIES = {"vllm:time_to_first_token_seconds_sum", "vllm:time_to_first_token_seconds_count"}


def prompts_for(lengths: list[int], vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(5, vocab, (n,), generator=gen).tolist() for n in lengths]


def engine_greedy(model_dir: Path, bench: BenchDevice, prompts: list[list[int]]) -> list[list[int]]:
    from configs.loader import load_config
    from engine.llm import LLM
    from engine.sampling.params import SamplingParams

    config = load_config(None, env={}, overrides={"model.dtype": bench.dtype, "engine.kv_cache_memory_mb": 1024})
    llm = LLM(str(model_dir), config=config, device=bench.device)
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    # One at a time, as they are served: in bf16 a row's result may depend on the batch it is in.
    tokens = [llm.generate([prompt], params)[0].outputs[0].token_ids for prompt in prompts]
    del llm
    gc.collect()
    if bench.device == "cuda":
        torch.cuda.empty_cache()  # the workers need the memory
    return tokens


def served_sections(bench: BenchDevice) -> dict:
    return {
        "model": {"dtype": bench.dtype},
        "engine": {"kv_cache_memory_mb": 1024, "block_size": 16},
        "transfer": {"transport": "cuda_ipc" if bench.device == "cuda" else "shm"},
        "gateway": {"local_prefill_max_tokens": 0},
    }


def complete(url: str, model: str, prompt: list[int]) -> tuple[list[int], float]:
    """Greedy completion of a token-id prompt; (token ids, seconds for the whole answer)."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": NEW_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    started = time.perf_counter()
    with urllib.request.urlopen(request, timeout=300) as response:
        answer = json.loads(response.read())
    tokens = answer["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens], time.perf_counter() - started


def scrape(url: str, names: set[str]) -> dict[str, float]:
    """The named samples at ``url`` summed over labels; MissingMetric names any the server lacks."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return metric_sums(response.read().decode(), names, where=url)


def transports_used(url: str) -> list[str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sorted(
        {
            s.labels["transport"]
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "pdserve:kv_transfer_bytes_count" and s.value > 0
        }
    )


def run_served(model_dir: Path, bench: BenchDevice, prompts: list[list[int]], workdir: Path) -> dict:
    from benchmarks.common.launcher import ServedSystem

    system = ServedSystem("pd", model_dir, workdir, os.sched_getaffinity(0), 1, 1, served_sections(bench))
    try:
        # Warm-up (kernels compile, handshake) on a prompt no measured one shares a block with; long enough
        # for a transfer, so the transfer series exist before the first reading.
        complete(system.url, system.model, list(range(5, 45)))
        system.wait_idle()
        decode_metrics = system.metrics_urls("decode")[0]
        prefill_metrics = system.metrics_urls("prefill")[0]

        def read() -> dict[str, float]:
            return {
                **scrape(decode_metrics, DECODE_SERIES),
                **scrape(prefill_metrics, PREFILL_SERIES),
                **scrape(f"{system.url}/metrics", GATEWAY_SERIES),
            }

        before = read()
        outputs, seconds = [], []
        for prompt in prompts:
            tokens, s = complete(system.url, system.model, prompt)
            outputs.append(tokens)
            seconds.append(s)
        system.wait_idle()
        after = read()
        delta = {k: after[k] - before[k] for k in after}
        return {
            "outputs": outputs,
            "request_seconds": seconds,
            "metrics": delta,
            "transports": transports_used(decode_metrics),
            "log": str(system.log_path),
        }
    finally:
        system.stop()


def summarize(bench: BenchDevice, prompts, expected, served) -> dict:
    m = served["metrics"]
    equal = sum(a == b for a, b in zip(expected, served["outputs"]))
    ttft = m["vllm:time_to_first_token_seconds_sum"]
    copy_s, exposed_s, span_s = (m[f"pdserve:kv_transfer_{n}_seconds_sum"] for n in ("copy", "exposed", "span"))
    copied = m["pdserve:kv_transfer_copy_bytes_total"]
    return {
        "device": bench.describe(),
        "prompt_lengths": [len(p) for p in prompts],
        "new_tokens": NEW_TOKENS,
        "requests": len(prompts),
        "equal": equal,
        "first_mismatch": next(
            (
                {"request": i, "engine": a, "served": b}
                for i, (a, b) in enumerate(zip(expected, served["outputs"]))
                if a != b
            ),
            None,
        ),
        "transports": served["transports"],
        "transfers": m["pdserve:kv_transfer_bytes_count"],
        "transfers_sent": m["pdserve:kv_transfer_span_seconds_count"],
        "transfer_bytes": m["pdserve:kv_transfer_bytes_sum"],
        "copied_bytes": copied,
        # The decode worker's first write to commit: it spans the prefill chunks, a latency not a bandwidth.
        "receive_seconds": m["pdserve:kv_transfer_seconds_sum"],
        "copy_seconds": copy_s,
        "copy_gbps": copied / copy_s / 1e9 if copy_s > 0 else None,
        "exposed_seconds": exposed_s,
        "span_seconds": span_s,
        "ttft_seconds": ttft,
        "ttft_count": m["vllm:time_to_first_token_seconds_count"],
        # What TTFT waits for after the last prefill chunk, over TTFT (both summed over the requests).
        "exposed_share_of_ttft": exposed_s / ttft if ttft > 0 else None,
        "request_seconds": served["request_seconds"],
        "serve_log": served["log"],
    }


def check_counts(figures: dict) -> list[str]:
    """What makes the figures unusable: a TTFT or transfer count that is not one per request."""
    n = figures["requests"]
    return [
        f"{key}={figures[key]:g}, expected {n}"
        for key in ("ttft_count", "transfers", "transfers_sent")
        if figures[key] != n
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.transfer.pd_parity", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF directory (default: the cached small model)")
    p.add_argument("--quick", action="store_true", help=f"prompts of {QUICK_PROMPT_LENGTHS} tokens")
    p.add_argument("--json", help="write the figures to this file too")
    p.add_argument("--workdir", help="where the serve config and log go (default: a new temporary folder)")
    add_device_args(p)
    args = p.parse_args(argv)
    try:
        bench = choose_device(args.device, args.dtype, torch.cuda.is_available())
    except ValueError as exc:
        raise SystemExit(f"python -m benchmarks.transfer.pd_parity: {exc}") from None
    from configs.model_source import default_model_dir

    model_dir = Path(args.model) if args.model else default_model_dir()
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    prompts = prompts_for(QUICK_PROMPT_LENGTHS if args.quick else PROMPT_LENGTHS, vocab)
    print(
        f"pd_parity: {model_dir} on {bench.describe()}; prompts {[len(x) for x in prompts]}, "
        f"{NEW_TOKENS} greedy tokens each",
        flush=True,
    )
    expected = engine_greedy(model_dir, bench, prompts)
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="pdserve-pd-"))
    figures = summarize(bench, prompts, expected, run_served(model_dir, bench, prompts, workdir))
    print(json.dumps({k: v for k, v in figures.items() if k != "request_seconds"}, indent=1))
    figures["count_errors"] = problems = check_counts(figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    for problem in problems:
        print(f"pd_parity: {problem}", file=sys.stderr)
    print(
        f"pd_equal={figures['equal']}/{figures['requests']} copy_gbps={fmt(figures['copy_gbps'])} "
        f"exposed_share_of_ttft={fmt(figures['exposed_share_of_ttft'])} ttft_count={figures['ttft_count']:g}"
    )
    return 0 if figures["equal"] == figures["requests"] and not problems else 1


def fmt(x: float | None) -> str:
    return "none" if x is None else f"{x:.3f}"


if __name__ == "__main__":
    sys.exit(main())
