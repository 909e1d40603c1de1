"""``pdserve serve``: the whole product on this machine — gateway + N prefill + M decode workers.

Prints the URL at once and ``pdserve: ready`` when ``/ready`` answers 200 and every worker it started
has registered with the gateway. Ctrl-C or SIGTERM drains every worker and stops everything.

``--gateways N`` runs N gateways on ``--port``, ``--port + 1``, ... (worker ports likewise from
``gateway.worker_port``) in front of the same pools: every worker registers with each (its
``gateway_address`` lists them all), and ready means every gateway sees every worker. With N > 1 the
gateways share their Responses store in Redis: ``gateway.responses_store_url`` where given, else a
``redis-server`` started here on a free loopback port (docs/gateway-replicas.md).

The worker plane is CURVE-encrypted with the configured cluster key, or, when none is configured, with
a key made for this run: written 0600 in a private temporary directory whose path (never the key) the
members get in PDSERVE_TRANSFER_CLUSTER_KEY_FILE, removed at exit.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from cluster.gpu_placement import parse_devices
from cluster.local_cluster import ClusterSpec, LocalCluster, MemberFailed
from cluster.roles import add_config_args, command_line_overrides, env_of
from cluster.vllm_flags import add_vllm_groups
from configs.loader import load_config
from configs.model_source import resolve_model
from configs.schema import EX_CONFIG, ConfigError
from protocol.role_keys import ROLES, add_member, new_role_set


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve serve", description=__doc__.splitlines()[0])
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="as 'vllm serve MODEL': same as --model")
    group = p.add_argument_group("pdserve cluster")
    group.add_argument("--model", help="HF directory or hub id (default: the embedded small model, made on first use)")
    group.add_argument("--prefill", type=int, help="prefill workers (default 1; 0 = decode workers prefill locally)")
    group.add_argument("--decode", type=int, help="decode workers (default 1)")
    group.add_argument(
        "--gateways",
        type=int,
        help="gateways in front of the same workers, on --port, --port + 1, ... (default 1; cluster.num_gateways)",
    )
    group.add_argument(
        "--devices",
        help="GPUs the workers take turns over, e.g. 0,1,2,3 (each worker's own "
        "CUDA_VISIBLE_DEVICES comes first; default cluster.devices, else every worker sees all)",
    )
    group.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for every worker")
    add_config_args(p)
    add_vllm_groups(p, "gateway")
    args = p.parse_args(argv)
    if args.model_tag and args.model and args.model_tag != args.model:
        p.error(f"two models given: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model or args.model_tag
    return args


def cluster_env(overrides: dict[str, str], model: str, host: str, worker_ports: list[int]) -> dict[str, str]:
    """Settings every member shares, passed as PDSERVE_* variables: the command line's overrides
    (written over inherited variables, so the command line still wins over the environment; each
    member's own --set ranks above them), the model and the gateway's worker address."""
    env = {**env_of(overrides), "PDSERVE_MODEL_PATH": model}
    for role in ("PREFILL", "DECODE"):
        env[f"PDSERVE_{role}_GATEWAY_ADDRESS"] = ",".join(f"tcp://{host}:{port}" for port in worker_ports)
    return env


def redis_server(max_mb: int) -> tuple[list[str], str]:
    """(argv, url) of a redis-server on a free loopback port holding the gateways' Responses store:
    nothing written to disk, the least recently used responses dropped past ``max_mb``; a generated
    password (in a 0600 file of a private 0700 directory, never on a command line other users can read
    in ``ps``), protected mode on, so a process of the host without the password reads nothing (#47).
    The directory is ``argv[1]``'s; the caller removes it at exit (``remove_redis_config``)."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise ConfigError(
            "--gateways > 1 needs a shared Responses store: install redis-server (Debian: "
            "apt-get install redis-server) or set gateway.responses_store_url"
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    password = secrets.token_hex(32)
    folder = tempfile.mkdtemp(prefix="pdserve-redis-")  # 0700
    config = os.path.join(folder, "redis.conf")
    fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"requirepass {password}\nprotected-mode yes\n")
    argv = [
        exe,
        config,
        "--bind",
        "127.0.0.1",
        "--port",
        str(port),
        "--save",
        "",
        "--appendonly",
        "no",
        "--maxmemory",
        f"{max(max_mb, 1)}mb",
        "--maxmemory-policy",
        "allkeys-lru",
    ]
    return argv, f"redis://:{password}@127.0.0.1:{port}/0"


def remove_redis_config(argv: list[str] | None) -> None:
    """Remove the private directory of ``redis_server``'s config (and password)."""
    if argv is not None:
        shutil.rmtree(os.path.dirname(argv[1]), ignore_errors=True)


def wait_ready(
    urls: list[str],
    cluster: LocalCluster,
    timeout_s: float,
    expected: dict[str, int],
    stopped: Callable[[], bool] = lambda: False,
) -> bool:
    """Until ``/ready`` answers 200 and every gateway counts ``expected`` workers per role. ``/ready``
    alone is satisfied by one decode worker, which serves by prefilling locally: clients let in before
    the prefill workers join run on another system than the one asked for (the serving benchmark's
    first prompts did, and the prefill worker's prefix cache then started without them)."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up and not stopped():  # SIGTERM while starting: stop now, not at give_up
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
    return {
        sample.labels["role"]: int(sample.value)
        for family in text_string_to_metric_families(metrics_text)
        for sample in family.samples
        if sample.name == "pdserve:pool_workers"
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        overrides = command_line_overrides(args, "gateway")
        config = load_config(args.config, overrides=overrides)
    except (ConfigError, OSError) as exc:
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
    try:
        devices = parse_devices(args.devices if args.devices is not None else ",".join(config.cluster.devices))
    except ValueError as exc:
        print(f"pdserve serve: {exc}", file=sys.stderr)
        return EX_CONFIG
    num_gateways = config.cluster.num_gateways if args.gateways is None else args.gateways
    if num_gateways < 1:
        print("pdserve serve: needs --gateways >= 1", file=sys.stderr)
        return 2
    host, port = config.gateway.host, config.gateway.port
    gateways = [(port + i, config.gateway.worker_port + i) for i in range(num_gateways)]
    cores = len(os.sched_getaffinity(0))  # the cores this process may use (taskset, cgroups), not the host's
    threads = max(1, cores // (num_prefill + num_decode))
    env = cluster_env(overrides, model, host, [worker for _, worker in gateways])
    redis_argv = None
    if num_gateways > 1 and not config.gateway.responses_store_url:
        try:
            redis_argv, env["PDSERVE_GATEWAY_RESPONSES_STORE_URL"] = redis_server(config.gateway.responses_store_mb)
        except ConfigError as exc:
            print(f"pdserve serve: {exc}", file=sys.stderr)
            return EX_CONFIG
    role_keys: dict[str, str] = {}
    if not config.transfer.cluster_key_file and not config.transfer.insecure:
        role_keys = member_keys(tempfile.mkdtemp(prefix="pdserve-key-"), num_prefill, num_decode)
    spec = ClusterSpec(
        args.config,
        env,
        num_prefill,
        num_decode,
        threads,
        decode_idle_prefill_threads=idle_prefill_threads(num_prefill, num_decode, threads),
        drain_timeout_s=config.decode.drain_timeout_s,
        gateways=gateways if num_gateways > 1 else [],
        redis_argv=redis_argv,
        devices=devices,
        role_keys=role_keys,
    )
    try:
        return run_cluster(spec, host, [http for http, _ in gateways], model, args.ready_timeout)
    finally:
        if role_keys:
            shutil.rmtree(os.path.dirname(role_keys["gateway"]), ignore_errors=True)
        remove_redis_config(redis_argv)


def member_keys(directory: str, num_prefill: int, num_decode: int) -> dict[str, str]:
    """A credential per role and, for each worker, a member key of its own (protocol/role_keys.py) in
    the private ``directory``: member name (or role, for the gateways) -> its key file. A worker's id then
    stays its own across a restart: another worker of its pool cannot squat it (the gateway binds an id to
    the member key that registered it)."""
    paths = dict(zip(ROLES, new_role_set(directory)))
    for role, count in (("prefill", num_prefill), ("decode", num_decode)):
        for i in range(count):
            paths[f"{role}-{i}"] = add_member(directory, role, f"{role}-{i}")
    return paths


def idle_prefill_threads(num_prefill: int, num_decode: int, threads: int) -> int:
    """``decode.idle_prefill_threads`` for the decode workers: with one prefill worker and one decode worker
    the prefill worker works only on that decode worker's prompts, so its threads idle while none is out
    (decode_node/step_threads.py). With more workers a prefill worker may be busy for another: none."""
    return threads if num_prefill == 1 and num_decode == 1 else 0


def run_cluster(spec: ClusterSpec, host: str, http_ports: list[int], model: str, ready_timeout: float) -> int:
    num_prefill, num_decode, threads = spec.num_prefill, spec.num_decode, spec.threads_per_worker
    cluster = LocalCluster(spec)
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    urls = [f"http://{host}:{http}" for http in http_ports]
    extra = spec.decode_idle_prefill_threads
    borrow = f"; decode {threads + extra} while no prompt is out" if extra else ""
    url = urls[0]
    print(
        f"pdserve: gateway {'  '.join(urls)}  ({num_prefill} prefill + {num_decode} decode workers, "
        f"{threads} thread(s) each{borrow}, model {model})",
        flush=True,
    )
    for member in cluster.members:
        if "CUDA_VISIBLE_DEVICES" in member.env:
            print(
                f"pdserve: {member.name} on GPU {member.env['CUDA_VISIBLE_DEVICES'].split(',')[0]} "
                f"(CUDA_VISIBLE_DEVICES={member.env['CUDA_VISIBLE_DEVICES']})",
                flush=True,
            )
    cluster.start()
    try:
        expected = {"prefill": num_prefill, "decode": num_decode}
        if not wait_ready(urls, cluster, ready_timeout, expected, stopped=lambda: bool(stop)) and not stop:
            print(
                f"pdserve: {url}/ready did not answer 200 with all {num_prefill} prefill + {num_decode} decode "
                f"workers registered within {ready_timeout:.0f} s",
                file=sys.stderr,
            )
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
        cluster.stop()  # first: the reason is the last line the operator sees
        print(f"pdserve serve: {exc}; every member stopped", file=sys.stderr)
        return EX_CONFIG if exc.returncode == EX_CONFIG else 1
    finally:
        cluster.stop()
