"""``pdserve serve``: the whole product on this machine — gateway + N prefill + M decode workers.

Prints the URL at once and ``pdserve: ready`` when ``/ready`` answers 200 and every worker it started
has registered with the gateway. Ctrl-C or SIGTERM drains every worker and stops everything.

``--gateways N`` runs N gateways on ``--port``, ``--port + 1``, ... (worker ports likewise from
``gateway.worker_port``) in front of the same pools: every worker registers with each (its
``gateway_address`` lists them all), and ready means every gateway sees every worker. With N > 1 the
gateways share their Responses store in Redis: ``gateway.responses_store_url`` where given, else a
``redis-server`` started here on a free loopback port (docs/gateway-replicas.md).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import sys
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from cluster.local_cluster import ClusterSpec, LocalCluster
from configs.schema import ConfigError, load_config
from gateway.__main__ import add_chat_parser_args


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF directory or hub id (default: the embedded small model, made on first use)")
    p.add_argument("--host", help="gateway interface (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gateway HTTP port (default 8000)")
    p.add_argument("--prefill", type=int, help="prefill workers (default 1; 0 = decode workers prefill locally)")
    p.add_argument("--decode", type=int, help="decode workers (default 1)")
    p.add_argument("--gateways", type=int, help="gateways in front of the same workers, on --port, --port + 1, ... "
                                                "(default 1; cluster.num_gateways)")
    p.add_argument("--api-key", action="append", help="accepted API key; repeat for several")
    add_chat_parser_args(p)
    p.add_argument("--config", help="YAML config file shared by every process")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every worker")
    return p.parse_args(argv)


def cluster_env(args: argparse.Namespace, model: str, host: str, worker_ports: list[int]) -> dict[str, str]:
    """Settings every member shares, passed as PDSERVE_* variables (they rank below each --set)."""
    env = {"PDSERVE_MODEL_PATH": model}
    if args.host:
        env["PDSERVE_GATEWAY_HOST"] = args.host
    if args.port is not None:
        env["PDSERVE_GATEWAY_PORT"] = str(args.port)
    if args.api_key:
        env["PDSERVE_GATEWAY_API_KEYS"] = ",".join(args.api_key)
    for name in ("reasoning_parser", "tool_call_parser"):
        if getattr(args, name):
            env[f"PDSERVE_GATEWAY_{name.upper()}"] = getattr(args, name)
    for role in ("PREFILL", "DECODE"):
        env[f"PDSERVE_{role}_GATEWAY_ADDRESS"] = ",".join(f"tcp://{host}:{port}" for port in worker_ports)
    return env


def redis_server(max_mb: int) -> tuple[list[str], str]:
    """(argv, url) of a redis-server on a free loopback port holding the gateways' Responses store:
    nothing written to disk, the least recently used responses dropped past ``max_mb``."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise ConfigError("--gateways > 1 needs a shared Responses store: install redis-server (Debian: "
                          "apt-get install redis-server) or set gateway.responses_store_url")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [exe, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
            "--maxmemory", f"{max(max_mb, 1)}mb", "--maxmemory-policy", "allkeys-lru"]
    return argv, f"redis://127.0.0.1:{port}/0"


def wait_ready(urls: list[str], cluster: LocalCluster, timeout_s: float, expected: dict[str, int]) -> bool:
    """Until ``/ready`` answers 200 and every gateway counts ``expected`` workers per role. ``/ready``
    alone is satisfied by one decode worker, which serves by prefilling locally: clients let in before
    the prefill workers join run on another system than the one asked for (the serving benchmark's
    first prompts did, and the prefill worker's prefix cache then started without them)."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        cluster.supervise_once()
        if all(gateway_ready(url, expected) for url in urls):
            return True
        time.sleep(0.3)
    return False


def gateway_ready(url: str, expected: dict[str, int]) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
            ready = response.status == 200
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as response:
            registered = registered_workers(response.read().decode())
        return ready and all(registered.get(role, 0) >= n for role, n in expected.items())
    except (urllib.error.URLError, OSError):
        return False


def registered_workers(metrics_text: str) -> dict[str, int]:
    """Workers per role from the gateway's ``pdserve:pool_workers`` gauge (Prometheus text)."""
    return {sample.labels["role"]: int(sample.value) for family in text_string_to_metric_families(metrics_text)
            for sample in family.samples if sample.name == "pdserve:pool_workers"}


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return 2
    model = args.model or config.model.path
    if not model:
        from cluster.default_model import configured_model_path  # made once, before any member starts

        print("pdserve: preparing the embedded default model (first run only) ...", flush=True)
        model = configured_model_path("", config.model.cache_dir)
        os.environ.setdefault("PDSERVE_MODEL_SERVED_MODEL_NAME", "pdserve-small")
    num_prefill = config.cluster.num_prefill if args.prefill is None else args.prefill
    num_decode = config.cluster.num_decode if args.decode is None else args.decode
    if num_prefill < 0 or num_decode < 1:
        print("pdserve serve: needs --prefill >= 0 and --decode >= 1", file=sys.stderr)
        return 2
    num_gateways = config.cluster.num_gateways if args.gateways is None else args.gateways
    if num_gateways < 1:
        print("pdserve serve: needs --gateways >= 1", file=sys.stderr)
        return 2
    host = args.host or config.gateway.host
    port = config.gateway.port if args.port is None else args.port
    gateways = [(port + i, config.gateway.worker_port + i) for i in range(num_gateways)]
    cores = len(os.sched_getaffinity(0))  # the cores this process may use (taskset, cgroups), not the host's
    threads = max(1, cores // (num_prefill + num_decode))
    env = cluster_env(args, model, host, [worker for _, worker in gateways])
    redis_argv = None
    if num_gateways > 1 and not config.gateway.responses_store_url:
        try:
            redis_argv, env["PDSERVE_GATEWAY_RESPONSES_STORE_URL"] = redis_server(config.gateway.responses_store_mb)
        except ConfigError as exc:
            print(f"pdserve serve: {exc}", file=sys.stderr)
            return 2
    spec = ClusterSpec(args.config, env, num_prefill, num_decode, threads, drain_timeout_s=config.decode.drain_timeout_s,
                       gateways=gateways if num_gateways > 1 else [], redis_argv=redis_argv)
    cluster = LocalCluster(spec)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    urls = [f"http://{host}:{http}" for http, _ in gateways]
    url = urls[0]
    print(f"pdserve: gateway {'  '.join(urls)}  ({num_prefill} prefill + {num_decode} decode workers, "
          f"{threads} thread(s) each, model {model})", flush=True)
    cluster.start()
    try:
        if not wait_ready(urls, cluster, args.ready_timeout, {"prefill": num_prefill, "decode": num_decode}) and not stop:
            print(f"pdserve: {url}/ready did not answer 200 with all {num_prefill} prefill + {num_decode} decode "
                  f"workers registered within {args.ready_timeout:.0f} s", file=sys.stderr)
            return 1
        if not stop:
            print(f"pdserve: ready — OpenAI API at {url}/v1", flush=True)
        while not stop:
            cluster.supervise_once()
            time.sleep(0.5)
        print("pdserve: draining and stopping ...", flush=True)
        return 0
    finally:
        cluster.stop()
