"""Hosts for multi-host scenarios on one machine: one network namespace per host, each with a veth on a
shared bridge (or loopback where namespaces cannot be made), and one pdserve process per host started
as a container would start it (``python -m cluster <role> --config ... --set ...``). Used by the
multi-host test and by the chaos tool's link-down scenarios (``set_link`` takes a host's veth down)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUBNET = "10.77.{}.{}"
READY = re.compile(r"READY http_port=(\d+)")


def poll_until(predicate, timeout_s: float, poll_s: float = 0.1):
    """``predicate()``'s first truthy value within ``timeout_s``, else None. OSError counts as "not yet":
    a member between incarnations, or behind a link that is down, refuses connections."""
    give_up = time.monotonic() + timeout_s
    while time.monotonic() < give_up:
        try:
            if value := predicate():
                return value
        except OSError:
            pass
        time.sleep(poll_s)
    return None


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True, timeout=10)


class Network:
    """Hosts for the scenario: one namespace per host on a bridge, or loopback where that is impossible."""

    def __init__(self) -> None:
        tag = uuid.uuid4().hex[:5]
        self.bridge, self.prefix, self.net = f"pdbr{tag}", f"pd{tag}", int(tag, 16) % 200 + 20
        self.namespaces: list[str] = []
        self.links: list[str] = []
        self.veths: dict[str, str] = {}  # host name -> its veth's bridge end
        self.forward_rule: list[str] | None = None  # the iptables FORWARD rule we added, removed on close
        self.isolated = (
            os.geteuid() == 0 and shutil.which("ip") is not None and not os.environ.get("MULTIHOST_LOOPBACK")
        )
        if self.isolated:
            try:
                _run("ip", "link", "add", self.bridge, "type", "bridge")
                self.links.append(self.bridge)
                _run("ip", "addr", "add", f"{SUBNET.format(self.net, 1)}/24", "dev", self.bridge)
                _run("ip", "link", "set", self.bridge, "up")
                self._accept_bridged_traffic()
            except (subprocess.CalledProcessError, OSError) as exc:
                self.isolated = False
                self.reason = f"cannot create a bridge: {getattr(exc, 'stderr', exc)}"
        else:
            self.reason = "not root, no `ip` command, or MULTIHOST_LOOPBACK set"
        print(
            "multihost: "
            + (f"network namespaces on bridge {self.bridge}" if self.isolated else f"LOOPBACK fallback: {self.reason}")
        )

    def _accept_bridged_traffic(self) -> None:
        """Where bridged frames pass iptables (br_netfilter), a FORWARD policy of DROP (dockerd sets
        it) silently cuts the hosts off from each other: accept our bridge's traffic explicitly."""
        if shutil.which("iptables") is None:
            return
        rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        if subprocess.run(["iptables", "-I", *rule], capture_output=True, check=False).returncode == 0:
            self.forward_rule = rule

    def address(self, index: int) -> str:
        return SUBNET.format(self.net, index) if self.isolated else "127.0.0.1"

    def add_host(self, name: str, index: int, names: dict[str, str | list[str]] | None = None) -> tuple[str, list[str]]:
        """(address, argv prefix) of a new host. ``names``: what resolves there (its /etc/hosts), by
        default 'gateway' to host index 10; a name with a list resolves to every address of it (one
        hosts line each: glibc's getaddrinfo returns them all, as DNS returns a headless Service's A records)."""
        if not self.isolated:
            return "127.0.0.1", []
        ns, veth = f"{self.prefix}-{name}", f"{self.prefix}{index}"
        _run("ip", "netns", "add", ns)  # a failure here fails the test: the bridge worked, so this should
        self.namespaces.append(ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
        self.links.append(veth)
        self.veths[name] = veth
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        address = SUBNET.format(self.net, index)
        for cmd in (
            ["addr", "add", f"{address}/24", "dev", "eth0"],
            ["link", "set", "eth0", "up"],
            ["link", "set", "lo", "up"],
        ):
            _run("ip", "netns", "exec", ns, "ip", *cmd)
        etc = Path("/etc/netns") / ns  # `ip netns exec` mounts this over /etc: the gateway's name resolves
        etc.mkdir(parents=True, exist_ok=True)
        names = {"gateway": self.address(10)} if names is None else names
        lines = [f"{ip} {name}\n" for name, ips in names.items() for ip in ([ips] if isinstance(ips, str) else ips)]
        (etc / "hosts").write_text("127.0.0.1 localhost\n" + "".join(lines))
        return address, ["ip", "netns", "exec", ns]

    def set_link(self, name: str, up: bool) -> None:
        """Take the host's only link to the others down (its process lives on, cut off) or back up."""
        _run("ip", "link", "set", self.veths[name], "up" if up else "down")

    def close(self) -> None:
        for ns in self.namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        for link in reversed(self.links):
            subprocess.run(["ip", "link", "del", link], capture_output=True)
        if self.forward_rule:
            subprocess.run(["iptables", "-D", *self.forward_rule], capture_output=True, check=False)


class HostProcess:
    """One process at ``address`` (``argv`` already entered its host's namespace), its output kept."""

    def __init__(self, address: str, argv: list[str], env: dict[str, str] | None = None):
        self.address = address
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.log: list[str] = []
        self.http_port: int | None = None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if (match := READY.search(line)) and self.http_port is None:
                self.http_port = int(match.group(1))

    def metric(self, name: str, **labels: str) -> float:
        body = urllib.request.urlopen(f"http://{self.address}:{self.http_port}/metrics", timeout=5).read().decode()
        total = 0.0
        for line in body.splitlines():
            if line.startswith((name + " ", name + "{")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, timeout_s: float = 15.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(15)  # SIGTERM: drain
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Host(HostProcess):
    """One pdserve process on one host, started as a container starts it."""

    def __init__(self, net: Network, name: str, index: int, role: str, sets: dict[str, object], preset: str):
        address, prefix = net.add_host(name, index)
        argv = prefix + [sys.executable, "-m", "cluster", role, "--config", preset]
        argv += [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
        super().__init__(address, argv)
