"""The layering table, checked: which of the project's packages each package may import, read from every
module's imports (``ast``: also the ones inside functions), the gateway torch-free when imported, and no
import circles between any two modules.

``MAY_IMPORT`` is the one copy of the table; docs/architecture.md quotes it.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import gateway

ROOT = Path(__file__).resolve().parents[1]

# package -> the project's packages it may import besides itself. Third-party libraries are free, except
# those NEVER_IMPORTS names. Read top to bottom: nothing imports a package below it in the stack
# protocol/configs/kernels -> kvtransfer/engine -> worker -> roles -> cluster (the launcher) -> benchmarks.
MAY_IMPORT = {
    "protocol": set(),  # torch-free vocabulary of every process: messages, codec, ZeroMQ helpers
    "configs": set(),  # the typed config schema
    "telemetry": {"configs"},  # logs and traces every process shares (torch-free); ConfigError
    "kernels": set(),  # kernels and their torch references
    "kvtransfer": {"kernels", "protocol"},  # declares the pool it moves (kvtransfer/pool.py), never the engine
    "engine": {"kernels", "protocol", "configs", "telemetry"},  # knows nothing of KV transfer
    "worker": {
        "protocol",
        "configs",
        "telemetry",
    },  # what both worker roles share: the gateway socket, heartbeats, identity
    "prefill_node": {"engine", "kernels", "kvtransfer", "protocol", "configs", "worker", "telemetry"},
    "decode_node": {"engine", "kernels", "kvtransfer", "protocol", "configs", "worker", "telemetry"},
    "gateway": {"protocol", "configs", "telemetry"},
    # the launcher: starts the roles as processes; imports the engine for `pdserve generate` and the
    # gateway's chat-parser flags for `pdserve serve`
    "cluster": {"configs", "protocol", "engine", "gateway", "telemetry"},
    "benchmarks": {
        "protocol",
        "configs",
        "kernels",
        "kvtransfer",
        "engine",
        "worker",
        "prefill_node",
        "decode_node",
        "gateway",
        "cluster",
        "telemetry",
    },  # anything
}
NEVER_IMPORTS = {
    "protocol": {"torch", "transformers", "triton"},
    "configs": {"torch", "transformers", "triton"},
    "gateway": {"torch", "transformers", "triton"},  # the front door runs where there is no GPU stack
    "worker": {"torch", "transformers", "triton"},
    "telemetry": {"torch", "transformers", "triton"},
}
# Inside the gateway: the worker side (registry, router, backend) knows nothing of HTTP or the API
# dialects, and text handling nothing of the dialects, the pipeline or the workers.
GATEWAY_MAY_IMPORT = {
    "workers": {"deadline", "metrics"},
    "text": {"http"},  # errors and typed field reads of the request's tools
}
# The one import against the table: configs/model_source.py writes the embedded default model on first use
# with cluster/make_model.py (torch and transformers), imported inside that function only, so no role
# loads the launcher or torch unless its cache lacks the model.
KNOWN_EXCEPTIONS = {("configs", "cluster")}


def imports_of(path: Path, with_names: bool = False) -> set[str]:
    """Every module ``path`` imports, absolute (relative imports resolved), at any depth of the file;
    ``with_names`` adds ``module.name`` for each ``from module import name`` (it may be a submodule)."""
    package = path.relative_to(ROOT).parent.parts  # what a relative import of level 1 starts from
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                module = node.module
            else:
                base = package[: len(package) - node.level + 1]
                module = ".".join(base + ((node.module,) if node.module else ()))
            found.add(module)
            if with_names:
                found |= {f"{module}.{alias.name}" for alias in node.names}
    return found


def modules_of(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_the_table_names_every_package_in_the_project():
    packaged = {p.parent.name for p in ROOT.glob("*/__init__.py")} - {"tests"}
    assert packaged == set(MAY_IMPORT)


def test_packages_import_only_what_the_table_allows():
    broken = []
    for package, allowed in MAY_IMPORT.items():
        for path in modules_of(package):
            for name in imports_of(path):
                top = name.split(".")[0]
                if (
                    top in MAY_IMPORT
                    and top != package
                    and top not in allowed
                    and (package, top) not in KNOWN_EXCEPTIONS
                ):
                    broken.append(f"{path.relative_to(ROOT)} imports {name}")
                if top in NEVER_IMPORTS.get(package, ()):
                    broken.append(f"{path.relative_to(ROOT)} imports {name}")
    assert broken == []


def test_the_known_exceptions_are_still_needed():
    """An exception nobody needs any more goes from the table (the TODO is done)."""
    used = {
        (package, name.split(".")[0])
        for package in MAY_IMPORT
        for path in modules_of(package)
        for name in imports_of(path)
    }
    assert used >= KNOWN_EXCEPTIONS


def test_gateway_rooms_import_only_what_the_table_allows():
    broken = []
    for room, allowed in GATEWAY_MAY_IMPORT.items():
        for path in modules_of(f"gateway/{room}"):
            for name in imports_of(path):
                parts = name.split(".")
                if parts[0] == "gateway" and len(parts) > 1 and parts[1] not in {room, *allowed}:
                    broken.append(f"{path.relative_to(ROOT)} imports {name}")
    assert broken == []


def test_importing_every_gateway_module_leaves_torch_out():
    """At run time too: no module of the gateway pulls torch in through a third party."""
    modules = sorted(m.name for m in pkgutil.walk_packages(gateway.__path__, "gateway."))
    assert {"gateway.http.app", "gateway.workers.router", "gateway.workers.registry", "gateway.text.tokenizer"} <= set(
        modules
    )
    code = (
        f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(n for n in sys.modules if n == 'torch' or n.startswith('torch.') or n == 'transformers')\n"
        "print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_graph() -> dict[str, set[str]]:
    """Each of the project's modules -> the project's modules it imports (at any depth of the file). A
    ``from package import name`` counts the submodule ``name`` where there is one, else the package."""
    modules = {module_name(path): path for package in MAY_IMPORT for path in modules_of(package)}
    graph = {}
    for name, path in modules.items():
        found = set()
        for imported in imports_of(path, with_names=True):
            while imported and imported not in modules:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                found.add(imported)
        graph[name] = found
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, cycles = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_the_cycle_finder_finds_a_circle_and_only_it():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]


def test_no_module_imports_itself_through_others():
    """No import circles anywhere, between packages or inside one (imports inside functions count too)."""
    assert import_cycles(module_graph()) == []
