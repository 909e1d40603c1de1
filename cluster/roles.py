"""``pdserve gateway|prefill|decode --config FILE [--set section.field=value ...] [vLLM flags]``: one
role in this process, as a container or a Kubernetes pod runs it (cluster/vllm_flags.py: the vLLM flags).

The role's own entry point (``python -m gateway|prefill_node|decode_node``) replaces this process
(``exec``), so SIGTERM from Docker or the kubelet reaches the role directly and drains it.

Before that, the role's bind host is made concrete, because whatever a worker binds is also the address
it advertises to its peers (prefill: job endpoint; decode: KV endpoint), and neither ZeroMQ nor the HTTP
servers bind a DNS name or an interface name by themselves:
    IP literal      -> as given                          ("10.0.0.12")
    interface name  -> that interface's IPv4 address    ("eth0": the container's own address)
    anything else   -> resolved through /etc/hosts, DNS ("localhost", a pod's hostname)
So a container binds its own address on its network (never 0.0.0.0) and advertises an address that the
other containers reach, whatever IP Docker or Kubernetes gave it.
"""

from __future__ import annotations

import argparse
import fcntl
import ipaddress
import os
import socket
import struct
import sys

from cluster.vllm_flags import add_vllm_groups, vllm_overrides
from configs.loader import load_config
from configs.schema import EX_CONFIG, ConfigError

ROLE_MODULES = {"gateway": "gateway", "prefill": "prefill_node", "decode": "decode_node"}
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_ipv4(name: str) -> str | None:
    """The IPv4 address of network interface ``name``; None when there is no such interface (or no IPv4)."""
    if name not in {n for _, n in socket.if_nameindex()}:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None  # the interface exists but has no IPv4 address
    return socket.inet_ntoa(packed[20:24])  # struct ifreq: 16-byte name, then sockaddr_in (addr at +4)


def resolve_host(host: str) -> str:
    """A concrete address to bind and advertise for ``host`` (see the module docstring)."""
    if host.startswith(("inproc://", "ipc://")):
        return host
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    from_interface = interface_ipv4(host)
    if from_interface is not None:
        return from_interface
    try:
        return socket.gethostbyname(host)
    except OSError as exc:
        raise ConfigError(
            f"bind host {host!r} is neither an IP address, an interface nor a resolvable name: {exc}"
        ) from None


def parse_sets(items: list[str]) -> dict[str, str]:
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ConfigError(f"--set expects section.field=value, got {item!r}")
        overrides[key] = value
    return overrides


def env_of(overrides: dict[str, str]) -> dict[str, str]:
    """The PDSERVE_<SECTION>_<FIELD> variables that carry ``{"section.field": value}`` to a child."""
    env = {}
    for dotted, value in overrides.items():
        section, _, key = dotted.partition(".")
        env[f"PDSERVE_{section.upper()}_{key.upper()}"] = value
    return env


def role_command(
    role: str, config_path: str | None, overrides: dict[str, str], env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """(argv, env) that run ``role`` with the given settings, its bind host resolved.

    The workers take ``--set``; the gateway takes none, so its settings travel as PDSERVE_* variables
    (written over any inherited ones, which keeps the command line's precedence over the environment).
    """
    config = load_config(config_path, env=env, overrides=overrides)  # validates everything before exec
    bound = {**overrides, f"{role}.host": resolve_host(getattr(config, role).host)}
    argv = [sys.executable, "-m", ROLE_MODULES[role]] + (["--config", config_path] if config_path else [])
    env = dict(env)
    if role == "gateway":
        env.update(env_of(bound))
    else:
        for dotted, value in bound.items():
            argv += ["--set", f"{dotted}={value}"]
    return argv, env


def add_config_args(p: argparse.ArgumentParser) -> None:
    """pdserve's own way to every field: a YAML file and --set (the vLLM flags are views of the same fields)."""
    group = p.add_argument_group("pdserve config")
    group.add_argument("--config", help="YAML config file (configs/schema.py lists every field)")
    group.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set engine.block_size=32 (repeatable; "
        "a vLLM flag for the same field wins)",
    )


def command_line_overrides(args: argparse.Namespace, role: str) -> dict[str, str]:
    """--set, then the vLLM flags over it: the one dict of CLI overrides."""
    return {**parse_sets(args.set), **vllm_overrides(args, role)}


def main_for(role: str, argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog=f"pdserve {role}", description=f"run one pdserve {role} process")
    add_config_args(p)
    add_vllm_groups(p, role)
    args = p.parse_args(argv)
    try:
        command, env = role_command(role, args.config, command_line_overrides(args, role), dict(os.environ))
    except (ConfigError, OSError) as exc:
        print(f"pdserve {role}: {exc}", file=sys.stderr)
        return EX_CONFIG
    sys.stdout.flush()
    os.execve(command[0], command, env)  # never returns


def gateway_main(argv: list[str]) -> int:
    return main_for("gateway", argv)


def prefill_main(argv: list[str]) -> int:
    return main_for("prefill", argv)


def decode_main(argv: list[str]) -> int:
    return main_for("decode", argv)
