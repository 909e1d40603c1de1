"""The environment a process is started in: only PDSERVE_<SECTION>_<FIELD> variables are config.

Kubernetes injects service-link variables for every Service of the namespace, and some share a field's
name (PDSERVE_GATEWAY_PORT=tcp://...); operators export PDSERVE_API_KEY. None of them may stop a process.
"""

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from configs import environment
from configs.loader import load_config
from configs.schema import ConfigError, PdserveConfig

ROOT = Path(__file__).resolve().parents[1]


def service_links(service: str, ip: str, ports: dict[str, int]) -> dict[str, str]:
    """The variables the kubelet injects for one Service (Docker links' naming), as documented for
    Kubernetes: <SVC>_SERVICE_HOST/_PORT/_PORT_<NAME>, <SVC>_PORT, <SVC>_PORT_<n>_TCP[_PROTO|_PORT|_ADDR]."""
    svc = service.upper().replace("-", "_")
    first = next(iter(ports.values()))
    env = {f"{svc}_SERVICE_HOST": ip, f"{svc}_SERVICE_PORT": str(first), f"{svc}_PORT": f"tcp://{ip}:{first}"}
    for name, port in ports.items():
        link = f"{svc}_PORT_{port}_TCP"
        env |= {
            f"{svc}_SERVICE_PORT_{name.upper().replace('-', '_')}": str(port),
            link: f"tcp://{ip}:{port}",
            f"{link}_PROTO": "tcp",
            f"{link}_PORT": str(port),
            f"{link}_ADDR": ip,
        }
    return env


def namespace_env() -> dict[str, str]:
    """A namespace with the deployment's Services (and one named just ``pdserve``)."""
    return (
        service_links("pdserve-gateway", "10.96.0.10", {"http": 8000, "workers": 8001})
        | service_links("pdserve-gateway-workers", "10.96.0.11", {"workers": 8001})
        | service_links("pdserve-prefill", "10.96.0.12", {"control": 8100, "http": 8101})
        | service_links("pdserve-decode", "10.96.0.13", {"control": 8200, "kv": 8201, "http": 8202})
        | service_links("pdserve", "10.96.0.14", {"http": 80})
    )


@pytest.fixture(autouse=True)
def fresh_warnings():
    environment._warn_once.cache_clear()
    environment._info_once.cache_clear()
    yield


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "configs.environment" and r.levelno >= logging.WARNING]


def test_kubernetes_service_links_leave_the_config_at_its_defaults(caplog):
    env = namespace_env()
    assert env["PDSERVE_GATEWAY_PORT"] == "tcp://10.96.0.10:8000" and env["PDSERVE_DECODE_PORT"].startswith("tcp://")
    with caplog.at_level(logging.INFO, logger="configs.environment"):
        assert load_config(env=env) == PdserveConfig()
    warned = warnings_of(caplog)
    # The three that share a field's name are named, with the field; the rest are listed in one info line.
    assert sorted(w.split("=")[0] for w in warned) == [
        "PDSERVE_DECODE_PORT",
        "PDSERVE_GATEWAY_PORT",
        "PDSERVE_PREFILL_PORT",
    ]
    assert "looks like a Kubernetes service link, not a value for gateway.port; ignored" in " ".join(warned)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 1 and "PDSERVE_GATEWAY_PORT_8000_TCP_ADDR" in infos[0]
    assert "PDSERVE_GATEWAY_WORKERS_PORT" in infos[0] and "PDSERVE_SERVICE_HOST" in infos[0]


def test_real_settings_win_beside_service_links():
    env = namespace_env() | {
        "PDSERVE_GATEWAY_WORKER_PORT": "9001",
        "PDSERVE_DECODE_KV_PORT": "9201",
        "PDSERVE_PREFILL_GATEWAY_ADDRESS": "tcp://pdserve-gateway-workers:8001",
    }
    config = load_config(env=env)
    assert config.gateway.worker_port == 9001 and config.decode.kv_port == 9201
    assert config.gateway.port == 8000 and config.decode.port == 8200  # the links' ports were not taken
    assert config.prefill.gateway_address == "tcp://pdserve-gateway-workers:8001"  # a string field keeps tcp://


def test_a_bad_value_for_a_field_is_still_an_error():
    with pytest.raises(ConfigError, match=r"gateway\.port: bad value '80x'.*PDSERVE_GATEWAY_PORT"):
        load_config(env={"PDSERVE_GATEWAY_PORT": "80x"})
    with pytest.raises(ConfigError, match=r"gateway\.port: bad value 'http://x:1'"):
        load_config(env={"PDSERVE_GATEWAY_PORT": "http://x:1"})  # not a service link's scheme


def test_unknown_variable_is_ignored_with_one_warning_and_a_suggestion(caplog):
    env = {"PDSERVE_ENGINE_BLOCK_SISE": "32", "PDSERVE_FROBNICATE": "1"}
    with caplog.at_level(logging.WARNING, logger="configs.environment"):
        assert load_config(env=env) == PdserveConfig()
        assert load_config(env=env) == PdserveConfig()  # loaded again (a supervisor's restart): no repeat
    assert warnings_of(caplog) == [
        "PDSERVE_ENGINE_BLOCK_SISE is not a pdserve config variable (PDSERVE_<SECTION>_<FIELD>); ignored; "
        "did you mean PDSERVE_ENGINE_BLOCK_SIZE?",
        "PDSERVE_FROBNICATE is not a pdserve config variable (PDSERVE_<SECTION>_<FIELD>); ignored",
    ]


def test_api_key_variable_adds_an_accepted_key(tmp_path):
    assert load_config(env={"PDSERVE_API_KEY": " sk-1 "}).gateway.api_keys == ["sk-1"]
    env = {"PDSERVE_API_KEY": "sk-1", "PDSERVE_GATEWAY_API_KEYS": "sk-0,sk-1"}
    assert load_config(env=env).gateway.api_keys == ["sk-0", "sk-1"]  # one key once
    path = tmp_path / "c.yaml"
    path.write_text("gateway:\n  api_keys: [from-yaml]\n")
    assert load_config(path, env={"PDSERVE_API_KEY": "sk-1"}).gateway.api_keys == ["from-yaml", "sk-1"]
    assert load_config(env={"PDSERVE_API_KEY": ""}).gateway.api_keys == []
    # The command line still has the last word.
    assert load_config(env=env, overrides={"gateway.api_keys": "cli"}).gateway.api_keys == ["cli"]


def test_a_process_started_in_a_kubernetes_namespace_runs_and_warns_on_stderr():
    code = "from configs.loader import load_config; c = load_config(); print(c.gateway.port, c.gateway.api_keys)"
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), **namespace_env(), "PDSERVE_API_KEY": "sk-k8s"}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["8000", "['sk-k8s']"]
    assert "PDSERVE_GATEWAY_PORT='tcp://10.96.0.10:8000' looks like a Kubernetes service link" in result.stderr
    assert "unknown config" not in result.stderr
