"""A steady load of concurrent greedy completions whose exact outputs are known beforehand, and the
fate of every request it sent: exact, a clear error, or a failure (wrong text, hang, silent drop)."""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import httpx
import torch

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from gateway.text.detokenizer import IncrementalDetokenizer
from gateway.text.tokenizer import Tokenizer

MAX_TOKENS = 24
REQUEST_DEADLINE_S = 45.0  # a request not answered by then hangs (the gateway's own deadline is 30 s)
CLEAR_ERROR_STATUS = (500, 502, 503, 504)


@dataclass(slots=True)
class Prompt:
    token_ids: list[int]
    expected: str  # the single engine's greedy text


def make_prompts(model: str, block_size: int, count: int, seed: int = 0) -> list[Prompt]:
    """``count`` distinct prompts of 120-360 tokens with their reference outputs: the token ids from one
    batched greedy run of engine.llm.LLM (the same model without the cluster), as text the way the
    gateway renders ids (incremental, special tokens skipped, partial UTF-8 held back)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [
        torch.randint(5, 768, (int(torch.randint(120, 360, (1,), generator=gen)),), generator=gen).tolist()
        for _ in range(count)
    ]
    llm = LLM(model, block_size=block_size)
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    tokenizer = Tokenizer(model)
    return [Prompt(p, as_gateway_text(tokenizer, p, o.outputs[0].token_ids)) for p, o in zip(prompts, outs)]


def as_gateway_text(tokenizer: Tokenizer, prompt: list[int], token_ids: list[int]) -> str:
    detok = IncrementalDetokenizer(tokenizer, prompt)
    return "".join(detok.add([t]) for t in token_ids) + detok.flush()


@dataclass(slots=True)
class Outcome:
    kind: str  # "ok" | "error" (HTTP 5xx with an OpenAI error body) | "disconnected" | "corrupt" | "hung" | "bad"
    started: float  # time.monotonic()
    ended: float
    detail: str = ""


def send(url: str, model: str, prompt: Prompt, cache_salt: str = "") -> Outcome:
    """``cache_salt`` (vLLM's): the prompt shares no prefix-cache block with any other request, so every
    worker computes it whole; the greedy text is the same."""
    started = time.monotonic()
    body = {
        "model": model,
        "prompt": [prompt.token_ids],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    try:
        response = httpx.post(
            f"{url}/v1/completions",
            timeout=REQUEST_DEADLINE_S,
            json=body | ({"cache_salt": cache_salt} if cache_salt else {}),
        )
    except httpx.TimeoutException as exc:
        return Outcome("hung", started, time.monotonic(), f"no answer within {REQUEST_DEADLINE_S:.0f} s: {exc!r}")
    except httpx.TransportError as exc:  # refused, reset, unreachable: the client knows at once
        return Outcome("disconnected", started, time.monotonic(), repr(exc)[:200])
    ended = time.monotonic()
    if response.status_code == 200:
        text = response.json()["choices"][0]["text"]
        return Outcome(
            "ok" if text == prompt.expected else "corrupt",
            started,
            ended,
            "" if text == prompt.expected else f"got {text[:60]!r}, expected {prompt.expected[:60]!r}",
        )
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = ""
    clear = response.status_code in CLEAR_ERROR_STATUS and message
    return Outcome(
        "error" if clear else "bad", started, ended, f"{response.status_code}: {message or response.text[:120]}"
    )


@dataclass
class Load:
    """``clients`` threads, each sending one request after another until ``stop``."""

    url: str
    model: str
    prompts: list[Prompt]
    clients: int = 8
    outcomes: list[Outcome] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._next = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        self._bursts = itertools.count()

    def start(self) -> Load:
        for thread in self._threads:
            thread.start()
        return self

    def _client(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                prompt = self.prompts[self._next % len(self.prompts)]
                self._next += 1
            outcome = send(self.url, self.model, prompt)
            with self._lock:
                self.outcomes.append(outcome)
            if outcome.kind != "ok":
                time.sleep(0.2)  # a gateway that is down refuses at once: do not spin

    def burst(self, prompts: list[Prompt]) -> None:
        """Send each of ``prompts`` once, all at once beside the clients, under a cache salt new to the
        cluster: every one of them is computed whole by a prefill worker (none hits a prefix cache), so
        more arriving together than the prefill pool runs at once must queue there. Their outcomes are
        counted and checked with the clients'."""
        salt = f"chaos-burst-{next(self._bursts)}-{time.monotonic_ns()}"
        for prompt in prompts:
            thread = threading.Thread(target=self._send_once, args=(prompt, salt), daemon=True)
            self._threads.append(thread)
            thread.start()

    def _send_once(self, prompt: Prompt, cache_salt: str) -> None:
        outcome = send(self.url, self.model, prompt, cache_salt)
        with self._lock:
            self.outcomes.append(outcome)

    def send_from(self, prompts: list[Prompt]) -> None:
        """Go on with these prompts instead (those in flight finish)."""
        with self._lock:
            self.prompts, self._next = prompts, 0

    def first_ok_since(self, since: float) -> Outcome | None:
        """The earliest-answered exact request among those sent at or after ``since``."""
        with self._lock:
            return min(
                (o for o in self.outcomes if o.kind == "ok" and o.started >= since), key=lambda o: o.ended, default=None
            )

    def stop(self) -> list[Outcome]:
        """Stop sending; every request in flight ends by its deadline (the client's timeout)."""
        self._stopping.set()
        for thread in self._threads:
            thread.join(REQUEST_DEADLINE_S + 5)
        assert not any(t.is_alive() for t in self._threads), "a client thread outlived its request deadline"
        return list(self.outcomes)
