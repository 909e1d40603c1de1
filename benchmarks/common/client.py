"""Asyncio streaming client for the gateway's ``/v1/completions``: open loop (scheduled arrivals) or
closed loop (a fixed number of requests in flight), recording each request's timeline.

Every request sends token ids, greedy, ``ignore_eos`` and ``max_tokens`` = the workload's output
length, with ``stream: true`` and ``stream_options.include_usage`` so the server's token count comes
back in the last chunk. A chunk whose ``choices`` is non-empty carries tokens and is timestamped.

While a run is in flight an optional sampler polls the decode workers' ``/metrics`` for the KV slots
of their in-use blocks and how many of those hold a live token (one scrape, one consistent reading
of the block manager) — the data for the KV memory utilisation figure.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx

from benchmarks.common.metric_text import selected_sum
from benchmarks.common.metrics import RequestTimeline
from benchmarks.common.workload import BenchRequest
from benchmarks.serve.workloads import Scheduled


@dataclass(slots=True)
class Target:
    url: str  # gateway base URL, e.g. http://127.0.0.1:8000
    model: str  # the served model id (from /v1/models)
    api_key: str = ""  # sent as a bearer token when set (a server started with --api-key)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(target: Target, r: BenchRequest) -> dict:
    return {
        "model": target.model,
        "prompt": list(r.prompt_token_ids),
        "max_tokens": r.output_len,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_one(client: httpx.AsyncClient, target: Target, item: Scheduled) -> RequestTimeline:
    r = item.request
    t = RequestTimeline(r.index, item.tag, r.prompt_len, r.output_len, send_s=time.perf_counter())
    for attempt in range(2):
        try:
            await _stream(client, target, r, t)
            break
        except httpx.RemoteProtocolError as exc:
            if attempt or t.chunk_s:
                t.error = f"{type(exc).__name__}: {exc}"
                break
            # Nothing came back: the server closed the kept-alive connection just as it was reused
            # (llama-server's HTTP library closes one after a few requests), so the request never
            # reached it. Sent again on a new connection, as the OpenAI SDK does; send_s stays.
        except httpx.HTTPError as exc:
            t.error = f"{type(exc).__name__}: {exc}"
            break
    if not t.error and t.output_tokens != r.output_len:
        t.error = f"asked for {r.output_len} tokens, usage says {t.output_tokens}"
    return t


async def _stream(client: httpx.AsyncClient, target: Target, r: BenchRequest, t: RequestTimeline) -> None:
    """One streamed completion into ``t``: chunk times, text, usage; an error body or chunk in ``t.error``."""
    async with client.stream(
        "POST", f"{target.url}/v1/completions", json=request_body(target, r), headers=target.headers
    ) as response:
        if response.status_code != 200:
            t.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.perf_counter()
            chunk = json.loads(line[6:])
            if "error" in chunk:
                t.error = str(chunk["error"])[:200]
                return
            if chunk.get("choices"):
                t.chunk_s.append(now)
                t.text += chunk["choices"][0].get("text") or ""
            if chunk.get("usage"):
                t.output_tokens = int(chunk["usage"]["completion_tokens"])


def _client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=512))


async def run_open_loop(
    target: Target, schedule: list[Scheduled], sampler: KvSampler | None = None
) -> tuple[list[RequestTimeline], float]:
    """Sends each request at its ``at_s``; returns the timelines (workload order) and the wall time
    from the start to the last response."""
    async with _client() as client:
        sampling = asyncio.create_task(sampler.run(client)) if sampler else None
        start = time.perf_counter()
        tasks = []
        for item in schedule:
            delay = start + item.at_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_one(client, target, item)))
        timelines = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if sampling:
            sampling.cancel()
    return sorted(timelines, key=lambda t: t.index), duration


async def run_closed_loop(
    target: Target, requests: list[BenchRequest], concurrency: int, tag: str, sampler: KvSampler | None = None
) -> tuple[list[RequestTimeline], float]:
    """``concurrency`` requests in flight at all times (a new one as soon as one finishes)."""
    queue: asyncio.Queue[BenchRequest] = asyncio.Queue()
    for r in requests:
        queue.put_nowait(r)
    timelines: list[RequestTimeline] = []

    async def worker(client: httpx.AsyncClient) -> None:
        while not queue.empty():
            r = queue.get_nowait()
            timelines.append(await send_one(client, target, Scheduled(0.0, r, tag)))

    async with _client() as client:
        sampling = asyncio.create_task(sampler.run(client)) if sampler else None
        start = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        duration = time.perf_counter() - start
        if sampling:
            sampling.cancel()
    return sorted(timelines, key=lambda t: t.index), duration


def parse_metric(body: str, name: str) -> float:
    """Sum of every sample of ``name`` (any labels; ``name{label="value"}`` selects) in a Prometheus text
    exposition; MissingMetric (benchmarks/common/metric_text.py) when ``name`` has none."""
    return selected_sum(body, name)


@dataclass(slots=True)
class KvSampler:
    """Reads the decode workers' exact KV gauges while a run is in flight: the live token slots and the
    blocks in use, both from one scrape of each worker (set together, after the same engine step)."""

    metrics_urls: list[str]  # /metrics of every worker that holds decode KV
    block_size: int
    interval_s: float = 0.25
    samples: list[tuple[int, int]] = field(default_factory=list)  # (live token slots, allocated slots)
    num_discarded: int = 0  # scrapes that failed

    async def run(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                bodies = [(await client.get(url, timeout=5.0)).text for url in self.metrics_urls]
            except httpx.HTTPError:
                self.num_discarded += 1
                continue
            live = sum(parse_metric(b, "pdserve:kv_live_slots") for b in bodies)
            blocks = sum(parse_metric(b, "pdserve:kv_blocks_in_use") for b in bodies)
            if blocks:  # an idle moment says nothing about how well blocks are filled
                self.samples.append((int(live), int(blocks) * self.block_size))
