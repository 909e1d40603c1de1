"""``pdserve serve``: the whole product on this machine — gateway + N prefill + M decode workers.

Prints the URL at once and ``pdserve: ready`` when ``/ready`` answers 200 and every worker it started
has registered with the gateway. Ctrl-C or SIGTERM drains every worker and stops everything.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from cluster.local_cluster import ClusterSpec, LocalCluster, MemberFailed
from cluster.lora_args import add_lora_args, lora_settings
from configs.model_source import resolve_model
from configs.schema import EX_CONFIG, ConfigError, load_config
from gateway.__main__ import add_chat_parser_args


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve serve", description=__doc__.splitlines()[0])
    p.add_argument("--model", help="HF directory or hub id (default: the embedded small model, made on first use)")
    p.add_argument("--host", help="gateway interface (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="gateway HTTP port (default 8000)")
    p.add_argument("--prefill", type=int, help="prefill workers (default 1; 0 = decode workers prefill locally)")
    p.add_argument("--decode", type=int, help="decode workers (default 1)")
    p.add_argument("--api-key", action="append", help="accepted API key; repeat for several")
    add_chat_parser_args(p)
    add_lora_args(p)
    p.add_argument("--config", help="YAML config file shared by every process")
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every worker")
    return p.parse_args(argv)


def cluster_env(args: argparse.Namespace, model: str, host: str, worker_port: int) -> dict[str, str]:
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
    for dotted, value in lora_settings(args).items():
        env[f"PDSERVE_{dotted.replace('.', '_').upper()}"] = value
    for role in ("PREFILL", "DECODE"):
        env[f"PDSERVE_{role}_GATEWAY_ADDRESS"] = f"tcp://{host}:{worker_port}"
    return env


def wait_ready(url: str, cluster: LocalCluster, timeout_s: float, expected: dict[str, int],
               stopped: Callable[[], bool] = lambda: False) -> bool:
    """Until ``/ready`` answers 200 and the gateway counts ``expected`` workers per role. ``/ready``
    alone is satisfied by one decode worker, which serves by prefilling locally: clients let in before
    the prefill workers join run on another system than the one asked for (the serving benchmark's
    first prompts did, and the prefill worker's prefix cache then started without them)."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up and not stopped():  # SIGTERM while starting: stop now, not at give_up
        cluster.supervise_once()
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as response:
                ready = response.status == 200
            with urllib.request.urlopen(f"{url}/metrics", timeout=2) as response:
                registered = registered_workers(response.read().decode())
            if ready and all(registered.get(role, 0) >= n for role, n in expected.items()):
                return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.3)
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
        return EX_CONFIG
    model = args.model or config.model.path
    if not model:
        print("pdserve: preparing the embedded default model (first run only) ...", flush=True)
    try:  # once, before any member starts: a hub id is fetched here, and a bad model is one line now
        resolved = resolve_model(model, config.model.cache_dir)
    except ConfigError as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return EX_CONFIG
    if not model:
        model = str(resolved)
        os.environ.setdefault("PDSERVE_MODEL_SERVED_MODEL_NAME", "pdserve-small")
    num_prefill = config.cluster.num_prefill if args.prefill is None else args.prefill
    num_decode = config.cluster.num_decode if args.decode is None else args.decode
    if num_prefill < 0 or num_decode < 1:
        print("pdserve serve: needs --prefill >= 0 and --decode >= 1", file=sys.stderr)
        return 2
    host = args.host or config.gateway.host
    port = config.gateway.port if args.port is None else args.port
    cores = len(os.sched_getaffinity(0))  # the cores this process may use (taskset, cgroups), not the host's
    threads = max(1, cores // (num_prefill + num_decode))
    spec = ClusterSpec(args.config, cluster_env(args, model, host, config.gateway.worker_port),
                       num_prefill, num_decode, threads, drain_timeout_s=config.decode.drain_timeout_s)
    cluster = LocalCluster(spec)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    url = f"http://{host}:{port}"
    print(f"pdserve: gateway {url}  ({num_prefill} prefill + {num_decode} decode workers, "
          f"{threads} thread(s) each, model {model})", flush=True)
    cluster.start()
    try:
        expected = {"prefill": num_prefill, "decode": num_decode}
        if not wait_ready(url, cluster, args.ready_timeout, expected, stopped=lambda: bool(stop)) and not stop:
            print(f"pdserve: {url}/ready did not answer 200 with all {num_prefill} prefill + {num_decode} decode "
                  f"workers registered within {args.ready_timeout:.0f} s", file=sys.stderr)
            return 1
        cluster.serving = True
        if not stop:
            print(f"pdserve: ready — OpenAI API at {url}/v1", flush=True)
        while not stop:
            cluster.supervise_once()
            time.sleep(0.5)
        print("pdserve: draining and stopping ...", flush=True)
        return 0
    except MemberFailed as exc:
        print(f"pdserve serve: {exc}; stopping the cluster", file=sys.stderr)
        return EX_CONFIG if exc.returncode == EX_CONFIG else 1
    finally:
        cluster.stop()
