"""The decode worker's check at KV commit: KV a prefill worker computed under another LoRA adapter (or
under one, for a base request) is never adopted; the request fails naming both, and its blocks are freed."""

from __future__ import annotations

import pytest
import zmq

from engine.llm import build_engine
from kvtransfer.channel import ZmqClient
from kvtransfer.sender import KVSender
from protocol.codec import decode
from protocol.serving import PrefillJob
from protocol.zmq_util import bind, make_socket
from tests.decode_harness import generate
from tests.test_decode_node import PROMPT, assert_idle, node  # noqa: F401 (the fixture)
from worker import kv_model_name

COMMITS_OF_ANOTHER_MODEL = [
    ({"lora_name": "alpha"}, "prefill worker computed the KV under LoRA adapter 'alpha'; the request runs under ''"),
    (  # the right name, other files: a directory rewritten between the two workers' loads
        {"lora_digest": "ab" * 32},
        "prefill worker computed the KV under LoRA adapter '' read from other files (sha256 'abababababab') "
        "than this worker's (''): load it again",
    ),
]


@pytest.mark.parametrize(("commit_fields", "error"), COMMITS_OF_ANOTHER_MODEL)
def test_kv_committed_under_another_adapter_is_refused(node, commit_fields, error):  # noqa: F811
    prefill = make_socket(node.ctx, zmq.ROUTER)
    prefill_address = bind(prefill, "127.0.0.1", 0)
    node.gateway.send("d0", generate("r", PROMPT, prefill_address=prefill_address, temperature=0.0))
    assert prefill.poll(30_000)
    _, frame = prefill.recv_multipart()
    job = decode(frame, expected=PrefillJob)
    assert job.sampling.lora_name == ""  # the base model's request

    p_engine = build_engine(node.config.model.path, node.config.model, node.config.engine)
    sender = KVSender(
        p_engine.runner.kv_pool, kv_model_name(node.config.model.path), ZmqClient(node.ctx, job.kv_address)
    )
    sender.handshake(timeout_s=10)
    sender.send(job.rid, job.generation, [0, 1, 2, 3], job.dst_block_ids)
    sender.commit(job.rid, job.generation, first_token=7, **commit_fields)  # a prefill worker gone wrong
    events = []
    while not events:
        events = sender.poll()
    [got] = node.gateway.collect("r").values()
    assert got[-1].error == error
    assert got[-1].token_ids == []  # not even the first token reached the client
    prefill.close(linger=0)
    assert_idle(node)
