"""The Kubernetes manifests start and serve, without a cluster. The operator's commands of docs/deploy.md
make what a cluster would get (tests/operator_commands.py): `pdserve keygen` the cluster key, `kubectl
create secret` the two Secrets (client-side, as kubectl builds them), `kubectl apply -k
deploy/k8s/overlays/cpu` the objects, rendered by kubectl's own kustomize. Each pod of that rendering (as
many as each Deployment's replicas: two gateways) runs in its own network namespace, started exactly as
the kubelet would start it (the container's command, or the image's entrypoint, and its args, env and
envFrom, fieldRef status.podIP, Secrets as env vars and as mounted files, and the service-link variables
Kubernetes injects for every Service with a cluster IP in the namespace), with the Service names
resolving as cluster DNS would:

- a headless Service resolves to every pod it selects, before they are ready only with
  publishNotReadyAddresses (at start-up no pod is ready yet);
- a Service with a cluster IP resolves to that IP, which forwards to ready pods only: here, to
  nothing, since no gateway is ready before a worker has registered. The one exception is
  pdserve-redis, whose pod is ready as soon as it listens (a tcpSocket probe): its name resolves to
  its pod, as the Service's forwarding would reach it.

So workers that registered through the API Service, or through a worker-plane Service without
publishNotReadyAddresses, would never reach a starting gateway, and the test would time out as the
cluster would; a worker that found only one gateway replica would be missing from the other. The
worker plane is authenticated with the cluster key of the Secret the operator creates (docs/deploy.md);
the Responses store is the Redis pod (this machine's redis-server run with the manifest's command). The
probes of each container are then asked at the ports the manifests name."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from transformers import AutoTokenizer

from engine.llm import LLM
from engine.sampling.params import SamplingParams
from tests.model_factory import tiny_model_dir
from tests.netns import ROOT, HostProcess, Network, poll_until
from tests.operator_commands import run_documented_commands

APP_DIR = "/app/"  # the image's WORKDIR: the repository's configs/ are at /app/configs (deploy/Dockerfile)
ENTRYPOINT = [sys.executable, "-m", "cluster"]  # the image's ENTRYPOINT ["pdserve"]
# each Deployment's pods take host indexes from here on, one per replica
FIRST_INDEX = {"pdserve-gateway": 10, "pdserve-redis": 30, "pdserve-prefill": 40, "pdserve-decode": 50}
# Cluster IPs lie outside the pods' subnet and no namespace has a route there: nothing answers at one
# (see the module docstring)
CLUSTER_IPS = iter(f"10.96.0.{i}" for i in range(10, 250))
# Services whose pods are ready from the start, so cluster DNS may as well name the pod (module docstring)
READY_AT_ONCE = {"pdserve-redis"}


def service_links(services: list[dict], ips: dict[str, str]) -> dict[str, str]:
    """What the kubelet injects for each Service with a cluster IP (headless ones get none)."""
    env = {
        "KUBERNETES_SERVICE_HOST": "10.96.0.1",
        "KUBERNETES_SERVICE_PORT": "443",
        "KUBERNETES_SERVICE_PORT_HTTPS": "443",
        "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    }
    for service in services:
        if service["spec"].get("clusterIP") == "None":
            continue
        name, ip = service["metadata"]["name"].upper().replace("-", "_"), ips[service["metadata"]["name"]]
        ports = service["spec"]["ports"]
        env[f"{name}_SERVICE_HOST"], env[f"{name}_SERVICE_PORT"] = ip, str(ports[0]["port"])
        env[f"{name}_PORT"] = f"tcp://{ip}:{ports[0]['port']}"
        for port in ports:
            if "name" in port:
                env[f"{name}_SERVICE_PORT_{port['name'].upper().replace('-', '_')}"] = str(port["port"])
            tcp = f"{name}_PORT_{port['port']}_TCP"
            env.update(
                {
                    tcp: f"tcp://{ip}:{port['port']}",
                    f"{tcp}_PROTO": "tcp",
                    f"{tcp}_PORT": str(port["port"]),
                    f"{tcp}_ADDR": ip,
                }
            )
    return env


def cluster_dns(
    services: list[dict], pods: dict[str, dict], pod_ips: dict[str, str], ips: dict[str, str]
) -> dict[str, list[str]]:
    """Service name -> its addresses, for pods none of which is ready yet (see the module docstring)."""
    names = {}
    for service in services:
        name, spec = service["metadata"]["name"], service["spec"]
        selected = [pod_ips[pod] for pod, labels in pods.items() if spec["selector"].items() <= labels.items()]
        if name in READY_AT_ONCE:
            names[name] = selected
        elif spec.get("clusterIP") != "None":
            names[name] = [ips[name]]
        elif spec.get("publishNotReadyAddresses") and selected:
            names[name] = selected  # one A record per pod: one hosts line each (tests/netns.py)
    return names


def mount_secrets(pod_spec: dict, container: dict, secrets_: dict[str, dict], root: Path) -> dict[str, str]:
    """The container's Secret volumes as the kubelet writes them, under ``root``: its atomic writer's
    layout (``<key> -> ..data/<key>``, ``..data`` -> a timestamped folder), defaultMode, and with the
    pod's fsGroup the group read bit the kubelet adds for it (0400 arrives 0440; the group is this
    process's own here). This machine's /etc is not ours to write, so each mountPath becomes a temporary
    directory and the env values that name a file below it are rewritten to match (container_env).
    Returns mountPath -> that directory."""
    volumes = {v["name"]: v["secret"] for v in pod_spec.get("volumes", []) if "secret" in v}
    has_fs_group = "fsGroup" in pod_spec.get("securityContext", {})
    mounts = {}
    for mount in container.get("volumeMounts", []):
        if (secret := volumes.get(mount["name"])) is None:
            continue
        folder = Path(tempfile.mkdtemp(dir=root))
        stamped = folder / "..2026_11_29_00_00_00.1"
        stamped.mkdir()
        (folder / "..data").symlink_to(stamped.name)
        for key, text in secrets_[secret["secretName"]].items():
            path = stamped / key
            path.write_text(text)
            path.chmod(secret.get("defaultMode", 0o644) | (0o440 if has_fs_group else 0))
            (folder / key).symlink_to(f"..data/{key}")
        mounts[mount["mountPath"]] = str(folder)
    return mounts


def container_env(
    container: dict,
    configmaps: dict[str, dict],
    secrets_: dict[str, dict],
    pod_ip: str,
    links: dict[str, str],
    mounts: dict[str, str],
) -> dict[str, str]:
    """The container's environment in the kubelet's order: service links, then envFrom, then env."""
    # the image's own environment (HOME: the cache volume shared by the workers is this machine's cache)
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": str(ROOT),
        **links,
    }
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    for var in container.get("env", []):
        if "value" in var:
            # $(NAME) of a variable defined before it, as the kubelet expands it (dependent variables)
            env[var["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)), var["value"])
            for mount_path, folder in mounts.items():  # a file on a Secret volume (mount_secrets)
                if var["value"].startswith(mount_path.rstrip("/") + "/"):
                    env[var["name"]] = folder + var["value"][len(mount_path.rstrip("/")) :]
        elif "fieldRef" in var["valueFrom"]:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", var
            env[var["name"]] = pod_ip
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets_[ref["name"]][ref["key"]]
    return env


def probe(pod: HostProcess, container: dict, name: str) -> int:
    """The probe's verdict as an HTTP status (a tcpSocket probe that connects: 200)."""
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    if tcp := container[name].get("tcpSocket"):
        socket.create_connection((pod.address, ports.get(tcp["port"], tcp["port"])), timeout=5).close()
        return 200
    get = container[name]["httpGet"]
    port = ports.get(get["port"], get["port"])
    try:
        with urllib.request.urlopen(f"http://{pod.address}:{port}{get['path']}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_pods_start_as_the_manifests_say_register_with_every_gateway_and_serve(tmp_path):
    model = str(tiny_model_dir("llama"))
    (keys := tmp_path / "operator").mkdir()
    operated = run_documented_commands(keys)
    assert list(operated.applied) == ["deploy/k8s/overlays/cpu"]  # the overlay the docs apply
    rendered = operated.applied["deploy/k8s/overlays/cpu"]
    deployments = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "Deployment"}
    services = [d for d in rendered if d["kind"] == "Service"]
    configmaps = {d["metadata"]["name"]: dict(d["data"]) for d in rendered if d["kind"] == "ConfigMap"}
    # the operator's one setting for a real model (docs/deploy.md); here the test's small checkpoint
    configmaps["pdserve-env"]["PDSERVE_MODEL_PATH"] = model
    secrets_ = operated.secrets  # the Secrets as `kubectl create secret generic` made them
    assert sorted(secrets_) == [
        "pdserve-api-keys",
        "pdserve-decode-key",
        "pdserve-gateway-key",
        "pdserve-prefill-key",
        "pdserve-redis",
    ]
    assert not list(keys.iterdir())  # the docs' `rm -r keys` ran: the credentials live in the Secrets only
    api_key = secrets_["pdserve-api-keys"]["keys"]
    assert set(deployments) == set(FIRST_INDEX)
    assert deployments["pdserve-gateway"]["spec"]["replicas"] == 2

    net = Network()
    assert net.isolated, f"the start-up test needs network namespaces (root and `ip`): {getattr(net, 'reason', '')}"
    pods: dict[str, HostProcess] = {}
    try:
        replicas = {  # pod name -> (its Deployment, its host index)
            f"{name}-{i}": (name, FIRST_INDEX[name] + i)
            for name, d in deployments.items()
            for i in range(d["spec"]["replicas"])
        }
        pod_ips = {pod: net.address(index) for pod, (_, index) in replicas.items()}
        labels = {
            pod: deployments[name]["spec"]["template"]["metadata"]["labels"] for pod, (name, _) in replicas.items()
        }
        ips = {s["metadata"]["name"]: next(CLUSTER_IPS) for s in services if s["spec"].get("clusterIP") != "None"}
        links, names = service_links(services, ips), cluster_dns(services, labels, pod_ips, ips)
        for pod, (name, index) in replicas.items():
            spec = deployments[name]["spec"]["template"]["spec"]
            [container] = spec["containers"]
            address, prefix = net.add_host(pod.removeprefix("pdserve-"), index, names)
            args = [
                str(ROOT / a.removeprefix(APP_DIR)) if a.startswith(APP_DIR) else a for a in container.get("args", [])
            ]
            mounts = mount_secrets(spec, container, secrets_, tmp_path)
            env = container_env(container, configmaps, secrets_, address, links, mounts)
            pods[pod] = HostProcess(address, prefix + (container.get("command") or ENTRYPOINT) + args, env)

        [gateway_container] = deployments["pdserve-gateway"]["spec"]["template"]["spec"]["containers"]
        port = gateway_container["ports"][0]["containerPort"]
        bases = [f"http://{pods[pod].address}:{port}" for pod in sorted(pods) if pod.startswith("pdserve-gateway-")]
        keyed = {"content-type": "application/json", "authorization": f"Bearer {api_key}"}

        def call(url: str, body: dict | None = None, headers: dict = keyed) -> dict:
            data = None if body is None else json.dumps(body).encode()
            with urllib.request.urlopen(urllib.request.Request(url, data, headers), timeout=120) as response:
                return json.loads(response.read())

        def workers(base: str) -> list[tuple[str, str]]:
            return sorted((w["role"], w["id"]) for w in call(f"{base}/v1/workers")["data"])

        def tails() -> str:
            return "".join(f"--- {n} (exit {p.proc.poll()})\n" + "".join(p.log[-15:]) for n, p in pods.items())

        def started() -> bool:
            exited = [name for name, pod in pods.items() if pod.proc.poll() is not None]
            assert not exited, f"{exited} exited at start-up\n{tails()}"  # a crash fails at once, not at the deadline
            return all([role for role, _ in workers(base)] == ["decode", "prefill"] for base in bases)

        assert poll_until(started, 240), "workers never registered with every gateway\n" + tails()
        # the same two workers on both replicas: each worker found every gateway behind the headless Service
        assert workers(bases[0]) == workers(bases[1])
        for pod, (name, _) in replicas.items():  # every probe the kubelet would ask now passes
            [container] = deployments[name]["spec"]["template"]["spec"]["containers"]
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                if kind in container:
                    assert poll_until(lambda p=pods[pod], c=container, k=kind: probe(p, c, k) == 200, 60), (
                        pod,
                        kind,
                        tails(),
                    )

        prompt = [5, 6, 7, 8, 9, 10, 11, 12]
        body = {"model": model, "prompt": [prompt], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        reference = LLM(model, block_size=16)
        [out] = reference.generate([prompt], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        expected = reference.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
        for base in bases:
            try:
                call(f"{base}/v1/completions", body, {"content-type": "application/json"})
                raise AssertionError(f"{base} served without the Secret's key")
            except urllib.error.HTTPError as exc:
                assert exc.code == 401
            assert call(f"{base}/v1/completions", body)["choices"][0]["text"] == expected, base

        # a conversation begun at one replica goes on at the other: the store is the Redis pod
        ask = {"model": model, "max_output_tokens": 6, "temperature": 0.0, "ignore_eos": True}
        first = call(f"{bases[0]}/v1/responses", {**ask, "input": "Tell me about foxes."})
        after = call(f"{bases[1]}/v1/responses", {**ask, "input": "And wolves?", "previous_response_id": first["id"]})
        messages = [
            {"role": "user", "content": "Tell me about foxes."},
            {"role": "assistant", "content": first["output"][0]["content"][0]["text"]},
            {"role": "user", "content": "And wolves?"},
        ]
        ids = AutoTokenizer.from_pretrained(model).apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert after["usage"]["input_tokens"] == len(ids)  # gateway 2's prompt held gateway 1's answer
        assert call(f"{bases[1]}/v1/responses/{first['id']}") == first
    finally:
        for pod in pods.values():
            pod.stop()
        net.close()
