"""The Kubernetes manifests start and serve, without a cluster: each pod of deploy/k8s/overlays/cpu runs
in its own network namespace, started exactly as the kubelet would start it (the image's entrypoint and
the container's args, env and envFrom, fieldRef status.podIP, the API key from its Secret, and the
service-link variables Kubernetes injects for every Service with a cluster IP in the namespace), with
the Service names resolving as cluster DNS would:

- a headless Service resolves to the pods it selects, before they are ready only with
  publishNotReadyAddresses (at start-up no pod is ready yet);
- a Service with a cluster IP resolves to that IP, which forwards to ready pods only: here, to
  nothing, since no gateway is ready before a worker has registered.

So workers that registered through the API Service, or through a worker-plane Service without
publishNotReadyAddresses, would never reach a starting gateway, and the test would time out as the
cluster would. The probes of each container are then asked at the ports the manifests name."""

from __future__ import annotations

import json
import os
import secrets
import sys
import urllib.error
import urllib.request

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.kustomize_lite import render
from tests.model_factory import tiny_model_dir
from tests.netns import ROOT, HostProcess, Network, poll_until

APP_DIR = "/app/"  # the image's WORKDIR: the repository's configs/ are at /app/configs (deploy/Dockerfile)
ENTRYPOINT = [sys.executable, "-m", "cluster"]  # the image's ENTRYPOINT ["pdserve"]
POD_INDEX = {"pdserve-gateway": 10, "pdserve-prefill": 11, "pdserve-decode": 21}
# Cluster IPs lie outside the pods' subnet and no namespace has a route there: nothing answers at one
# (see the module docstring)
CLUSTER_IPS = iter(f"10.96.0.{i}" for i in range(10, 250))


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
) -> dict[str, str]:
    """Service name -> address, for pods none of which is ready yet (see the module docstring)."""
    names = {}
    for service in services:
        name, spec = service["metadata"]["name"], service["spec"]
        if spec.get("clusterIP") != "None":
            names[name] = ips[name]
            continue
        selected = [pod for pod, labels in pods.items() if spec["selector"].items() <= labels.items()]
        if spec.get("publishNotReadyAddresses") and selected:
            [pod] = selected  # one replica each here; /etc/hosts holds one address per name
            names[name] = pod_ips[pod]
    return names


def container_env(
    container: dict, configmaps: dict[str, dict], secrets_: dict[str, dict], pod_ip: str, links: dict[str, str]
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
            env[var["name"]] = var["value"]
        elif "fieldRef" in var["valueFrom"]:
            assert var["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", var
            env[var["name"]] = pod_ip
        else:
            ref = var["valueFrom"]["secretKeyRef"]
            env[var["name"]] = secrets_[ref["name"]][ref["key"]]
    return env


def probe(pod: HostProcess, container: dict, name: str) -> int:
    get = container[name]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    port = ports.get(get["port"], get["port"])
    try:
        with urllib.request.urlopen(f"http://{pod.address}:{port}{get['path']}", timeout=5) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_pods_start_as_the_manifests_say_register_and_serve():
    model = str(tiny_model_dir("llama"))
    rendered = render(ROOT / "deploy" / "k8s" / "overlays" / "cpu")
    deployments = {d["metadata"]["name"]: d for d in rendered if d["kind"] == "Deployment"}
    services = [d for d in rendered if d["kind"] == "Service"]
    configmaps = {d["metadata"]["name"]: dict(d["data"]) for d in rendered if d["kind"] == "ConfigMap"}
    # the operator's one setting for a real model (docs/deploy.md); here the test's small checkpoint
    configmaps["pdserve-env"]["PDSERVE_MODEL_PATH"] = model
    api_key = secrets.token_hex(16)
    secrets_ = {"pdserve-api-keys": {"keys": api_key}}  # `kubectl create secret generic pdserve-api-keys`
    assert set(deployments) == set(POD_INDEX)

    net = Network()
    assert net.isolated, f"the start-up test needs network namespaces (root and `ip`): {getattr(net, 'reason', '')}"
    pods: dict[str, HostProcess] = {}
    try:
        pod_ips = {name: net.address(index) for name, index in POD_INDEX.items()}
        labels = {name: d["spec"]["template"]["metadata"]["labels"] for name, d in deployments.items()}
        ips = {s["metadata"]["name"]: next(CLUSTER_IPS) for s in services if s["spec"].get("clusterIP") != "None"}
        links, names = service_links(services, ips), cluster_dns(services, labels, pod_ips, ips)
        for name, deployment in deployments.items():
            [container] = deployment["spec"]["template"]["spec"]["containers"]
            address, prefix = net.add_host(name.removeprefix("pdserve-"), POD_INDEX[name], names)
            args = [str(ROOT / a.removeprefix(APP_DIR)) if a.startswith(APP_DIR) else a for a in container["args"]]
            env = container_env(container, configmaps, secrets_, address, links)
            pods[name] = HostProcess(address, prefix + ENTRYPOINT + args, env)

        gateway = pods["pdserve-gateway"]
        [gateway_container] = deployments["pdserve-gateway"]["spec"]["template"]["spec"]["containers"]
        base = f"http://{gateway.address}:{gateway_container['ports'][0]['containerPort']}"

        def registered() -> set[str]:
            request = urllib.request.Request(f"{base}/v1/workers", headers={"authorization": f"Bearer {api_key}"})
            with urllib.request.urlopen(request, timeout=5) as response:
                return {w["role"] for w in json.loads(response.read())["data"]}

        def tails() -> str:
            return "".join(f"--- {n} (exit {p.proc.poll()})\n" + "".join(p.log[-15:]) for n, p in pods.items())

        def started() -> bool:
            exited = [name for name, pod in pods.items() if pod.proc.poll() is not None]
            assert not exited, f"{exited} exited at start-up\n{tails()}"  # a crash fails at once, not at the deadline
            return registered() == {"prefill", "decode"}

        assert poll_until(started, 240), "workers never registered\n" + tails()
        for name, pod in pods.items():  # every probe the kubelet would ask now passes
            [container] = deployments[name]["spec"]["template"]["spec"]["containers"]
            for kind in ("startupProbe", "livenessProbe", "readinessProbe"):
                assert poll_until(lambda p=pod, c=container, k=kind: probe(p, c, k) == 200, 60), (name, kind, tails())

        body = json.dumps(
            {
                "model": model,
                "prompt": [[5, 6, 7, 8, 9, 10, 11, 12]],
                "max_tokens": 6,
                "temperature": 0.0,
                "ignore_eos": True,
            }
        ).encode()
        anonymous = urllib.request.Request(f"{base}/v1/completions", body, {"content-type": "application/json"})
        try:
            urllib.request.urlopen(anonymous, timeout=60)
            raise AssertionError("served without the Secret's key")
        except urllib.error.HTTPError as exc:
            assert exc.code == 401
        keyed = urllib.request.Request(
            f"{base}/v1/completions", body, {"content-type": "application/json", "authorization": f"Bearer {api_key}"}
        )
        with urllib.request.urlopen(keyed, timeout=120) as response:
            text = json.loads(response.read())["choices"][0]["text"]
        reference = LLM(model, block_size=16)
        [out] = reference.generate(
            [[5, 6, 7, 8, 9, 10, 11, 12]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
        )
        assert text == reference.tokenizer.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    finally:
        for pod in pods.values():
            pod.stop()
        net.close()
