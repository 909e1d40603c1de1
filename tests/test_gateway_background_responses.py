"""Background responses (``background: true``), read by the stock openai client in strict mode.

Expectations: the POST answers ``queued`` with nothing generated; the stored response moves to
in_progress, then ends as a foreground request of the same input does (same output, same token counts);
a cancel stores it ``cancelled`` and the fake backend records the abort of its one request
(``<response id>-0``); a response that ended is left as it ended; every scenario ends with nothing
running (the gauges at 0). The fake backend's token_delay_s keeps a response running (OUTPUT_TEXT's 33
tokens at 0.2 s: over 6 s) far longer than a test needs to reach it; every wait polls with a deadline."""

from __future__ import annotations

import asyncio

import anyio
import httpx
import openai
import pytest

from gateway.dialects.responses.background import BackgroundResponses
from gateway.dialects.responses.store import ResponseStore
from tests.fake_backend import API_KEYS, MODEL, OUTPUT_TEXT, LiveServer, live_gateway, make_gateway, wait_until

SLOW_TOKEN_S = 0.2  # with OUTPUT_TEXT's tokens: a response runs for seconds


@pytest.fixture(scope="module")
def live(tok_dir):
    with live_gateway(tok_dir, max_model_len=1024) as server:
        yield server


def metric(live, series: str) -> float:
    """One series of /metrics, ``name`` or ``name{label="value"}``; 0 where it has not been counted yet."""
    lines = httpx.get(live.base_url + "/metrics").text.splitlines()
    return next((float(line.split()[-1]) for line in lines if line.startswith(series + " ")), 0.0)


def nothing_runs(live) -> bool:
    return metric(live, "pdserve:background_responses") == 0 and metric(live, "pdserve:num_requests_running") == 0


def wait_for_status(client, rid: str, status: str) -> list[str]:
    """Polls the stored response until it has ``status``; the statuses seen on the way, each once."""
    seen: list[str] = []

    def reached() -> bool:
        now = client.responses.retrieve(rid).status
        if not seen or seen[-1] != now:
            seen.append(now)
        return now == status

    wait_until(reached, f"{rid} never became {status} (seen: {seen})")
    return seen


def worker_ids(backend) -> list[str]:
    """The ids the workers were given, in order: a stored response's id stays on the gateway (#47), the
    workers serve (and are told to abort) a private ``req-...`` id instead."""
    ids = [request.request_id for request in backend.received]
    assert ids and all(rid.startswith("req-") for rid in ids), ids
    return ids


def running(client, backend, **kwargs):
    """A background response whose tokens come slowly, once it is in_progress."""
    backend.token_delay_s = SLOW_TOKEN_S
    r = client.responses.create(model=MODEL, input="Hi", background=True, **kwargs)
    wait_for_status(client, r.id, "in_progress")
    return r


def test_queued_at_once_then_completed_with_the_foreground_answer(client, live, backend):
    foreground = client.responses.create(model=MODEL, input="Hi")
    backend.token_delay_s = 0.05  # long enough in_progress for the polls to see it
    queued = client.responses.create(model=MODEL, input="Hi", background=True)
    assert (queued.status, queued.background, queued.store, queued.output, queued.usage) == (
        "queued",
        True,
        True,
        [],
        None,
    )
    assert queued.id.startswith("resp_") and foreground.background is False
    assert wait_for_status(client, queued.id, "completed") in (
        ["queued", "in_progress", "completed"],
        ["in_progress", "completed"],
    )
    done = client.responses.retrieve(queued.id)
    assert done.output_text == foreground.output_text == OUTPUT_TEXT and done.error is None
    assert [(o.type, o.status) for o in done.output] == [("message", "completed")]
    assert (done.usage.input_tokens, done.usage.output_tokens) == (
        foreground.usage.input_tokens,
        foreground.usage.output_tokens,
    )
    assert done.created_at == queued.created_at and done.background is True
    assert [r.prompt_token_ids for r in backend.received] == [backend.received[0].prompt_token_ids] * 2
    wait_until(lambda: nothing_runs(live), "the background response still counted as running")
    assert backend.aborted == []
    with pytest.raises(openai.BadRequestError, match="Only background responses") as e:
        client.responses.cancel(foreground.id)
    assert e.value.body["param"] == "response_id"


def test_max_output_tokens_and_a_worker_failure_end_it_incomplete_and_failed(client, live, backend):
    cut = client.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=5)
    wait_for_status(client, cut.id, "incomplete")
    assert client.responses.retrieve(cut.id).incomplete_details.reason == "max_output_tokens"
    backend.error_after_tokens = 3
    broken = client.responses.create(model=MODEL, input="Hi", background=True)
    wait_for_status(client, broken.id, "failed")
    failed = client.responses.retrieve(broken.id)
    assert failed.error.code == "server_error" and "decode worker lost" in failed.error.message
    wait_until(lambda: nothing_runs(live), "a finished background response still counted as running")


def test_cancel_stops_a_running_response_and_aborts_its_backend_request(client, live, backend):
    before = metric(live, 'pdserve:requests_total{outcome="aborted"}')
    r = running(client, backend)
    assert metric(live, "pdserve:background_responses") == 1 and metric(live, "pdserve:num_requests_running") == 1
    cancelled = client.responses.cancel(r.id)
    assert (cancelled.id, cancelled.status, cancelled.output, cancelled.background) == (r.id, "cancelled", [], True)
    assert backend.aborted == worker_ids(backend)  # the workers let go of its KV blocks
    assert client.responses.retrieve(r.id).model_dump() == cancelled.model_dump()
    assert client.responses.cancel(r.id).model_dump() == cancelled.model_dump()  # again: as it ended
    assert nothing_runs(live) and metric(live, 'pdserve:requests_total{outcome="aborted"}') == before + 1
    assert backend.aborted == worker_ids(backend) and len(backend.received) == 1


def test_cancel_before_the_first_token_stores_it_cancelled(client, live, backend):
    backend.token_delay_s = 30.0  # the first token never comes within the test
    r = client.responses.create(model=MODEL, input="Hi", background=True)
    wait_until(lambda: len(backend.received) == 1, "the backend never got the request")
    assert client.responses.cancel(r.id).status == "cancelled"
    assert backend.aborted == worker_ids(backend) and nothing_runs(live)


def test_cancel_after_it_ended_returns_it_unchanged(client, live, backend):
    r = client.responses.create(model=MODEL, input="Hi", background=True)
    wait_for_status(client, r.id, "completed")
    wait_until(lambda: nothing_runs(live), "the background response still counted as running")
    done = client.responses.retrieve(r.id)
    assert client.responses.cancel(r.id).model_dump() == done.model_dump()
    assert client.responses.retrieve(r.id).model_dump() == done.model_dump() and backend.aborted == []


def test_delete_of_a_running_response_cancels_it(client, live, backend):
    r = running(client, backend)
    gone = httpx.delete(f"{live.base_url}/v1/responses/{r.id}", headers={"Authorization": f"Bearer {API_KEYS[0]}"})
    assert gone.json() == {"id": r.id, "object": "response", "deleted": True}
    assert backend.aborted == worker_ids(backend) and nothing_runs(live)
    with pytest.raises(openai.NotFoundError, match="was deleted"):
        client.responses.retrieve(r.id)


def test_a_continuation_waits_until_the_previous_response_has_ended(client, live, backend):
    r = running(client, backend)
    with pytest.raises(openai.BadRequestError, match="is still in_progress") as e:
        client.responses.create(model=MODEL, input="And?", previous_response_id=r.id)
    assert e.value.body["param"] == "previous_response_id" and len(backend.received) == 1
    client.responses.cancel(r.id)
    assert nothing_runs(live)


def test_the_gauge_counts_the_running_ones(client, live, backend):
    first, second = running(client, backend), running(client, backend)
    assert metric(live, "pdserve:background_responses") == 2 and metric(live, "pdserve:num_requests_running") == 2
    client.responses.cancel(first.id)
    assert metric(live, "pdserve:background_responses") == 1 and metric(live, "pdserve:num_requests_running") == 1
    client.responses.cancel(second.id)
    assert nothing_runs(live) and backend.aborted == worker_ids(backend)


def test_background_needs_the_store_and_is_not_streamed(client, backend, tok_dir):
    with pytest.raises(openai.BadRequestError, match="store is false") as e:
        client.responses.create(model=MODEL, input="Hi", background=True, store=False)
    assert e.value.body["param"] == "background"
    with pytest.raises(openai.BadRequestError, match="not streamed") as e:
        client.responses.create(model=MODEL, input="Hi", background=True, stream=True)
    assert e.value.body["param"] == "stream" and backend.received == []
    with live_gateway(tok_dir, response_store=ResponseStore(0)) as server:
        off = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=API_KEYS[0], max_retries=0, _strict_response_validation=True
        )
        with pytest.raises(openai.BadRequestError, match="responses_store_mb is 0") as e:
            off.responses.create(model=MODEL, input="Hi", background=True)
        assert e.value.body["param"] == "background" and server.backend.received == []


def test_gateway_shutdown_cancels_what_still_runs(tok_dir):
    app, backend = make_gateway(tok_dir, max_model_len=1024)
    backend.token_delay_s = 30.0
    with LiveServer(app, lifespan="on") as server:
        client = openai.OpenAI(
            base_url=server.base_url + "/v1", api_key=API_KEYS[0], max_retries=0, _strict_response_validation=True
        )
        r = client.responses.create(model=MODEL, input="Hi", background=True)
        wait_until(lambda: len(backend.received) == 1, "the backend never got the request")
    serving = app.state.serving
    assert not server.thread.is_alive()
    assert serving.store.get(r.id).body["status"] == "cancelled" and backend.aborted == worker_ids(backend)
    assert (len(serving.background), serving.num_in_flight) == (0, 0)


def test_a_cancel_reaches_work_not_yet_started_and_never_cuts_its_shielded_close():
    async def scenario(cancel_again_while_closing: bool) -> list[str]:
        log: list[str] = []
        closing = asyncio.Event()

        async def work() -> None:  # a generation's shape: its release shielded, as in Generation.close
            try:
                log.append("started")
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                log.append("cancelled")
                raise
            finally:
                with anyio.CancelScope(shield=True):
                    closing.set()
                    await asyncio.sleep(0.05)
                    log.append("closed")

        background = BackgroundResponses()
        background.start("resp_1", work())
        if cancel_again_while_closing:
            first = asyncio.ensure_future(background.cancel("resp_1"))
            await closing.wait()
            assert await background.cancel("resp_1") and await first
        else:
            assert await background.cancel("resp_1")  # before the task's first step
        assert len(background) == 0 and not await background.cancel("resp_1")
        return log

    assert asyncio.run(scenario(False)) == ["started", "cancelled", "closed"]
    assert asyncio.run(scenario(True)) == ["started", "cancelled", "closed"]
