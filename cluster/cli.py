"""The ``pdserve`` command. Each subcommand lives in the package that owns it; heavy ones
(anything that imports torch) are imported only when chosen, so ``pdserve --help`` stays fast."""

from __future__ import annotations

import importlib
import sys

# subcommand -> ("module" with a main(argv) function, or "module:function"; one-line help)
SUBCOMMANDS = {
    "make-model": ("cluster.make_model", "write a random-weight Hugging Face checkpoint (demo/test model)"),
    "generate": ("cluster.generate", "offline generation in one process"),
    "serve": ("cluster.serve", "a whole local cluster: gateway + prefill + decode workers"),
    "gateway": ("cluster.roles:gateway_main", "run the gateway alone (containers, Kubernetes)"),
    "prefill": ("cluster.roles:prefill_main", "run one prefill worker (containers, Kubernetes)"),
    "decode": ("cluster.roles:decode_main", "run one decode worker (containers, Kubernetes)"),
    "keygen": ("cluster.keygen", "print a new cluster key (transfer.cluster_key_file) for the worker plane"),
    "status": ("cluster.status", "the workers registered with a gateway and their load"),
}


def usage() -> str:
    lines = ["usage: pdserve <command> [options]", "", "commands:"]
    lines += [f"  {name:<12} {text}" for name, (_, text) in SUBCOMMANDS.items()]
    lines += ["", "Run 'pdserve <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"pdserve: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module_name, _, function = SUBCOMMANDS[name][0].partition(":")
    entry = getattr(importlib.import_module(module_name), function or "main")
    return entry(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
