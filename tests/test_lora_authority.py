"""Only a gateway makes the cluster's LoRA list (gateway/workers/lora_list.py): a gateway signs each list
it makes with its member key, workers carry it (engine/lora/sync.py reports it back with the signature),
and another gateway adopts a reported list only when a gateway key signed it. A worker that stamps a
newer list of its own in a heartbeat (a forged or missing signature, or one by a worker key) is ignored."""

from __future__ import annotations

import pytest

from cluster.keygen import main as keygen
from engine.lora.sync import LoRASync
from gateway.workers.lora_list import ClusterLoRAList, signed_text
from protocol.curve import ClusterKey
from protocol.serving import LoRAAdapterSet
from tests import hostile


@pytest.fixture()
def keys(tmp_path):
    assert keygen(["--out", str(tmp_path)]) == 0
    return {role: ClusterKey.from_file(str(tmp_path / f"{role}.key")) for role in ("gateway", "decode")}


def heartbeat_with(fields: dict, worker_id: str = "d0"):
    hb = hostile.heartbeat(worker_id, "decode", "tcp://127.0.0.1:9", "inc")
    for name, value in fields.items():
        setattr(hb, name, value)
    return hb


def test_a_list_made_by_one_gateway_travels_through_a_worker_to_another(keys):
    a, b = ClusterLoRAList({}, keys["gateway"]), ClusterLoRAList({}, keys["gateway"])
    made = a.make({"sql": "/adapters/sql"}, "gw-a")
    worker = LoRASync(None)
    assert worker.apply(made)
    fields = worker.heartbeat_fields()
    assert fields["lora_set_signature"] == made.signature != ""
    assert b.observe(heartbeat_with(fields)) is False  # adopted: the worker is not behind
    assert b.paths() == {"sql": "/adapters/sql"} and b.newest.stamp == (1, "gw-a") and b.num_forged == 0


@pytest.mark.parametrize("signer", ["none", "decode", "tampered"])
def test_a_worker_cannot_stamp_a_list(keys, signer):
    gateway = ClusterLoRAList({}, keys["gateway"])
    honest = gateway.make({"sql": "/adapters/sql"}, "gw-a")
    forged = {
        "lora_set_version": 99,
        "lora_set_gateway": "gw-a",
        "lora_set_names": ["sql"],
        "lora_set_paths": ["/shared/backdoor"],
        "lora_set_signature": "",
    }
    if signer == "decode":  # signed, but by a worker's member key
        text = signed_text(LoRAAdapterSet(99, ["sql"], ["/shared/backdoor"], "gw-a"))
        forged["lora_set_signature"] = keys["decode"].sign_as("decode", text)
    elif signer == "tampered":  # the gateway's real signature of the honest list, over another path
        forged |= {"lora_set_version": honest.version, "lora_set_signature": honest.signature}
        forged["lora_set_gateway"] = "gw-z"  # a higher stamp than the honest one
    gateway.observe(heartbeat_with(forged))
    assert gateway.paths() == {"sql": "/adapters/sql"} and gateway.newest is honest
    assert gateway.num_forged == 1


def test_without_keys_nothing_is_signed_or_checked():
    insecure = ClusterLoRAList({})
    assert insecure.make({"a": "/a"}, "gw").signature == ""
    fields = {"lora_set_version": 5, "lora_set_gateway": "gw", "lora_set_names": ["b"], "lora_set_paths": ["/b"]}
    insecure.observe(heartbeat_with(fields))
    assert insecure.paths() == {"b": "/b"}
