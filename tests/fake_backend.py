"""A deterministic stand-in for the worker pools, a test tokenizer, and a live uvicorn server for tests.

FakeBackend answers every request with the same token sequence (cut at max_tokens) for each of its n
completions (events interleaved by index), with made-up but deterministic logprobs (and prompt logprobs,
when asked, on each completion's first event), and reports prefix-cache hits from the block hashes of
prompts it has seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from gateway.workers.backend import Backend, CompletionEvent, GenerationRequest, NoCapacity, TokenLogprob
from protocol.hashing import block_hashes

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n"
    "{{ message['content'] | trim }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}"
    "<|assistant|>\n"
    "{% endif %}"
)
TRAINING_TEXT = (
    "The quick brown fox jumps over the lazy dog. Hello world, hello there! "
    "Stop here. A cat sat on the mat and it was happy. "
) * 20


def make_test_tokenizer(
    directory: Path, chat_template: str = CHAT_TEMPLATE, more_special: tuple[str, ...] = ()
) -> Path:
    """Byte-level BPE trained in memory, saved the way real checkpoints are (transformers' save_pretrained);
    ``more_special``: more special tokens (a model's markers, e.g. Mistral's [TOOL_CALLS])."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", *more_special],
    )
    tok.train_from_iterator([TRAINING_TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = chat_template
    fast.save_pretrained(str(directory))
    return directory


@dataclass
class FakeBackend(Backend):
    output_ids: list[int]  # every request generates a prefix of this
    block_size: int = 4
    token_delay_s: float = 0.0
    first_event_delay_s: float = 0.0  # before a request's first event (as if queued for a worker)
    tokens_per_event: int = 1
    capacity: bool = True  # has_capacity(); False -> the gateway's own admission says 503
    no_capacity_retry_after: int | None = None  # set: generate raises NoCapacity(this)
    error_after_tokens: int | None = None  # set: an error event after this many tokens
    refusal: str | None = None  # set: the first event refuses the request as invalid, with this error
    ready: bool = True
    received: list[GenerationRequest] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    _seen_hashes: set[int] = field(default_factory=set)

    def reset(self) -> FakeBackend:
        """Back to a fresh backend's state with the same outputs (tests share one live server)."""
        fresh = FakeBackend(output_ids=self.output_ids)
        for f in dataclasses.fields(FakeBackend):
            setattr(self, f.name, getattr(fresh, f.name))
        return self

    def is_ready(self) -> bool:
        return self.ready

    def has_capacity(self) -> bool:
        return self.capacity

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    def _cached_tokens(self, prompt: list[int], cache_salt: str = "") -> int:
        hashes = block_hashes(prompt, self.block_size, cache_salt)
        hits = 0
        for h in hashes:
            if h not in self._seen_hashes:
                break
            hits += 1
        self._seen_hashes.update(hashes)
        return hits * self.block_size

    @staticmethod
    def logprob_of(position: int) -> float:
        return -0.25 * (position + 1)

    def _logprobs(self, start: int, ids: list[int], k: int) -> list[TokenLogprob]:
        # the sampled token first among its top-k, then the ids after it, each a bit less likely
        return [
            TokenLogprob(t, self.logprob_of(start + i), [(t + j, self.logprob_of(start + i) - j) for j in range(k)])
            for i, t in enumerate(ids)
        ]

    @staticmethod
    def prompt_logprob_of(position: int) -> tuple[float, int]:
        """(logprob, rank) of prompt token ``position`` (>= 1): ranks cycle 1, 2, 3 so that the token is
        sometimes in a top-k and sometimes not."""
        return -1.0 - 0.5 * position, 1 + position % 3

    @staticmethod
    def prompt_top(token_id: int, position: int, k: int) -> list[tuple[int, float]]:
        """The top ``k`` at prompt position ``position``: the prompt token at its rank, other ids (single
        bytes, valid in any byte-level vocabulary) around it, each 0.25 less likely than the one before."""
        logprob, rank = FakeBackend.prompt_logprob_of(position)
        return [
            (token_id if j == rank - 1 else (token_id + 1 + j) % 256, logprob + 0.25 * (rank - 1 - j)) for j in range(k)
        ]

    def _prompt_logprobs(self, prompt: list[int], k: int) -> list[TokenLogprob]:
        out = []
        for position in range(1, len(prompt)):  # the first prompt token has no logprob
            logprob, rank = self.prompt_logprob_of(position)
            out.append(TokenLogprob(prompt[position], logprob, self.prompt_top(prompt[position], position, k), rank))
        return out

    async def generate(self, request: GenerationRequest):
        if self.no_capacity_retry_after is not None:
            raise NoCapacity(self.no_capacity_retry_after, "all decode workers are full")
        self.received.append(request)
        if self.first_event_delay_s:
            await asyncio.sleep(self.first_event_delay_s)
        if self.refusal is not None:
            yield CompletionEvent(error=self.refusal, refused=True)
            return
        s = request.sampling
        out = self.output_ids[: s.max_tokens]
        finish = "length" if len(out) < len(self.output_ids) else "stop"
        cached = self._cached_tokens(request.prompt_token_ids, request.sampling.cache_salt)
        prompt_logprobs = (
            None if s.prompt_logprobs is None else self._prompt_logprobs(request.prompt_token_ids, s.prompt_logprobs)
        )
        for start in range(0, len(out), self.tokens_per_event):
            if self.error_after_tokens is not None and start >= self.error_after_tokens:
                yield CompletionEvent(error="decode worker lost")
                return
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
            ids = out[start : start + self.tokens_per_event]
            last = start + len(ids) >= len(out)
            for index in range(s.n):
                yield CompletionEvent(
                    index,
                    ids,
                    self._logprobs(start, ids, s.logprobs) if s.logprobs is not None else None,
                    finish_reason=finish if last else None,
                    num_cached_tokens=cached if start == 0 else None,
                    queue_time_s=0.001 if start == 0 else None,
                    prompt_logprobs=prompt_logprobs if start == 0 else None,
                )


class LiveServer:
    """The app served by a real uvicorn on 127.0.0.1 (ephemeral port) in a background thread."""

    def __init__(self, app, lifespan: str = "off", **uvicorn_options) -> None:
        config = uvicorn.Config(
            app, host="127.0.0.1", port=0, log_level="warning", lifespan=lifespan, **uvicorn_options
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


OUTPUT_TEXT = "Hello world. Stop here, 日本語 é! The end."
MODEL = "test-model"
API_KEYS = ["key-one", "key-two"]


def make_gateway(
    tokenizer_dir: Path,
    max_model_len: int = 64,
    max_body_bytes: int = 1 << 16,
    registry=None,
    request_timeout_s: float | None = None,
    limits_given: dict | None = None,
    **params_given,
):
    """The app over a FakeBackend answering OUTPUT_TEXT; returns (app, backend). ``params_given``: other
    GatewayParams fields (chat_parsers, response_store, allowed_origins); ``limits_given``: other
    ServingLimits fields."""
    from gateway.http.app import GatewayParams, build_app
    from gateway.serving.pipeline import ServingLimits
    from gateway.text.tokenizer import Tokenizer

    tokenizer = Tokenizer(tokenizer_dir)
    backend = FakeBackend(output_ids=tokenizer.encode(OUTPUT_TEXT, add_special_tokens=False))
    limits = ServingLimits(
        model_name=MODEL,
        max_model_len=max_model_len,
        max_concurrent_requests=8,
        retry_after_s=3,
        request_timeout_s=request_timeout_s,
        **(limits_given or {}),
    )
    params = GatewayParams(
        tokenizer, backend, limits, api_keys=list(API_KEYS), max_body_bytes=max_body_bytes, registry=registry
    )
    for name, value in params_given.items():
        setattr(params, name, value)
    return build_app(params), backend


@contextlib.contextmanager
def live_gateway(tokenizer_dir: Path, uvicorn_options: dict | None = None, **gateway_kwargs):
    """``make_gateway`` served by a LiveServer; ``server.backend`` is its FakeBackend. ``uvicorn_options``:
    more uvicorn.Config arguments (gateway/http/limits.py's, say)."""
    app, backend = make_gateway(tokenizer_dir, **gateway_kwargs)
    with LiveServer(app, **(uvicorn_options or {})) as server:
        server.backend = backend
        yield server


def num_requests_running(base_url: str) -> float:
    """The gateway's in-flight gauge, read from /metrics: a leak check after each scenario."""
    import httpx

    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith("pdserve:num_requests_running "):
            return float(line.split()[1])
    raise AssertionError("pdserve:num_requests_running missing from /metrics")


def wait_until(predicate, what: str, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
