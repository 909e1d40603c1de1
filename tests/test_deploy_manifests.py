"""deploy/ validated offline: compose against the compose spec, Kubernetes manifests strictly against the
API schemas, KEDA ScaledObjects against our own schema (each with a broken copy that must fail), and the
cross-file facts a deployment depends on (ports, names, grace periods, metric names the code exports)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from configs.schema import load_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
PRESET = load_config(ROOT / "configs" / "multinode.yaml", env={})
K8S_CORE = sorted((DEPLOY / "k8s").glob("*.yaml"))
SCALED = sorted((DEPLOY / "k8s" / "autoscaling").glob("*.yaml"))
SCHEMA = DEPLOY / "k8s" / "schemas" / "scaledobject.schema.json"


def run(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=60)


def docs(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_compose_matches_the_compose_spec(tmp_path):
    ok = run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", DEPLOY / "compose.yaml")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    broken["services"]["decode"]["stop_grace_periods"] = "40s"  # a typo the spec must catch
    (tmp_path / "compose.yaml").write_text(yaml.safe_dump(broken))
    assert run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", tmp_path / "compose.yaml").returncode == 1


def test_kubernetes_manifests_validate_strictly(tmp_path):
    assert {p.name for p in K8S_CORE} >= {"gateway.yaml", "prefill.yaml", "decode.yaml"}
    ok = run(BIN / "kubernetes-validate", "--strict", *K8S_CORE)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = docs(DEPLOY / "k8s" / "decode.yaml")
    broken[0]["spec"]["template"]["spec"]["terminationGracePeriod"] = 45  # unknown field
    (tmp_path / "decode.yaml").write_text(yaml.safe_dump_all(broken))
    assert run(BIN / "kubernetes-validate", "--strict", tmp_path / "decode.yaml").returncode != 0


def test_scaled_objects_match_our_schema(tmp_path):
    assert [p.name for p in SCALED] == ["decode-scaledobject.yaml", "prefill-scaledobject.yaml"]
    ok = run(BIN / "check-jsonschema", "--schemafile", SCHEMA, *SCALED)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    broken = docs(SCALED[0])[0]
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = "seventy"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(broken))
    assert run(BIN / "check-jsonschema", "--schemafile", SCHEMA, tmp_path / "bad.yaml").returncode == 1


def test_compose_workers_scale_without_edits():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert PRESET.prefill.gateway_address == PRESET.decode.gateway_address == f"tcp://gateway:{PRESET.gateway.worker_port}"
    assert "gateway" in services
    for role in ("prefill", "decode"):
        worker = services[role]
        assert "container_name" not in worker and "ports" not in worker and "hostname" not in worker, role
        assert worker["command"][:1] == [role] and worker["command"][-1] == "/app/configs/multinode.yaml"
        assert int(worker["stop_grace_period"].rstrip("s")) > getattr(PRESET, role).drain_timeout_s
        assert getattr(PRESET, role).host == "eth0"  # the container's own address, resolved by `pdserve <role>`


def test_prometheus_scrapes_every_pool_on_the_ports_the_preset_binds():
    jobs = {j["job_name"]: j["dns_sd_configs"][0] for j in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]}
    assert jobs == {
        "gateway": {"names": ["gateway"], "type": "A", "port": PRESET.gateway.port, "refresh_interval": "10s"},
        "prefill": {"names": ["prefill"], "type": "A", "port": PRESET.prefill.http_port, "refresh_interval": "10s"},
        "decode": {"names": ["decode"], "type": "A", "port": PRESET.decode.http_port, "refresh_interval": "10s"},
    }


def test_kubernetes_probes_ports_and_grace_periods():
    for role, http_port in (("prefill", PRESET.prefill.http_port), ("decode", PRESET.decode.http_port),
                            ("gateway", PRESET.gateway.port)):
        deployment, service = docs(DEPLOY / "k8s" / f"{role}.yaml")
        pod = deployment["spec"]["template"]["spec"]
        [container] = pod["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        probe_port = container["readinessProbe"]["httpGet"]["port"]
        assert ports[probe_port] == http_port
        assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
        assert container["livenessProbe"]["httpGet"]["path"] == "/health"
        env = {e["name"]: e for e in container["env"]}
        assert env[f"PDSERVE_{role.upper()}_HOST"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        drain = float(env.get(f"PDSERVE_{role.upper()}_DRAIN_TIMEOUT_S", {"value": "30"})["value"])
        assert pod["terminationGracePeriodSeconds"] > drain
        if role != "gateway":
            assert env[f"PDSERVE_{role.upper()}_GATEWAY_ADDRESS"]["value"] == "tcp://pdserve-gateway-workers:8001"
    gateway_service = docs(DEPLOY / "k8s" / "gateway.yaml")[1]
    assert gateway_service["metadata"]["name"] == "pdserve-gateway"
    # the workers' name resolves to every gateway pod (one A record each): a headless Service
    [workers_service] = docs(DEPLOY / "k8s" / "gateway-workers-service.yaml")
    assert workers_service["metadata"]["name"] == "pdserve-gateway-workers"
    assert workers_service["spec"]["clusterIP"] == "None"
    assert workers_service["spec"]["publishNotReadyAddresses"] is True  # a gateway is ready only once workers registered
    assert workers_service["spec"]["selector"] == gateway_service["spec"]["selector"]
    [hpa] = docs(DEPLOY / "k8s" / "gateway-hpa.yaml")
    assert hpa["spec"]["scaleTargetRef"]["name"] == docs(DEPLOY / "k8s" / "gateway.yaml")[0]["metadata"]["name"]


def exported_metric_names() -> set[str]:
    """Every sample name the gateway, prefill and decode processes can export."""
    from gateway.metrics import GatewayMetrics
    from kvtransfer.metrics import TransferMetrics
    from prefill_node.metrics import PrefillMetrics
    from worker.metrics import EngineMetrics

    registries = [GatewayMetrics().registry]
    for build in (EngineMetrics, TransferMetrics, PrefillMetrics):
        registries.append(CollectorRegistry())
        build(registries[-1])
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + s for r in registries for f in r.collect() for s in suffixes[f.type]}


def test_dashboard_and_autoscalers_use_metrics_the_code_exports():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pdserve.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    titles = " ".join(p["title"] for p in dashboard["panels"]).lower()
    for topic in ("first token", "inter-token", "throughput", "kv cache", "bandwidth", "pool sizes"):
        assert topic in titles, topic
    exprs += [t["metadata"]["query"] for p in SCALED for t in docs(p)[0]["spec"]["triggers"]]
    used = {m for e in exprs for m in re.findall(r"(?:pdserve|vllm):[a-z0-9_]+|process_[a-z_]+", e)}
    assert len(used) >= 25
    assert used <= exported_metric_names(), used - exported_metric_names()
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_dashboard_picks_its_datasource_and_model_and_repeats_per_pool():
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "pdserve.json").read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "model_name" in variables["model_name"]["definition"]
    assert variables["pool"]["query"] == "prefill,decode"
    graphs = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in graphs)  # no hard-coded datasource left
    # every vLLM series is filtered by the chosen model(s), and the engine panels repeat per pool
    selectors = re.findall(r"vllm:[a-z0-9_]+\{[^}]*\}", " ".join(t["expr"] for p in graphs for t in p["targets"]))
    assert selectors and all('model_name=~"$model_name"' in s for s in selectors)
    assert [p["title"] for p in dashboard["panels"] if p.get("repeat") == "pool"] == ["Pool: $pool"]
