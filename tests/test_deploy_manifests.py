"""deploy/ validated offline: compose against the compose spec, Kubernetes manifests (each overlay, rendered
by kubectl's own kustomize, as `kubectl apply -k` renders it) strictly against the API schemas and against Pod Security "restricted", KEDA
ScaledObjects against our own schema (each with a broken copy that must fail), and the cross-file facts a
deployment depends on (ports, names, grace periods, volumes, metric names the code exports)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from configs.loader import load_config
from tests.operator_commands import kustomize
from tests.pod_security import restricted_violations

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
BIN = Path(sys.executable).parent
PRESET = load_config(ROOT / "configs" / "multinode.yaml", env={})
OVERLAYS = {name: kustomize(DEPLOY / "k8s" / "overlays" / name) for name in ("cpu", "gpu")}
SCALED = sorted((DEPLOY / "k8s" / "base" / "autoscaling").glob("*.yaml"))
CACHE_MOUNT = "/home/pdserve/.cache/pdserve"  # ~/.cache/pdserve of the image's user (deploy/Dockerfile)
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
    assert (
        run(BIN / "check-jsonschema", "--builtin-schema", "vendor.compose-spec", tmp_path / "compose.yaml").returncode
        == 1
    )


def one(rendered: list[dict], kind: str, name: str) -> dict:
    [doc] = [d for d in rendered if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def test_kubernetes_overlays_validate_strictly(tmp_path):
    for overlay, rendered in OVERLAYS.items():
        core = [d for d in rendered if d["kind"] != "ScaledObject"]
        assert {d["kind"] for d in core} == {
            "ConfigMap",
            "PersistentVolumeClaim",
            "Deployment",
            "Service",
            "PodDisruptionBudget",
            "NetworkPolicy",
            "HorizontalPodAutoscaler",
        }, overlay
        (tmp_path / f"{overlay}.yaml").write_text(yaml.safe_dump_all(core))
        ok = run(BIN / "kubernetes-validate", "--strict", tmp_path / f"{overlay}.yaml")
        assert ok.returncode == 0, overlay + ok.stdout + ok.stderr
    broken = copy.deepcopy(one(OVERLAYS["cpu"], "Deployment", "pdserve-decode"))
    broken["spec"]["template"]["spec"]["terminationGracePeriod"] = 45  # unknown field
    (tmp_path / "decode.yaml").write_text(yaml.safe_dump(broken))
    assert run(BIN / "kubernetes-validate", "--strict", tmp_path / "decode.yaml").returncode != 0


def test_scaled_objects_match_our_schema(tmp_path):
    assert [p.name for p in SCALED] == ["decode-scaledobject.yaml", "prefill-scaledobject.yaml"]
    for overlay, rendered in OVERLAYS.items():
        scaled = [d for d in rendered if d["kind"] == "ScaledObject"]
        assert sorted(d["spec"]["scaleTargetRef"]["name"] for d in scaled) == ["pdserve-decode", "pdserve-prefill"]
        paths = [tmp_path / f"{overlay}-{d['metadata']['name']}.yaml" for d in scaled]
        for path, doc in zip(paths, scaled):
            path.write_text(yaml.safe_dump(doc))
        ok = run(BIN / "check-jsonschema", "--schemafile", SCHEMA, *paths)
        assert ok.returncode == 0, ok.stdout + ok.stderr
        for trigger in (t for d in scaled for t in d["spec"]["triggers"]):
            # per pool by pod name, not by one scrape job's label convention
            assert "job=" not in trigger["metadata"]["query"]
            pool = re.search(r'pod=~"pdserve-(prefill|decode)-\.\+"', trigger["metadata"]["query"])
            assert pool, trigger
    broken = docs(SCALED[0])[0]
    broken["spec"]["triggers"][0]["metadata"]["threshold"] = "seventy"
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(broken))
    assert run(BIN / "check-jsonschema", "--schemafile", SCHEMA, tmp_path / "bad.yaml").returncode == 1


def test_every_pod_passes_pod_security_restricted():
    for overlay, rendered in OVERLAYS.items():
        for deployment in (d for d in rendered if d["kind"] == "Deployment"):
            pod = deployment["spec"]["template"]["spec"]
            assert restricted_violations(pod) == [], (overlay, deployment["metadata"]["name"])
            assert pod["securityContext"]["runAsUser"] == 10001  # the image's USER (deploy/Dockerfile)
    pod = copy.deepcopy(one(OVERLAYS["cpu"], "Deployment", "pdserve-decode")["spec"]["template"]["spec"])
    pod["volumes"].append({"name": "ckpt", "hostPath": {"path": "/srv/models"}})
    pod["containers"][0]["securityContext"] = {"capabilities": {"add": ["SYS_ADMIN"]}}
    del pod["securityContext"]["seccompProfile"]
    assert sorted(restricted_violations(pod)) == [
        "container decode: adds capabilities ['SYS_ADMIN']",
        "container decode: allowPrivilegeEscalation must be false",
        "container decode: capabilities must drop ALL",
        "container decode: seccompProfile must be RuntimeDefault or Localhost, got None",
        "volume ckpt: type hostPath is not allowed",
    ]
    assert "pod: runAsUser 0" in restricted_violations({**pod, "securityContext": {"runAsUser": 0}})


def test_workers_register_through_a_service_that_lists_starting_gateways():
    """The gateway is ready only once a decode worker has registered: registering through a Service of
    ready pods deadlocks a fresh install. Workers use the headless worker-plane Service instead."""
    rendered = OVERLAYS["cpu"]
    plane = one(rendered, "Service", "pdserve-gateway-workers")["spec"]
    assert plane["clusterIP"] == "None" and plane["publishNotReadyAddresses"] is True
    assert plane["ports"] == [{"name": "workers", "port": PRESET.gateway.worker_port, "targetPort": "workers"}]
    gateway = one(rendered, "Deployment", "pdserve-gateway")["spec"]["template"]
    assert plane["selector"] == gateway["metadata"]["labels"]
    api = one(rendered, "Service", "pdserve-gateway")["spec"]
    assert [p["port"] for p in api["ports"]] == [PRESET.gateway.port]  # the API; workers never use it
    for role in ("prefill", "decode"):
        env = {
            e["name"]: e
            for e in one(rendered, "Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert (
            env[f"PDSERVE_{role.upper()}_GATEWAY_ADDRESS"]["value"]
            == f"tcp://pdserve-gateway-workers:{PRESET.gateway.worker_port}"
        )


def test_pools_have_disruption_budgets_volumes_and_startup_probes():
    for overlay, rendered in OVERLAYS.items():
        config = one(rendered, "ConfigMap", "pdserve-env")["data"]
        assert load_config(ROOT / "configs" / "multinode.yaml", env=config).transfer.transport == "zmq"
        for role in ("gateway", "prefill", "decode"):
            pod = one(rendered, "Deployment", f"pdserve-{role}")["spec"]["template"]
            [container] = pod["spec"]["containers"]
            assert container["imagePullPolicy"] == "IfNotPresent"
            assert container["image"] == {"cpu": "pdserve:local", "gpu": "pdserve:cuda"}[overlay]
            assert container["envFrom"] == [{"configMapRef": {"name": "pdserve-env"}}]
            mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
            claims = {
                v["name"]: v["persistentVolumeClaim"]["claimName"]
                for v in pod["spec"]["volumes"]
                if "persistentVolumeClaim" in v
            }
            assert claims[mounts["/models"]["name"]] == "pdserve-models" and mounts["/models"]["readOnly"]
            startup = container["startupProbe"]
            assert startup["httpGet"] == container["livenessProbe"]["httpGet"]
            if role == "gateway":
                continue
            assert claims[mounts[CACHE_MOUNT]["name"]] == "pdserve-cache"
            assert startup["periodSeconds"] * startup["failureThreshold"] >= 20 * 60  # a cold cache times matmul forms
            budget = one(rendered, "PodDisruptionBudget", f"pdserve-{role}")["spec"]
            assert budget["selector"]["matchLabels"] == pod["metadata"]["labels"] and budget["maxUnavailable"] == 1
            gpus = container["resources"]["limits"].get("nvidia.com/gpu")
            assert gpus == (1 if overlay == "gpu" else None), (overlay, role)


def test_the_gpu_overlay_is_the_cpu_one_with_gpu_workers_on_the_cuda_image():
    """No GPU here, so the GPU pods cannot start: their rendering is checked instead. It must equal the
    CPU overlay's with exactly the GPU changes written out below: one whole GPU requested and limited
    per worker (the device plugin's nvidia.com/gpu), the GPU nodes' taint tolerated, a KV pool sized for
    GPU memory, and every pdserve role on the CUDA image that docs/deploy.md builds."""
    [cuda_tag] = re.findall(
        r"-t (pdserve:\S+) \\\n\s+--build-arg BASE_IMAGE=nvidia/cuda", (ROOT / "docs" / "deploy.md").read_text()
    )
    expected = copy.deepcopy(OVERLAYS["cpu"])
    for role in ("gateway", "prefill", "decode"):
        pod = one(expected, "Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]
        pod["containers"][0]["image"] = cuda_tag
        if role == "gateway":  # tokenizes and routes: no GPU
            continue
        resources = pod["containers"][0]["resources"]
        resources["limits"]["nvidia.com/gpu"] = resources["requests"]["nvidia.com/gpu"] = 1
        resources["requests"]["cpu"] = "4"
        pod["containers"][0]["env"].append({"name": "PDSERVE_ENGINE_KV_CACHE_MEMORY_MB", "value": "16384"})
        pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    assert OVERLAYS["gpu"] == expected
    assert cuda_tag == "pdserve:cuda"


def test_every_overlay_the_docs_name_is_one_kustomize_renders():
    """docs/deploy.md's `kubectl apply -k` paths, and the overlays named beside them, are the directories
    rendered above: a layout kustomize refuses (an overlay inside its base: "cycle detected") fails there."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    applied = set(re.findall(r"kubectl apply -k (deploy/k8s/[\w/-]+)", text))
    named = {f"deploy/k8s/{o}" for o in re.findall(r"or (overlays/[a-z]+)", text)}
    rendered = {f"deploy/k8s/overlays/{name}" for name in OVERLAYS}
    assert applied and applied | named == rendered, applied | named
    assert sorted(p.name for p in (DEPLOY / "k8s" / "overlays").iterdir()) == sorted(OVERLAYS)
    assert not (DEPLOY / "k8s" / "kustomization.yaml").exists()  # the overlays' parent is no kustomize root


def test_every_role_reads_only_its_own_credential_from_its_secret_and_none_runs_insecure():
    """The worker plane is CurveZMQ-authenticated with a credential per role (docs/security.md): each
    gateway, prefill and decode pod mounts its own role's Secret (its key and roles.pub) read-only where
    PDSERVE_TRANSFER_CLUSTER_KEY_FILE points; no manifest carries a key or turns authentication off."""
    for overlay, rendered in OVERLAYS.items():
        for role in ("gateway", "prefill", "decode"):
            pod = one(rendered, "Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]
            [container] = pod["containers"]
            env = {e["name"]: e for e in container["env"]}
            key_file = Path(env["PDSERVE_TRANSFER_CLUSTER_KEY_FILE"]["value"])
            [mount] = [m for m in container["volumeMounts"] if m["mountPath"] == str(key_file.parent)]
            assert mount["readOnly"] is True, (overlay, role)
            [volume] = [v for v in pod["volumes"] if v["name"] == mount["name"]]
            # the file name is the Secret's key: `kubectl create secret generic --from-file=keys/<role>.key`
            assert volume["secret"] == {"secretName": f"pdserve-{role}-key", "defaultMode": 0o400}, (overlay, role)
            assert (
                key_file.name == f"{role}.key" and pod["securityContext"]["fsGroup"] == 10001
            )  # group-readable by uid 10001
        assert not [d for d in rendered if d["kind"] == "Secret"], overlay  # the operator creates Secrets
    manifests = [*DEPLOY.glob("k8s/**/*.yaml"), *DEPLOY.glob("**/compose*.yaml")]
    for path in manifests:
        text = path.read_text()
        assert "INSECURE" not in text.upper(), path


def test_network_policy_keeps_worker_ports_to_pdserve_pods():
    policy = one(OVERLAYS["cpu"], "NetworkPolicy", "pdserve-worker-plane")["spec"]
    pdserve = {"matchLabels": {"app.kubernetes.io/name": "pdserve"}}
    not_redis = {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["responses-store"]}
    assert policy["podSelector"] == {**pdserve, "matchExpressions": [not_redis]}
    assert policy["policyTypes"] == ["Ingress"]
    from_pods, open_ports = policy["ingress"]
    assert from_pods == {"from": [{"podSelector": pdserve}]}
    opened = {p["port"] for p in open_ports["ports"]}
    assert opened == {PRESET.gateway.port, PRESET.prefill.http_port, PRESET.decode.http_port}
    worker_plane = {PRESET.gateway.worker_port, PRESET.prefill.port, PRESET.decode.port, PRESET.decode.kv_port}
    assert not opened & worker_plane


def test_only_gateway_pods_reach_redis():
    """A worker pod (compromised or not) cannot read the Responses store: Redis takes connections from
    gateway pods only, on its port only, and no other policy opens it (NetworkPolicies add up)."""
    redis_labels = one(OVERLAYS["cpu"], "Deployment", "pdserve-redis")["spec"]["template"]["metadata"]["labels"]
    gateway_labels = one(OVERLAYS["cpu"], "Deployment", "pdserve-gateway")["spec"]["template"]["metadata"]["labels"]
    policy = one(OVERLAYS["cpu"], "NetworkPolicy", "pdserve-redis")["spec"]
    assert policy["podSelector"] == {"matchLabels": redis_labels} and policy["policyTypes"] == ["Ingress"]
    [rule] = policy["ingress"]
    assert rule["from"] == [{"podSelector": {"matchLabels": gateway_labels}}]
    assert rule["ports"] == [{"port": 6379, "protocol": "TCP"}]
    others = [d for d in OVERLAYS["cpu"] if d["kind"] == "NetworkPolicy" and d["metadata"]["name"] != "pdserve-redis"]
    for other in others:  # each leaves the responses-store pods out
        assert {"key": "app.kubernetes.io/component", "operator": "NotIn", "values": ["responses-store"]} in other[
            "spec"
        ]["podSelector"].get("matchExpressions", []), other["metadata"]["name"]


def test_compose_replicas_publish_on_loopback_and_need_an_api_key_and_a_redis_password():
    text = (DEPLOY / "lb" / "compose.replicas.yaml").read_text().replace("!reset ", "")
    services = yaml.safe_load(text)["services"]
    assert services["lb"]["ports"] == ["${PDSERVE_PUBLISH_HOST:-127.0.0.1}:${PDSERVE_PORT:-8000}:8000"]
    env = services["gateway"]["environment"]
    assert env["PDSERVE_GATEWAY_API_KEYS"].startswith("${PDSERVE_API_KEY:?")  # compose refuses to start without
    assert env["PDSERVE_GATEWAY_RESPONSES_STORE_URL"].startswith("redis://:${PDSERVE_REDIS_PASSWORD:?")
    redis = services["redis"]
    assert redis["environment"]["REDIS_PASSWORD"].startswith("${PDSERVE_REDIS_PASSWORD:?")
    command = redis["command"][2]
    assert "--protected-mode yes" in command and "requirepass" in command and "redis-server -" in command
    assert "PASSWORD" not in command.split("redis-server", 1)[1]  # on stdin, never on its command line


def test_compose_workers_scale_without_edits():
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    services = compose["services"]
    assert (
        PRESET.prefill.gateway_address == PRESET.decode.gateway_address == f"tcp://gateway:{PRESET.gateway.worker_port}"
    )
    assert "gateway" in services
    for role in ("prefill", "decode"):
        worker = services[role]
        assert "container_name" not in worker and "ports" not in worker and "hostname" not in worker, role
        assert worker["command"][:1] == [role] and worker["command"][-1] == "/app/configs/multinode.yaml"
        assert int(worker["stop_grace_period"].rstrip("s")) > getattr(PRESET, role).drain_timeout_s
        assert getattr(PRESET, role).host == "eth0"  # the container's own address, resolved by `pdserve <role>`
        # each pool's size is its own variable: `up --scale decode=N` leaves prefill at its size
        assert worker["deploy"]["replicas"] == f"${{PDSERVE_{role.upper()}_REPLICAS:-1}}"


def test_compose_builds_once_and_shares_model_and_cache_volumes():
    services = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    pdserve = {name: s for name, s in services.items() if name in ("gateway", "prefill", "decode")}
    # one builder: were `build:` on every service, each would retag the image and the next `up`
    # would recreate every container, the gateway included
    assert [name for name, s in services.items() if "build" in s] == ["gateway"]
    assert {s["image"] for s in pdserve.values()} == {"${PDSERVE_IMAGE:-pdserve:local}"}
    for name, service in pdserve.items():
        assert service["volumes"] == ["${PDSERVE_MODEL_DIR:-models}:/models:ro", f"cache:{CACHE_MOUNT}"], name
        assert service["environment"]["PDSERVE_TRANSFER_TRANSPORT"] == "zmq"  # no shm across containers
        # the worker plane's key: only this role's, beside roles.pub (tests/test_compose_secrets.py)
        assert service["secrets"] == [
            {"source": f"{name}_key", "target": f"{name}.key"},
            {"source": "roles_pub", "target": "roles.pub"},
        ], name
        assert service["environment"]["PDSERVE_TRANSFER_CLUSTER_KEY_FILE"] == f"/run/secrets/{name}.key", name
        health = service["healthcheck"]
        assert health["start_period"] == "15m" and health["retries"] >= 3, name
    assert services["gateway"]["ports"] == ["${PDSERVE_PUBLISH_HOST:-127.0.0.1}:${PDSERVE_PORT:-8000}:8000"]
    assert services["gateway"]["environment"]["PDSERVE_GATEWAY_API_KEYS"] == "${PDSERVE_API_KEY:-}"
    assert yaml.safe_load((DEPLOY / "compose.yaml").read_text())["secrets"] == {
        **{
            f"{role}_key": {"file": f"${{PDSERVE_KEYS_DIR:-./keys}}/{role}.key"}
            for role in ("gateway", "prefill", "decode")
        },
        "roles_pub": {"file": "${PDSERVE_KEYS_DIR:-./keys}/roles.pub"},
    }
    for name in ("prometheus", "grafana"):  # images from a registry: only with --profile monitoring
        assert services[name]["profiles"] == ["monitoring"]


def test_prometheus_scrapes_every_pool_on_the_ports_the_preset_binds():
    jobs = {
        j["job_name"]: j["dns_sd_configs"][0]
        for j in yaml.safe_load((DEPLOY / "prometheus.yml").read_text())["scrape_configs"]
    }
    assert jobs == {
        "gateway": {"names": ["gateway"], "type": "A", "port": PRESET.gateway.port, "refresh_interval": "10s"},
        "prefill": {"names": ["prefill"], "type": "A", "port": PRESET.prefill.http_port, "refresh_interval": "10s"},
        "decode": {"names": ["decode"], "type": "A", "port": PRESET.decode.http_port, "refresh_interval": "10s"},
    }


def test_kubernetes_probes_ports_and_grace_periods():
    for role, http_port in (
        ("prefill", PRESET.prefill.http_port),
        ("decode", PRESET.decode.http_port),
        ("gateway", PRESET.gateway.port),
    ):
        pod = one(OVERLAYS["cpu"], "Deployment", f"pdserve-{role}")["spec"]["template"]["spec"]
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
        if role == "gateway":  # the API key comes from a Secret, never from the manifest
            assert env["PDSERVE_GATEWAY_API_KEYS"]["valueFrom"] == {
                "secretKeyRef": {"name": "pdserve-api-keys", "key": "keys"}
            }
            # replicas share their Responses store in Redis, so a conversation goes on at any of them
            # with the password of the Secret pdserve-redis (the kubelet expands $(NAME) of an earlier variable)
            names = [e["name"] for e in container["env"]]
            assert env["PDSERVE_REDIS_PASSWORD"]["valueFrom"] == {
                "secretKeyRef": {"name": "pdserve-redis", "key": "password"}
            }
            assert names.index("PDSERVE_REDIS_PASSWORD") < names.index("PDSERVE_GATEWAY_RESPONSES_STORE_URL")
            url = env["PDSERVE_GATEWAY_RESPONSES_STORE_URL"]["value"]
            assert url == "redis://:$(PDSERVE_REDIS_PASSWORD)@pdserve-redis:6379/0"
        else:  # every gateway replica: the headless worker-plane Service has one A record per gateway pod
            assert env[f"PDSERVE_{role.upper()}_GATEWAY_ADDRESS"]["value"] == "tcp://pdserve-gateway-workers:8001"
    hpa = one(OVERLAYS["cpu"], "HorizontalPodAutoscaler", "pdserve-gateway")["spec"]
    assert hpa["scaleTargetRef"]["name"] == "pdserve-gateway" and hpa["minReplicas"] >= 2
    one(OVERLAYS["cpu"], "Deployment", "pdserve-redis")


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


def test_the_image_context_holds_every_package_and_no_tests():
    """deploy/Dockerfile copies the build context whole; .dockerignore keeps the rest out. A package
    left out there would be missing from the image while every test from the checkout passes."""
    import tomllib

    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    ignored = {
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert not {p.split(".")[0] for p in packages} & ignored
    assert {".git", ".venv", "tests", "docs", "deploy"} <= ignored  # nothing the image runs; big or churning


def test_the_image_installs_the_lock_for_its_python():
    """deploy/Dockerfile installs requirements/runtime-cpu.txt by default and the CUDA build the lock of
    its Python 3.12 (docs/deploy.md's command), from a build context that holds them."""
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    [default] = re.findall(r"^ARG LOCK=(\S+)$", dockerfile, re.M)
    [cuda] = re.findall(r"--build-arg LOCK=(\S+) \.", (ROOT / "docs" / "deploy.md").read_text())
    for lock, python in ((default, "3.11"), (cuda, "3.12")):
        head = (ROOT / lock).read_text().split("\n", 4)
        assert f"# for: CPython {python}, Linux x86_64" in head, lock
    assert (default, cuda) == ("requirements/runtime-cpu.txt", "requirements/runtime-cuda.txt")
    ignored = {line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()}
    assert "requirements" not in ignored and "--require-hashes --no-deps -r" in dockerfile
