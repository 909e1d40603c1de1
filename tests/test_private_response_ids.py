"""A stored response's id (``resp_...``) is how its owner reads it back, so it stays on the gateway: the
workers log, and every OTLP span carries, the internal request id only (docs/security.md, Tenants). One real
request through ``pdserve serve`` (gateway, prefill and decode processes), its logs and spans captured."""

from __future__ import annotations

import json
import time

import openai

from tests.cluster_harness import ServeProcess
from tests.model_factory import tiny_model_dir
from tests.otlp_receiver import OtlpReceiver


def test_response_id_stays_out_of_worker_logs_and_spans(tmp_path):
    receiver = OtlpReceiver()
    serve = None
    try:
        serve = ServeProcess(
            tiny_model_dir("llama"),
            tmp_path,
            env={"OTEL_BSP_SCHEDULE_DELAY": "50"},
            engine={"block_size": 16, "kv_cache_memory_mb": 8},
            gateway={"local_prefill_max_tokens": 0},  # the prompt goes through the prefill worker
            observability={"otlp_traces_endpoint": receiver.url, "log_level": "debug", "log_format": "json"},
        )
        client = openai.OpenAI(base_url=serve.url + "/v1", api_key="unused", max_retries=0)
        response = client.responses.create(
            model=client.models.list().data[0].id, input="hello there", max_output_tokens=4, temperature=0.0
        )
        assert response.id.startswith("resp_") and response.usage.output_tokens == 4
        serve.wait_idle()
        give_up = time.monotonic() + 30
        while {s.service for s in receiver.spans} < {"pdserve-gateway", "pdserve-prefill", "pdserve-decode"}:
            assert time.monotonic() < give_up, {s.service for s in receiver.spans}
            time.sleep(0.05)
        records = [json.loads(line) for line in list(serve.log) if line.startswith("{")]
    finally:
        if serve is not None:
            serve.stop()
        receiver.close()

    # The gateway's one audit line ties the two ids together; nothing else names the response id.
    audit = [r for r in records if response.id in r["message"]]
    assert [(r["role"], r["message"].split(" serves ")[1]) for r in audit[:1]] == [("gateway", response.id)]
    internal = audit[0]["message"].split(" ")[0].removeprefix("rid=")
    assert internal.startswith("req-")
    assert all(r["role"] == "gateway" for r in audit), [r for r in audit if r["role"] != "gateway"]
    worker_lines = [r for r in records if r["role"] in ("prefill", "decode")]
    assert any(internal in r["message"] for r in worker_lines)  # the workers logged the request, by its own id
    assert not [r for r in worker_lines if response.id in json.dumps(r)]
    # Every span of the request (gateway, prefill, decode) names the internal id where it names one.
    names = [s.attributes.get("gen_ai.request.id", "") for s in receiver.spans]
    assert any(name.startswith(internal) for name in names), names
    assert not [s for s in receiver.spans if response.id in json.dumps(s.attributes) + s.name]
