"""A prefill worker under ``--speculative-config`` builds no speculator: it samples only each prompt's first
token, so a draft model and its KV pool would be loaded for nothing. The decode worker, given the same
settings, builds the draft (tests/test_decode_speculation.py runs it)."""

from __future__ import annotations

import json

import zmq

from configs.loader import load_config
from engine.llm import build_engine
from engine.spec.draft import DraftProposer
from prefill_node.build import build_prefill_server
from tests.model_factory import tiny_model_dir

SELF_DRAFT = json.dumps({"method": "draft_model", "model": "self:1", "num_speculative_tokens": 3})


def test_prefill_worker_engine_holds_no_draft_where_the_decode_workers_does() -> None:
    config = load_config(
        None,
        env={},
        overrides={
            "model.path": str(tiny_model_dir("llama")),
            "engine.kv_cache_memory_mb": 4,
            "engine.num_threads": 1,
            "engine.speculative_config": SELF_DRAFT,
            "prefill.port": 0,
            "prefill.gateway_address": "tcp://127.0.0.1:1",
            "transfer.insecure": True,
        },
    )
    decode_engine = build_engine(config.model.path, config.model, config.engine)  # as decode_node/node.py does
    assert isinstance(
        decode_engine.scheduler.speculator.proposer, DraftProposer
    )  # the settings do ask for a draft model
    ctx = zmq.Context()
    server = build_prefill_server(config, ctx)
    try:
        assert server.scheduler.speculator is None
        assert config.engine.speculative_config == SELF_DRAFT  # the caller's settings are left as they were
    finally:
        server.close()
        ctx.destroy(linger=0)
