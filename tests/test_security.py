"""Security properties of a running ``pdserve serve`` and of the product's source.

- With API keys configured, every /v1 route and /tokenize, /detokenize answer 401 without a valid key
  (and serve with one); /metrics, /health, /ready, /version, /openapi.json stay open.
- Every socket the cluster's processes listen on is bound to the configured interface (loopback),
  none to 0.0.0.0 or [::], read from the kernel's own tables (/proc/<pid>/fd + /proc/net/tcp*).
- Nothing can unpickle what arrives on a socket: the source of every product package is parsed and
  searched for pickle-family deserializers (an AST scan, itself checked on a snippet with each one).
"""

from __future__ import annotations

import ast
import ipaddress
import os
import subprocess
from pathlib import Path

import httpx
import pytest

from tests.cluster_harness import ServeProcess
from tests.model_factory import tiny_model_dir

ROOT = Path(__file__).resolve().parents[1]
PRODUCT_PACKAGES = [
    "protocol",
    "engine",
    "kernels",
    "kvtransfer",
    "gateway",
    "prefill_node",
    "decode_node",
    "worker",
    "configs",
    "cluster",
    "benchmarks",
]
KEYS = ["sk-security-one", "sk-security-two"]
MODEL = str(tiny_model_dir("llama"))
OPEN_ROUTES = ["/metrics", "/health", "/ready", "/version", "/openapi.json"]
BODIES = {
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/responses": {"model": MODEL, "input": "hi", "max_output_tokens": 1},
    "/v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
    "/v1/messages/count_tokens": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [5, 6]},
    "/v1/load_lora_adapter": {"lora_name": "a", "lora_path": "/nonexistent"},
    "/v1/unload_lora_adapter": {"lora_name": "a"},
}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    serve = ServeProcess(
        tiny_model_dir("llama"),
        tmp_path_factory.mktemp("cluster"),
        engine={"block_size": 16, "kv_cache_memory_mb": 8},
        gateway={"api_keys": KEYS},
    )
    yield serve
    assert serve.stop() == 0, "".join(serve.log[-30:])


def protected_routes(cluster) -> list[tuple[str, str]]:
    """(method, path) of every route the gateway documents, except the open ones."""
    paths = httpx.get(cluster.url + "/openapi.json").json()["paths"]
    routes = [(method.upper(), path) for path, ops in paths.items() for method in ops if path not in OPEN_ROUTES]
    assert {p for _, p in routes} >= {
        "/v1/completions",
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/models",
        "/v1/workers",
        "/tokenize",
        "/detokenize",
    }
    assert all(p.startswith("/v1/") or p in ("/tokenize", "/detokenize") for _, p in routes), routes
    return routes


def call(cluster, method: str, path: str, headers: dict, response_id: str = "resp_none") -> httpx.Response:
    url = cluster.url + path.replace("{response_id}", response_id)  # the routes of a stored response
    return httpx.request(method, url, json=BODIES.get(path), headers=headers, timeout=60)


def test_every_protected_route_needs_a_key(cluster):
    for method, path in protected_routes(cluster):
        anthropic = path.startswith("/v1/messages")  # Anthropic's clients send the key in x-api-key
        for headers in (
            {},
            {"Authorization": "Bearer sk-wrong"},
            {"Authorization": KEYS[0]},  # no scheme
            {"Authorization": f"Bearer {KEYS[0]}x"},
            {"Authorization": f"Bearer {KEYS[0][:-1]}"},
            {"x-api-key": "sk-wrong" if anthropic else KEYS[0]},
            {"Authorization": "Basic " + KEYS[0]},
        ):
            response = call(cluster, method, path, headers)
            assert response.status_code == 401, (method, path, headers, response.text)
            assert response.json()["error"]["type"] == "authentication_error"  # Anthropic's JSON has it there too
            assert KEYS[0] not in response.text  # the key is never echoed
        for key in KEYS:  # each configured key works
            auth = {"x-api-key": key} if anthropic else {"Authorization": f"Bearer {key}"}
            stored = call(cluster, "POST", "/v1/responses", auth).json()["id"] if "{response_id}" in path else ""
            response = call(cluster, method, path, auth, stored)
            if path.endswith("/cancel"):  # past the key: only background responses can be cancelled
                assert response.status_code == 400 and "Only background" in response.json()["error"]["message"]
            elif path.endswith("load_lora_adapter"):  # past the key: runtime LoRA changes need an admin key
                assert response.status_code == 403, response.text
                assert "runtime LoRA adapter changes are off" in response.json()["error"]["message"]
            else:
                assert response.status_code == 200, (method, path, response.text)


def test_health_metrics_and_docs_stay_open(cluster):
    for path in OPEN_ROUTES:
        assert httpx.get(cluster.url + path).status_code == 200, path
    assert "pdserve:" in httpx.get(cluster.url + "/metrics").text


# ---- listening sockets ----------------------------------------------------------------------------


def descendants(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def listening_sockets() -> dict[str, str]:
    """inode -> "address:port" of every TCP socket in LISTEN state (0A) in this network namespace."""
    result = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A":
                continue
            hex_addr, hex_port = local.split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints the address as 32-bit words in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            result[inode] = f"{ipaddress.ip_address(raw)}:{int(hex_port, 16)}"
    return result


def test_parse_of_proc_net_tcp_matches_a_known_socket():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        inode = str(os.fstat(s.fileno()).st_ino)
        assert listening_sockets()[inode] == f"127.0.0.1:{s.getsockname()[1]}"


def test_cluster_listens_only_on_loopback(cluster):
    pids = descendants(cluster.proc.pid)
    assert len(pids) >= 4  # pdserve serve, gateway, prefill, decode
    listening = listening_sockets()
    ours = {inode: listening[inode] for pid in pids for inode in socket_inodes(pid) if inode in listening}
    # gateway HTTP + worker ROUTER, prefill job ROUTER + HTTP, decode KV receiver + HTTP at least
    assert len(ours) >= 6, ours
    assert f"127.0.0.1:{cluster.port}" in ours.values(), ours  # the gateway's HTTP port is among them
    for address in ours.values():
        host = address.rsplit(":", 1)[0]
        assert ipaddress.ip_address(host).is_loopback, f"the cluster listens on {address}"


# ---- no pickle on any socket ----------------------------------------------------------------------

UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "marshal", "dill", "cloudpickle", "shelve", "joblib"}
UNSAFE_METHODS = {"recv_pyobj", "send_pyobj", "recv_serialized", "unsafe_load", "full_load"}


def unsafe_calls(source: str, filename: str = "<source>") -> list[str]:
    """Every use of a deserializer that can run code, as "file:line what"."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [f"{where} import {a.name}" for a in node.names if a.name.split(".")[0] in UNSAFE_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in UNSAFE_MODULES:
            found.append(f"{where} from {node.module} import")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, owner = node.func.attr, node.func.value
            keywords = {k.arg: k.value for k in node.keywords}
            if name in UNSAFE_METHODS:
                found.append(f"{where} .{name}()")
            elif name == "load" and isinstance(owner, ast.Name) and owner.id == "torch":
                weights_only = keywords.get("weights_only")
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"{where} torch.load without weights_only=True")
            elif name == "load" and isinstance(owner, ast.Name) and owner.id == "yaml" and "Loader" not in keywords:
                found.append(f"{where} yaml.load")
            elif isinstance(keywords.get("allow_pickle"), ast.Constant) and keywords["allow_pickle"].value is True:
                found.append(f"{where} allow_pickle=True")
    return found


def test_scanner_finds_each_unsafe_deserializer():
    snippet = "\n".join(
        [
            "import pickle",
            "import marshal as m",
            "from dill import loads",
            "import cloudpickle",
            "sock.recv_pyobj()",
            "sock.send_pyobj(x)",
            "torch.load(f)",
            "torch.load(f, weights_only=False)",
            "numpy.load(f, allow_pickle=True)",
            "yaml.load(text)",
            "yaml.unsafe_load(text)",
            "torch.load(f, weights_only=True)",
            "yaml.safe_load(text)",
            "msgpack.unpackb(b)",  # these three are fine
        ]
    )
    assert [f.split(" ", 1)[0] for f in unsafe_calls(snippet)] == [f"<source>:{i}" for i in range(1, 12)]


def test_no_unpickling_anywhere_in_the_product():
    files = [p for pkg in PRODUCT_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 50 and any(p.name == "codec.py" for p in files)
    found = [f for p in files for f in unsafe_calls(p.read_text(), str(p.relative_to(ROOT)))]
    assert found == []
