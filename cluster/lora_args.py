"""vLLM's LoRA flags (``--enable-lora --lora-modules name=path ... --max-loras --max-lora-rank
--max-cpu-loras``), shared by ``pdserve serve`` and the role commands; they set the config's ``lora``
section (configs/schema.py LoRAConfig)."""

from __future__ import annotations

import argparse


def add_lora_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters (lora.enable_lora)")
    p.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                   help="adapters served from the start, PEFT directories (lora.lora_modules)")
    p.add_argument("--max-loras", type=int, help="adapters in a worker's device slots at once (lora.max_loras)")
    p.add_argument("--max-lora-rank", type=int, help="highest adapter rank accepted (lora.max_lora_rank)")
    p.add_argument("--max-cpu-loras", type=int, help="adapters kept in a worker's host memory (lora.max_cpu_loras)")


def lora_settings(args: argparse.Namespace) -> dict[str, str]:
    """The flags given, as {"lora.field": value} in the config loader's string form."""
    given = {"enable_lora": "true" if args.enable_lora else None,
             "lora_modules": ",".join(args.lora_modules) if args.lora_modules else None,
             "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank, "max_cpu_loras": args.max_cpu_loras}
    return {f"lora.{name}": str(value) for name, value in given.items() if value is not None}
