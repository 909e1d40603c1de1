"""``pdserve status [--url URL] [--api-key KEY]``: the workers registered with a gateway and their load,
one line each, from the gateway's ``GET /v1/workers`` (the same view its router works from)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request

COLUMNS = ("ID", "ROLE", "ADDRESS", "STATE", "RUNNING", "WAITING", "QUEUED_TOKENS", "KV_USED", "KV_TOTAL", "KV_USAGE")


def fetch_workers(url: str, api_key: str | None = None, timeout_s: float = 5.0) -> list[dict]:
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/workers")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())["data"]


def state_of(worker: dict) -> str:
    """stuck (in one step past the gateway's step timeout: out of rotation), draining, or serving."""
    return "stuck" if worker["stuck"] else "draining" if worker["draining"] else "serving"


def rows_of(workers: list[dict]) -> list[tuple[str, ...]]:
    """One row per worker, prefill pool first, then decode, by id within a pool."""
    rows = []
    for w in sorted(workers, key=lambda w: (w["role"] != "prefill", w["id"])):
        load = w["load"]
        total = load["kv_blocks_total"]
        usage = f"{100.0 * load['kv_blocks_in_use'] / total:.1f}%" if total else "-"
        rows.append(
            (
                w["id"],
                w["role"],
                w["address"],
                state_of(w),
                str(load["num_running"]),
                str(load["num_waiting"]),
                str(load["queued_prefill_tokens"]),
                str(load["kv_blocks_in_use"]),
                str(total),
                usage,
            )
        )
    return rows


def format_table(workers: list[dict]) -> str:
    rows = [COLUMNS] + rows_of(workers)
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    pools = {role: sum(w["role"] == role for w in workers) for role in ("prefill", "decode")}
    lines.append(f"{pools['prefill']} prefill, {pools['decode']} decode worker(s)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="pdserve status", description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway (default http://127.0.0.1:8000)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY"),
        help="bearer key when the gateway asks for one (default: $PDSERVE_API_KEY)",
    )
    args = p.parse_args(argv)
    try:
        workers = fetch_workers(args.url, args.api_key)
    except urllib.error.HTTPError as exc:
        print(
            f"pdserve status: {args.url}/v1/workers answered {exc.code}: {exc.read()[:300].decode(errors='replace')}",
            file=sys.stderr,
        )
        return 1
    except (urllib.error.URLError, OSError) as exc:
        print(f"pdserve status: cannot reach {args.url}: {getattr(exc, 'reason', exc)}", file=sys.stderr)
        return 1
    print(format_table(workers))
    return 0
