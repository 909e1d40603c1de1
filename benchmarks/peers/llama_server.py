"""llama.cpp's ``llama-server`` as a system under test: its configuration, its process, and the check
that its greedy output is transformers' before any figure of it is reported.

    python -m benchmarks.peers.llama_server build      # fetch the pinned sdist, build llama-server (~10 min, 2 cores)
    python -m benchmarks.peers.llama_server convert    # the benchmark model as GGUF f32 (~15 s)
    python -m benchmarks.peers.llama_server check      # greedy output == transformers', token for token

The server is started as a CPU user would run it for many clients: ``-t`` threads (prompt and decode),
``--parallel N`` slots with continuous batching, a context of N slots each long enough for the
longest request, flash attention on or off (benchmarks/serve/plan.py says which won, measured).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.common.english_text import text_prompts
from benchmarks.common.launcher import _pinned, free_port
from benchmarks.peers import llama_build

# The greedy check: prompts of these lengths (fixed ids), each continued for CHECK_OUTPUT_LEN tokens.
CHECK_PROMPT_LENS = (7, 64, 256)
CHECK_OUTPUT_LEN = 48


@dataclass(slots=True, frozen=True)
class LlamaConfig:
    threads: int  # -t and -tb: threads for decode and for prompt processing; 0: one per core given
    parallel: int  # --parallel: slots, i.e. sequences batched together
    flash_attn: bool  # -fa
    ctx_per_slot: int  # tokens each slot holds: the longest prompt + output it will be given
    extra: tuple[str, ...] = ()  # more flags, e.g. its speculation: ("--spec-type", "ngram-simple")

    def __post_init__(self) -> None:
        assert self.threads >= 0 and self.parallel >= 1 and self.ctx_per_slot >= 1, self

    def resolved(self, num_cores: int) -> LlamaConfig:
        """With ``threads`` 0 replaced by ``num_cores``."""
        return self if self.threads else replace(self, threads=num_cores)

    def argv(self, binary: Path, gguf: Path, port: int) -> list[str]:
        assert self.threads, "resolve threads=0 first"
        return [
            str(binary),
            "-m",
            str(gguf),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            str(self.threads),
            "-tb",
            str(self.threads),
            "--parallel",
            str(self.parallel),
            "--cont-batching",
            "-c",
            str(self.parallel * self.ctx_per_slot),  # split evenly between the slots
            "--no-webui",
            "--slots",  # the /slots endpoint (off by default): wait_idle reads it between runs
            *(["-fa"] if self.flash_attn else []),
            *self.extra,
        ]

    @property
    def label(self) -> str:
        extra = f" {' '.join(self.extra)}" if self.extra else ""
        return f"-t {self.threads} --parallel {self.parallel} fa {'on' if self.flash_attn else 'off'}{extra}"


class LlamaServer:
    """One ``llama-server`` on a free port, pinned to ``cpus``, up once ``/health`` answers 200."""

    def __init__(self, config: LlamaConfig, gguf: Path, cpus: set[int], log_path: Path, ready_timeout_s: float = 120):
        self.config = config
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with log_path.open("w") as log:
            self.proc = subprocess.Popen(
                config.argv(llama_build.server_binary(), gguf, self.port),
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_pinned(cpus),
            )
        self._wait_ready(ready_timeout_s)
        self.model = json.loads(self._get("/v1/models"))["data"][0]["id"]

    def _get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"{self.url}{path}", timeout=10) as response:
            return response.read()

    def _wait_ready(self, timeout_s: float) -> None:
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if self.proc.poll() is not None:
                break
            try:
                self._get("/health")
                return
            except (urllib.error.URLError, ConnectionError):  # 503 while loading, refused before
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"llama-server ({self.config.label}) not ready; see {self.log_path}")

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Until no slot is processing (between runs), from ``/slots``."""
        give_up = time.monotonic() + timeout_s
        while time.monotonic() < give_up:
            if not any(slot.get("is_processing") for slot in json.loads(self._get("/slots"))):
                return
            time.sleep(0.25)
        raise RuntimeError(f"llama-server ({self.config.label}): slots busy after {timeout_s} s")

    def complete_ids(self, prompt: list[int], num_tokens: int) -> list[int]:
        """Greedy ``num_tokens`` token ids after ``prompt`` (ids), EOS ignored, from ``/completion``."""
        body = {
            "prompt": prompt,
            "n_predict": num_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "return_tokens": True,
            "cache_prompt": False,
        }
        request = urllib.request.Request(
            f"{self.url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=300) as response:
            return list(json.loads(response.read())["tokens"])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def eog_ids(model_dir: Path) -> list[int]:
    """The end-of-generation ids of the checkpoint (config and generation config). llama-server's
    ``ignore_eos`` biases every one of them to -inf (pdserve's lets EOS be sampled and goes on), so the
    transformers reference masks them too: greedy choices differ exactly where one would have won."""
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        value = json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None
        ids.update([value] if isinstance(value, int) else value or [])
    return sorted(ids)


def check_prompts(model_dir: Path) -> list[list[int]]:
    """English text in the model's tokenizer. Not random ids: on a trained model they leave the next
    token's distribution nearly flat, so two correct float32 implementations (llama.cpp's and torch's
    matmul rounding) pick different near-tied argmaxes within a few tokens; the check is of the
    conversion, and text is what the model was trained to continue."""
    return text_prompts(model_dir, CHECK_PROMPT_LENS)


def greedy_mismatches(server: LlamaServer, model_dir: Path) -> list[str]:
    """One line per prompt whose llama-server output differs from transformers' greedy generate with
    the same EOG ids masked; empty when every token matches."""
    import torch

    from benchmarks.peers import hf_baseline

    model = hf_baseline.load_hf_model(model_dir)
    masked = eog_ids(model_dir)
    prompts = check_prompts(model_dir)
    problems = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server: one thread is quick enough and never waits on a busy core
    try:
        got_all = [server.complete_ids(prompt, CHECK_OUTPUT_LEN) for prompt in prompts]
        expected_all = [
            hf_baseline.generate_batch(model, [tuple(prompt)], CHECK_OUTPUT_LEN, suppress_ids=masked)[0]
            for prompt in prompts
        ]
    finally:
        torch.set_num_threads(threads)
    for prompt, got, expected in zip(prompts, got_all, expected_all):
        if got != expected:
            first = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
            problems.append(
                f"prompt of {len(prompt)} tokens: first difference at output token {first} "
                f"(llama-server {got[first : first + 4]}, transformers {expected[first : first + 4]})"
            )
    return problems


def check(model_dir: Path, cpus: set[int], log_dir: Path) -> list[str]:
    """Starts a one-slot server on the GGUF of ``model_dir`` and compares its greedy output."""
    gguf = llama_build.convert(model_dir)
    # One thread: the check is of tokens, not speed, and a second thread only waits for a busy core.
    config = LlamaConfig(threads=1, parallel=1, flash_attn=False, ctx_per_slot=1024)
    server = LlamaServer(config, gguf, cpus, log_dir / "llama-check.log")
    try:
        return greedy_mismatches(server, model_dir)
    finally:
        server.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers.llama_server", description=__doc__)
    p.add_argument("action", choices=("build", "convert", "check"))
    p.add_argument("--model", default=None, help="HF model directory (default: the cached llama-small)")
    args = p.parse_args(argv)
    if args.action == "build":
        print(llama_build.build())
        return 0
    from benchmarks.engine.throughput import resolve_model_dir

    model_dir = resolve_model_dir(args.model)
    if args.action == "convert":
        print(llama_build.convert(model_dir))
        return 0
    llama_build.build()
    problems = check(model_dir, os.sched_getaffinity(0), llama_build.cache_dir())
    for line in problems:
        print(f"MISMATCH {line}")
    print(
        f"llama-server greedy output vs transformers: {len(CHECK_PROMPT_LENS) - len(problems)}/"
        f"{len(CHECK_PROMPT_LENS)} prompts match over {CHECK_OUTPUT_LEN} tokens"
    )
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
