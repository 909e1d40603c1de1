"""P/D on one machine: a prefill and a decode worker as separate processes, KV over the machine's
transport, against the single engine. ``python -m benchmarks.transfer.pd_parity [--device cuda|cpu] [--json FILE]``

1. The single engine (``LLM`` in this process, same device and dtype) generates greedily for each
   prompt; then it is freed.
2. ``pdserve serve --prefill 1 --decode 1`` starts (gateway + 2 workers), CUDA: ``transfer.transport:
   cuda_ipc`` (the decode pool is mapped into the prefill worker; blocks copied device to device),
   CPU: ``shm``; ``local_prefill_max_tokens: 0`` so every prompt goes through the prefill worker.
3. The same prompts, one at a time, through the OpenAI completions API (token-id prompts, greedy,
   ignore_eos, ``return_tokens_as_token_ids``): the served tokens must equal the engine's.
4. From /metrics: the decode worker's transfers (bytes, seconds from first write to commit, transport)
   and the gateway's TTFT; the transfer's share of TTFT = transfer seconds / TTFT seconds, summed over
   the requests. Transfer time overlaps prefill chunks, so this share is an upper bound.

Last line: ``pd_equal=<requests equal>/<requests> transfer_gbps=<x> transfer_share_of_ttft=<y>``
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

PROMPT_LENGTHS = [4096, 2048, 1024, 512, 129, 17]
QUICK_PROMPT_LENGTHS = [300, 129, 17]
NEW_TOKENS = 32


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


def metric_sums(url: str, names: set[str]) -> dict[str, float]:
    """Sum over labels of each named sample (e.g. ``pdserve:kv_transfer_bytes_sum``) at ``url``."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    sums = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in names:
                sums[sample.name] += sample.value
    return sums


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
        complete(system.url, system.model, prompts[-1][:8])  # warm-up (kernels compile, handshake)
        system.wait_idle()
        decode_metrics = system.metrics_urls("decode")[0]
        names = {"pdserve:kv_transfer_bytes_sum", "pdserve:kv_transfer_seconds_sum", "pdserve:kv_transfer_bytes_count"}
        ttft_names = {"pdserve:time_to_first_token_seconds_sum", "pdserve:time_to_first_token_seconds_count"}
        before = {**metric_sums(decode_metrics, names), **metric_sums(f"{system.url}/metrics", ttft_names)}
        outputs, seconds = [], []
        for prompt in prompts:
            tokens, s = complete(system.url, system.model, prompt)
            outputs.append(tokens)
            seconds.append(s)
        system.wait_idle()
        after = {**metric_sums(decode_metrics, names), **metric_sums(f"{system.url}/metrics", ttft_names)}
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
    gbps = (
        m["pdserve:kv_transfer_bytes_sum"] / m["pdserve:kv_transfer_seconds_sum"] / 1e9
        if m["pdserve:kv_transfer_seconds_sum"] > 0
        else 0.0
    )
    ttft = m["pdserve:time_to_first_token_seconds_sum"]
    share = m["pdserve:kv_transfer_seconds_sum"] / ttft if ttft > 0 else 0.0
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
        "transfer_bytes": m["pdserve:kv_transfer_bytes_sum"],
        "transfer_seconds": m["pdserve:kv_transfer_seconds_sum"],
        "transfer_gbps": gbps,
        "ttft_seconds": ttft,
        "ttft_count": m["pdserve:time_to_first_token_seconds_count"],
        "transfer_share_of_ttft": share,
        "request_seconds": served["request_seconds"],
        "serve_log": served["log"],
    }


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
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    print(
        f"pd_equal={figures['equal']}/{figures['requests']} transfer_gbps={figures['transfer_gbps']:.2f} "
        f"transfer_share_of_ttft={figures['transfer_share_of_ttft']:.3f}"
    )
    return 0 if figures["equal"] == figures["requests"] else 1


if __name__ == "__main__":
    sys.exit(main())
