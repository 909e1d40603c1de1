"""`pdserve gateway|prefill|decode` (bind host made concrete, settings passed on with their precedence)
and `pdserve status` (the gateway's /v1/workers as a table)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.roles import resolve_host, role_command
from configs.schema import ConfigError
from tests.fake_http import http_get_server

ROOT = Path(__file__).resolve().parents[1]
PRESET = str(ROOT / "configs" / "multinode.yaml")


def test_resolve_host():
    assert resolve_host("10.1.2.3") == "10.1.2.3"
    assert resolve_host("lo") == "127.0.0.1"  # an interface name: its IPv4 address
    assert resolve_host("localhost") == "127.0.0.1"  # a name: /etc/hosts
    with pytest.raises(ConfigError, match="no-such-host.invalid"):
        resolve_host("no-such-host.invalid")


def test_worker_command_resolves_the_interface_and_keeps_sets():
    argv, env = role_command("decode", PRESET, {"decode.host": "lo", "engine.block_size": "32"}, {})
    assert argv == [
        sys.executable,
        "-m",
        "decode_node",
        "--config",
        PRESET,
        "--set",
        "decode.host=127.0.0.1",
        "--set",
        "engine.block_size=32",
    ]
    argv, _ = role_command("prefill", PRESET, {}, {"PDSERVE_PREFILL_HOST": "lo"})  # env is honoured too
    assert argv[-2:] == ["--set", "prefill.host=127.0.0.1"]


def test_gateway_command_passes_settings_as_env_over_inherited_ones():
    argv, env = role_command(
        "gateway",
        PRESET,
        {"gateway.host": "lo", "gateway.port": "9000"},
        {"PDSERVE_GATEWAY_PORT": "7000", "OTHER": "x"},
    )
    assert argv == [sys.executable, "-m", "gateway", "--config", PRESET]
    assert (env["PDSERVE_GATEWAY_HOST"], env["PDSERVE_GATEWAY_PORT"], env["OTHER"]) == ("127.0.0.1", "9000", "x")


def test_bad_settings_fail_before_exec():
    with pytest.raises(ConfigError, match="engine.block_sise"):
        role_command("prefill", PRESET, {"engine.block_sise": "8"}, {})
    out = subprocess.run(
        [sys.executable, "-m", "cluster", "prefill", "--config", PRESET, "--set", "nodot"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 78 and "--set expects section.field=value, got 'nodot'" in out.stderr


WORKERS = {
    "object": "list",
    "data": [
        {
            "id": "decode-b",
            "role": "decode",
            "address": "tcp://10.0.0.22:8201",
            "incarnation": "i2",
            "draining": True,
            "stuck": False,
            "block_size": 16,
            "load": {
                "num_running": 3,
                "num_waiting": 1,
                "queued_prefill_tokens": 0,
                "kv_blocks_in_use": 25,
                "kv_blocks_free": 75,
                "kv_blocks_total": 100,
            },
        },
        {
            "id": "prefill-a",
            "role": "prefill",
            "address": "tcp://10.0.0.11:8100",
            "incarnation": "i1",
            "draining": False,
            "stuck": False,
            "block_size": 16,
            "load": {
                "num_running": 1,
                "num_waiting": 2,
                "queued_prefill_tokens": 900,
                "kv_blocks_in_use": 8,
                "kv_blocks_free": 56,
                "kv_blocks_total": 64,
            },
        },
        {
            "id": "decode-c",
            "role": "decode",
            "address": "tcp://10.0.0.23:8201",
            "incarnation": "i3",
            "draining": False,
            "stuck": True,  # heartbeating, one step past gateway.worker_step_timeout_s
            "block_size": 16,
            "load": {
                "num_running": 2,
                "num_waiting": 0,
                "queued_prefill_tokens": 0,
                "kv_blocks_in_use": 10,
                "kv_blocks_free": 90,
                "kv_blocks_total": 100,
            },
        },
    ],
}


@pytest.fixture()
def fake_gateway():
    seen = []

    def answer(path, headers) -> bytes:
        seen.append((path, headers.get("Authorization")))
        return json.dumps(WORKERS).encode()

    with http_get_server(answer) as url:
        yield url, seen


def test_status_prints_a_table(fake_gateway):
    url, seen = fake_gateway
    out = subprocess.run(
        [sys.executable, "-m", "cluster", "status", "--url", url, "--api-key", "k1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()]
    assert rows == [
        ["ID", "ROLE", "ADDRESS", "STATE", "RUNNING", "WAITING", "QUEUED_TOKENS", "KV_USED", "KV_TOTAL", "KV_USAGE"],
        ["prefill-a", "prefill", "tcp://10.0.0.11:8100", "serving", "1", "2", "900", "8", "64", "12.5%"],
        ["decode-b", "decode", "tcp://10.0.0.22:8201", "draining", "3", "1", "0", "25", "100", "25.0%"],
        ["decode-c", "decode", "tcp://10.0.0.23:8201", "stuck", "2", "0", "0", "10", "100", "10.0%"],
        ["1", "prefill,", "2", "decode", "worker(s)"],
    ]
    assert seen == [("/v1/workers", "Bearer k1")]


def test_status_sends_the_key_from_the_environment(fake_gateway):
    # PDSERVE_API_KEY is the key the gateway accepts (configs/environment.py) and the one status sends.
    url, seen = fake_gateway
    env = {**os.environ, "PDSERVE_API_KEY": "sk-env"}
    out = subprocess.run(
        [sys.executable, "-m", "cluster", "status", "--url", url],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert seen == [("/v1/workers", "Bearer sk-env")]


def test_status_unreachable_gateway():
    out = subprocess.run(
        [sys.executable, "-m", "cluster", "status", "--url", "http://127.0.0.1:9"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1 and "cannot reach http://127.0.0.1:9" in out.stderr
