"""Every shipped preset loads through the schema; the multinode and GPU presets set what they promise and
document every field of the schema (one commented line per field)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from configs.loader import load_config
from configs.schema import PdserveConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_preset_loads(path):
    config = load_config(path, env={})
    assert isinstance(config, PdserveConfig)


def test_presets_that_must_exist():
    assert {p.name for p in CONFIGS.glob("*.yaml")} >= {"local.yaml", "multinode.yaml", "gpu.yaml"}


def test_multinode_preset():
    c = load_config(CONFIGS / "multinode.yaml", env={})
    assert c.transfer.transport == "zmq"
    assert (c.gateway.host, c.prefill.host, c.decode.host) == ("eth0", "eth0", "eth0")  # explicit interfaces
    assert c.prefill.gateway_address == c.decode.gateway_address == "tcp://gateway:8001"  # the gateway by name
    assert len({c.prefill.port, c.prefill.http_port, c.decode.port, c.decode.kv_port, c.decode.http_port}) == 5


def test_gpu_preset():
    c = load_config(CONFIGS / "gpu.yaml", env={})
    assert (c.transfer.transport, c.model.dtype) == ("cuda_ipc", "bfloat16")


def commented_keys(text: str) -> dict[str, bool]:
    """{"section.field": whether its line carries a comment} for a two-level YAML preset."""
    out, section = {}, ""
    for line in text.splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        key = line.strip().split(":", 1)[0]
        if not line.startswith(" "):
            section = key
        else:
            out[f"{section}.{key}"] = "#" in line
    return out


@pytest.mark.parametrize("name", ["multinode.yaml", "gpu.yaml"])
def test_preset_names_and_comments_every_field(name):
    documented = commented_keys((CONFIGS / name).read_text())
    schema = {
        f"{s.name}.{f.name}"
        for s in dataclasses.fields(PdserveConfig)
        for f in dataclasses.fields(getattr(PdserveConfig(), s.name))
    }
    assert set(documented) == schema
    assert [key for key, has_comment in documented.items() if not has_comment] == []
