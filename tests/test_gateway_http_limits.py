"""Attacks on the gateway's HTTP side, over real sockets against a real uvicorn (gateway/http/limits.py):
slowloris headers and bodies are dropped within their limits while ordinary requests are served; a
client that never reads its stream is dropped and its request aborted; too many connections get a
503; a huge grammar is a 400; a stream that waits gets SSE keep-alive comments. No timing asserts:
each limit is short, every wait for an outcome generous, and each attack could go on far longer."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from gateway.http.limits import HttpLimits, uvicorn_options
from protocol.serving import MAX_STRUCTURED_OUTPUT_CHARS
from tests.fake_backend import API_KEYS, MODEL, live_gateway, num_requests_running, wait_until
from tests.hostile_attacks import dribble_until_dropped

HEADERS = {"Authorization": f"Bearer {API_KEYS[0]}"}
LIMITS = HttpLimits(header_timeout_s=1.0, body_timeout_s=1.0, write_timeout_s=1.0, max_connections=None)
GENEROUS_S = 60.0


@pytest.fixture(scope="module")
def live(tok_dir):
    with live_gateway(
        tok_dir,
        max_model_len=1 << 24,
        max_body_bytes=1 << 20,
        uvicorn_options=uvicorn_options(LIMITS),
        limits_given={"sse_keepalive_s": 0.3},
    ) as server:
        yield server


def connect(live, rcvbuf: int | None = None) -> socket.socket:
    host, port = live.base_url.removeprefix("http://").split(":")
    sock = socket.socket()
    if rcvbuf is not None:  # before connect, so the advertised window stays small
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect((host, int(port)))
    return sock


def endless_headers():
    yield b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n"
    while True:  # headers that never end, a byte at a time: only the header deadline stops this
        yield from (bytes([c]) for c in b"x-slow: still-coming\r\n")


def ordinary_completion(live) -> httpx.Response:
    return httpx.post(
        live.base_url + "/v1/completions",
        headers=HEADERS,
        timeout=30,
        json={"model": MODEL, "prompt": "Hello", "max_tokens": 3},
    )


def test_slowloris_headers_are_dropped_while_others_are_served(live, backend):
    sock = connect(live)
    served: list[int] = []
    dropped = threading.Event()

    def attack() -> None:
        if dribble_until_dropped(sock, endless_headers(), give_up_s=GENEROUS_S):
            dropped.set()

    attacker = threading.Thread(target=attack)
    attacker.start()
    while not dropped.is_set() and attacker.is_alive():  # the gateway keeps serving meanwhile
        served.append(ordinary_completion(live).status_code)
        time.sleep(0.05)
    attacker.join()
    sock.close()
    assert dropped.is_set(), "the slowloris connection was never dropped"
    assert served and set(served) == {200}


def test_a_body_dribbled_past_its_deadline_is_dropped(live, backend):
    sock = connect(live)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100000\r\n\r\n"
    )
    assert dribble_until_dropped(sock, [head, *(b" " for _ in range(100000))], give_up_s=GENEROUS_S)
    sock.close()
    assert backend.received == []
    assert ordinary_completion(live).status_code == 200


def test_a_client_that_never_reads_its_stream_is_dropped_and_its_request_aborted(live, backend):
    saved = backend.output_ids
    backend.output_ids = saved * 100000  # megabytes more than any socket buffers: the gateway must wait on it
    backend.tokens_per_event = 4096
    try:
        sock = connect(live, rcvbuf=65536)
        body = json.dumps(
            {"model": MODEL, "prompt": "Hello", "max_tokens": len(backend.output_ids), "stream": True}
        ).encode()
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            + f"authorization: Bearer {API_KEYS[0]}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_until(lambda: len(backend.received) == 1, "request reached the backend", GENEROUS_S)
        rid = backend.received[0].request_id
        wait_until(lambda: rid in backend.aborted, "the stalled stream's request aborted", GENEROUS_S)
        wait_until(lambda: num_requests_running(live.base_url) == 0, "no request left in flight", GENEROUS_S)
        sock.settimeout(GENEROUS_S)  # the gateway let go: what the kernel holds drains, then the end
        try:
            while sock.recv(1 << 20):
                pass
        except ConnectionResetError:
            pass
        sock.close()
    finally:
        backend.output_ids = saved
    assert ordinary_completion(live).status_code == 200


def test_too_many_connections_get_a_503(tok_dir):
    limits = HttpLimits(header_timeout_s=GENEROUS_S, max_connections=4)
    with live_gateway(tok_dir, uvicorn_options=uvicorn_options(limits)) as server:
        idle = [connect(server) for _ in range(4)]
        with httpx.Client(timeout=30) as client:  # a fresh connection each time: no keep-alive reuse
            refused = client.get(server.base_url + "/health", headers={"connection": "close"})
            assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
            assert refused.json() == {
                "error": {
                    "message": "service unavailable: this server has 4 connections open, its limit "
                    "(gateway.max_connections); retry after 1 s",
                    "type": "service_unavailable",
                    "param": None,
                    "code": "no_capacity",
                }
            }
            for sock in idle:
                sock.close()
            wait_until(
                lambda: client.get(server.base_url + "/health", headers={"connection": "close"}).status_code == 200,
                "served again once the idle connections closed",
                GENEROUS_S,
            )


def test_a_huge_grammar_is_a_400_naming_the_limit(live, backend):
    pattern = "a" * (MAX_STRUCTURED_OUTPUT_CHARS + 1)
    r = httpx.post(
        live.base_url + "/v1/completions",
        headers=HEADERS,
        timeout=30,
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, "structured_outputs": {"regex": pattern}},
    )
    assert r.status_code == 400
    assert f"at most {MAX_STRUCTURED_OUTPUT_CHARS}" in r.json()["error"]["message"]
    assert backend.received == []


def stream_lines(live, **body) -> tuple[int, list[str]]:
    with httpx.stream(
        "POST",
        live.base_url + "/v1/completions",
        headers=HEADERS,
        timeout=30,
        json={"model": MODEL, "prompt": "Hello", "stream": True, **body},
    ) as r:
        return r.status_code, [line for line in r.iter_lines() if line]


def test_a_stream_waiting_for_its_first_token_gets_keep_alives(live, backend):
    backend.first_event_delay_s = 1.5  # queued 5 keep-alive intervals
    status, lines = stream_lines(live, max_tokens=3)
    assert status == 200
    first_data = next(i for i, line in enumerate(lines) if line.startswith("data: "))
    assert first_data >= 1 and set(lines[:first_data]) == {": keep-alive"}
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(c["choices"][0]["text"] for c in data) and lines[-1] == "data: [DONE]"


def test_a_refusal_after_the_stream_began_is_told_in_band(live, backend):
    backend.first_event_delay_s = 1.5
    backend.refusal = "the grammar does not compile"
    status, lines = stream_lines(live, max_tokens=3)
    assert status == 200 and lines[0] == ": keep-alive"
    [error] = [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]
    assert error["error"]["message"] == "the grammar does not compile"
    assert error["error"]["type"] == "invalid_request_error"
    assert num_requests_running(live.base_url) == 0


def test_a_quick_refusal_is_still_a_proper_400(live, backend):
    backend.refusal = "the grammar does not compile"
    status, _ = stream_lines(live, max_tokens=3)
    assert status == 400


def test_the_openai_client_reads_through_keep_alives(live, backend, hf_tok):
    import openai

    backend.first_event_delay_s, backend.token_delay_s = 0.7, 0.4  # keep-alives before and between tokens
    client = openai.OpenAI(base_url=live.base_url + "/v1", api_key=API_KEYS[0], max_retries=0)
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == hf_tok.decode(backend.output_ids[:3])
    status, lines = stream_lines(live, max_tokens=3)  # the same stream, raw: the comments were there
    assert status == 200 and lines.count(": keep-alive") >= 2
