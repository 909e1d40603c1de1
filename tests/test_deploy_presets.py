"""Every shipped preset loads through the schema; the multinode and GPU presets set what they promise and
document every field of the schema (one commented line per field)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from configs.schema import PdserveConfig, load_config

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


@pytest.mark.parametrize("name", ["multinode.yaml", "gpu.yaml"])
def test_preset_names_and_comments_every_field(name):
    text = (CONFIGS / name).read_text()
    data = yaml.safe_load(text)
    lines = {line.strip().split(":")[0]: line for line in text.splitlines() if ":" in line and not line.lstrip().startswith("#")}
    for section in dataclasses.fields(PdserveConfig):
        for f in dataclasses.fields(section.type if isinstance(section.type, type) else getattr(PdserveConfig(), section.name)):
            assert f.name in data[section.name], f"{name}: {section.name}.{f.name} missing"
            if section.name != "cluster":
                assert "#" in lines[f.name], f"{name}: {section.name}.{f.name} has no comment"
