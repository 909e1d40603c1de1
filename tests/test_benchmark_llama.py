"""The llama-server baseline's pieces that need no llama.cpp build: its command line, the GGUF
converter's pre-tokenizer mapping, the EOG ids it masks and the transformers reference that masks the
same, and the streams workload, plan and equal-concurrency headlines it is compared on."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.common.metrics import RequestTimeline, Slo, summarize
from benchmarks.peers import gguf_convert, hf_baseline
from benchmarks.peers.llama_server import LlamaConfig, eog_ids
from benchmarks.serve import plan as P
from benchmarks.serve import workloads as W
from benchmarks.serve.report import (
    ALL_AT_ONCE,
    Report,
    equal_concurrency,
    headline_line,
    make_run,
    print_streams_table,
    streams_load,
)
from tests.test_benchmark_workload import tiny_llama


def test_llama_server_command_line(tmp_path):
    config = LlamaConfig(threads=0, parallel=16, flash_attn=True, ctx_per_slot=384).resolved(2)
    assert config.threads == 2 and config.resolved(7) == config  # threads given: kept
    argv = config.argv(tmp_path / "llama-server", tmp_path / "m.gguf", 8123)
    assert argv == [
        str(tmp_path / "llama-server"),
        *("-m", str(tmp_path / "m.gguf"), "--host", "127.0.0.1", "--port", "8123"),
        *(
            "-t",
            "2",
            "-tb",
            "2",
            "--parallel",
            "16",
            "--cont-batching",
            "-c",
            str(16 * 384),
            "--no-webui",
            "--slots",
            "-fa",
        ),
    ]
    assert "-fa" not in LlamaConfig(1, 1, False, 64).argv(tmp_path / "s", tmp_path / "m", 1)
    assert config.label == "-t 2 --parallel 16 fa on"


def _tokenizer_dir(tmp_path, pre_tokenizer: dict | None):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": pre_tokenizer}))
    return tmp_path


def _converter():
    """Stands in for convert_hf_to_gguf's module: its TextModel knows no hash (as for our tokenizer)."""

    class TextModel:
        def get_vocab_base_pre(self, tokenizer) -> str:
            raise NotImplementedError("BPE pre-tokenizer was not recognized")

    return type("convert_hf_to_gguf", (), {"TextModel": TextModel})


def test_unknown_hash_of_a_gpt2_byte_level_tokenizer_maps_to_gpt2_and_any_other_still_fails(tmp_path):
    from cluster.make_model import build_tokenizer

    ours = tmp_path / "ours"
    build_tokenizer(300).save_pretrained(ours)  # pdserve's offline tokenizer, as make_model writes it
    assert gguf_convert.is_gpt2_byte_level(ours)
    converter = _converter()
    gguf_convert._map_our_pre_tokenizer(converter, ours)
    assert converter.TextModel().get_vocab_base_pre(None) == "gpt-2"

    (tmp_path / "other").mkdir()
    other = _tokenizer_dir(tmp_path / "other", {"type": "Metaspace", "replacement": "▁"})
    assert not gguf_convert.is_gpt2_byte_level(other)
    converter = _converter()
    gguf_convert._map_our_pre_tokenizer(converter, other)
    with pytest.raises(NotImplementedError):
        converter.TextModel().get_vocab_base_pre(None)


def test_eog_ids_are_the_config_and_generation_config_eos(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 2}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 4]}))
    assert eog_ids(tmp_path) == [2, 4]
    (tmp_path / "generation_config.json").unlink()
    assert eog_ids(tmp_path) == [2]


def test_suppressed_ids_are_masked_out_of_the_greedy_reference():
    model = tiny_llama()
    prompt = (5, 17, 33, 2, 61)
    free = hf_baseline.generate_batch(model, [prompt], 6)[0]
    masked = sorted(set(free[:3]))  # the tokens it would pick: masking them must change the output
    got = hf_baseline.generate_batch(model, [prompt], 6, suppress_ids=masked)[0]
    ids = list(prompt)
    with torch.inference_mode():  # independent oracle: full recompute, masked argmax
        for _ in range(6):
            logits = model(torch.tensor([ids])).logits[0, -1]
            logits[masked] = -math.inf
            ids.append(int(logits.argmax()))
    assert got == ids[len(prompt) :]
    assert not set(got) & set(masked)


def test_streams_levels_have_exact_shapes_and_fresh_prompts():
    spec = W.StreamsSpec(
        vocab_size=500, concurrencies=(1, 16, 32), prompt_len=256, output_len=128, rounds=2, min_requests=8, seed=3
    )
    levels = W.streams(spec)
    assert [(c, len(rs)) for c, rs in levels] == [(1, 8), (16, 32), (32, 64)]  # max(2c, 8)
    for _, requests in levels:
        assert [r.index for r in requests] == list(range(len(requests)))
        assert {(r.prompt_len, r.output_len) for r in requests} == {(256, 128)}
        assert all(0 <= t < 500 for r in requests for t in r.prompt_token_ids)
    first_blocks = [r.prompt_token_ids[:16] for _, rs in levels for r in rs]
    assert len(set(first_blocks)) == len(first_blocks)  # no level hits a cache the one before filled
    assert W.streams(spec) == levels  # seeded
    mixed_blocks = {r.prompt_token_ids[:16] for r in W.mixed(500, 64, 3) + W.paced_mixed(500, 64, 3)}
    assert not mixed_blocks & set(first_blocks)


def test_plan_runs_llama_beside_pdserve_and_narrows_to_the_streams_comparison():
    for quick in (True, False):
        p = P.plan(quick)
        by_name = {s.name: s for s in p.systems}
        assert list(by_name)[:4] == [
            "disagg",
            "coloc",
            "nocache",
            "llama",
        ]  # then the same-GGUF pairs (test_benchmark_gguf.py)
        assert by_name["llama"].llama == P.LLAMA_CONFIG and by_name["disagg"].llama is None
        for name in ("disagg", "coloc", "llama"):
            assert "streams" in by_name[name].workloads
        assert "mixed_closed" in by_name["llama"].workloads  # equal concurrency with transformers too
    assert P.plan(False).systems[3].workloads == P.WORKLOADS
    narrowed = P.select(P.plan(True), ["llama", "coloc", "disagg"], ["streams"])
    assert [(s.name, s.workloads) for s in narrowed.systems] == [
        ("disagg", ("streams",)),
        ("coloc", ("streams",)),
        ("llama", ("streams",)),
    ]
    twins = P.with_insecure_twins(narrowed)
    assert [s.name for s in twins.systems] == ["disagg", "disagg-insecure", "coloc", "coloc-insecure", "llama"]
    # every workload's longest request fits a slot, and the most requests in flight fit the slots
    assert P.LLAMA_CONFIG.ctx_per_slot >= 2048 + 8 and P.LLAMA_CONFIG.parallel >= 64


def _run(system: str, workload: str, load: str, tps: float, itl: float, ttft: float):
    """A run of 4 requests of 10 tokens over 40/tps seconds, TTFT ``ttft``, chunks ``itl`` apart."""
    timelines = [
        RequestTimeline(i, "x", 8, 10, 0.0, [ttft + k * itl for k in range(10)], output_tokens=10) for i in range(4)
    ]
    return make_run(system, workload, load, math.inf, summarize(timelines, 40 / tps, Slo(9, 9)), timelines)


def test_equal_concurrency_headlines_from_known_runs(capsys):
    report = Report(hf_tps=100.0, hf_by_batch={16: 100.0, 32: 125.0, 64: 120.0})
    report.runs = [
        _run("disagg", "mixed", "closed c=16", 250.0, 0.01, 0.5),
        _run("disagg", "mixed", ALL_AT_ONCE, 400.0, 0.01, 0.5),
        _run("disagg", "streams", streams_load(1), 50.0, 0.020, 0.1),
        _run("coloc", "streams", streams_load(1), 60.0, 0.015, 0.1),
        _run("llama", "streams", streams_load(1), 100.0, 0.006, 0.05),
        _run("disagg", "streams", streams_load(16), 300.0, 0.05, 2.0),
        _run("coloc", "streams", streams_load(16), 270.0, 0.05, 3.0),
        _run("llama", "streams", streams_load(16), 250.0, 0.05, 4.0),
        _run("coloc", "streams", streams_load(32), 360.0, 0.08, 6.0),  # disagg's c=32 left out
    ]
    values = equal_concurrency(report, (1, 16, 32))
    assert values == pytest.approx(
        {
            "vs_hf_static_equal_concurrency": 250 / 100,
            "vs_hf_best_batch": 400 / 125,  # the best batch, 32
            "vs_llama_1": 60 / 100,  # coloc is pdserve's better layout at one stream
            "vs_llama_16": 300 / 250,
            "vs_llama_32": math.nan,  # no llama run at 32
            "vs_llama_1_itl": 0.006 / 0.015,
            "ttft_p99_vs_llama_16": 4.0 / 2.0,  # against disagg's, the layout with the throughput
            "ttft_p99_vs_llama_32": math.nan,
        },
        nan_ok=True,
    )
    assert headline_line({"vs_llama_1": 0.6, "vs_llama_32": math.nan}) == "vs_llama_1=0.60 vs_llama_32=nan"
    print_streams_table(report, ["disagg", "coloc", "nocache", "llama"], (1, 16, 32))
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[3:]}  # after the title and header
    assert list(rows) == ["disagg", "coloc", "llama"]  # nocache ran no streams
    assert rows["llama"].split() == ["llama", "100.0,", "6,", "50", "250.0,", "50,", "4000", "—"]


def _sse_server(num_drops: int):
    """A raw HTTP server that closes the first ``num_drops`` connections after reading a request, without
    a byte of answer (as a server closing a kept-alive connection does), then streams two tokens."""
    import asyncio

    body = (
        b'data: {"choices": [{"text": "a"}]}\n\n'
        b'data: {"choices": [{"text": "b"}], "usage": {"completion_tokens": 2}}\n\n'
        b"data: [DONE]\n\n"
    )
    seen = []

    async def handle(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        seen.append(1)
        if len(seen) > num_drops:
            head = f"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            await writer.drain()
        writer.close()

    return asyncio.start_server(handle, "127.0.0.1", 0), seen


@pytest.mark.parametrize("num_drops, ok", [(0, True), (1, True), (2, False)])
def test_a_request_the_server_never_answered_is_sent_once_more(num_drops, ok):
    import asyncio

    import httpx

    from benchmarks.common.client import Target, send_one
    from benchmarks.common.workload import BenchRequest
    from benchmarks.serve.workloads import Scheduled

    async def run():
        starting, seen = _sse_server(num_drops)
        server = await starting
        port = server.sockets[0].getsockname()[1]
        async with httpx.AsyncClient() as client:
            t = await send_one(
                client, Target(f"http://127.0.0.1:{port}", "m"), Scheduled(0, BenchRequest(0, (1,), 2), "x")
            )
        server.close()
        return t, len(seen)

    t, connections = asyncio.run(run())
    assert connections == min(num_drops + 1, 2)  # at most one more try
    assert t.ok is ok
    if ok:
        assert (t.output_tokens, t.text, len(t.chunk_s)) == (2, "ab", 2)
    else:
        assert t.error.startswith("RemoteProtocolError")
