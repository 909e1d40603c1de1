"""On a CURVE plane a decode worker never reserves KV blocks for "anyone": a Generate that asks for a
remote prefill without naming the assigned prefill worker's key (``Generate.prefill_key`` "") is refused
with one error, nothing reserved or leaked, and the worker goes on serving (docs/security.md)."""

from __future__ import annotations

import threading

import pytest
import zmq

from cluster.keygen import main as keygen
from decode_node.node import DecodeNode
from engine.llm import LLM
from engine.sampling.params import SamplingParams
from kvtransfer.channel import InprocServer
from protocol.curve import ClusterKey, PlaneSecurity
from tests.decode_harness import FakeGateway, decode_config, generate, tokens_of
from tests.invariants import assert_no_leak

PROMPT = [5, 17, 99, 3, 250, 41, 7, 300, 12, 64, 128, 9, 77]


def test_a_remote_prefill_without_the_prefill_key_is_refused(tmp_path):
    assert keygen(["--out", str(tmp_path)]) == 0
    ctx, gateway_ctx = zmq.Context(), zmq.Context()  # one ZAP handler per context: the gateway's own
    security = PlaneSecurity(ClusterKey.from_file(str(tmp_path / "gateway.key")), "gateway")
    gateway = FakeGateway(gateway_ctx, security=security)
    config = decode_config(gateway.address, key_file=str(tmp_path / "decode.key"))
    node = DecodeNode.start(config, ctx)
    thread = threading.Thread(target=node.server.run, daemon=True)
    thread.start()
    try:
        gateway.wait_heartbeat(lambda hb: bool(hb.proof))  # registered, with a decode member's proof
        assert node.server.receiver.needs_sender_key
        gateway.send("d0", generate("r1", PROMPT, prefill_address="tcp://127.0.0.1:9", max_tokens=4))
        [event] = gateway.collect("r1")[0]
        assert event.error == "refused: the request names no prefill worker key (Generate.prefill_key)"
        assert node.server.requests == {} and node.server.receiver.table.held_blocks() == {}
        with pytest.raises(ValueError, match="names no sender key on an authenticated plane"):
            node.server.receiver.reserve("r2", 1, [0, 1])
        # The worker still serves: the same prompt prefilled locally, as the engine does it alone.
        params = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
        gateway.send("d0", generate("r3", PROMPT, **params))
        expected = LLM(config.model.path, config=config).generate([PROMPT], SamplingParams(**params))[0]
        assert tokens_of(gateway.collect("r3")[0]) == expected.outputs[0].token_ids
    finally:
        node.server.stop()
        thread.join(timeout=10)
        bm = node.server.block_manager
        node.close()
        security.close()
        ctx.destroy(linger=0)
        gateway_ctx.destroy(linger=0)
    assert_no_leak(bm)
    assert not InprocServer().authenticates_peers  # in-process: no keys, a range for its one peer
