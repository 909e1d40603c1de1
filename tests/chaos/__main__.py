"""python -m tests.chaos [--runs N] [--scenarios PATTERN ...] [--hostile PATTERN ...] [--report docs/reliability.md]

Runs the chaos scenarios (fault x target x phase, tests/chaos/scenario.py) and the hostile-peer attacks
under load (tests/chaos/hostile.py), and regenerates the report. A scenario pattern matches
``fault:target:phase`` with shell wildcards, e.g. ``sigkill:*:*`` or ``*:gateway:decoding``; a hostile
pattern matches an attack's name, e.g. ``'forged*'``; ``--scenarios none`` or ``--hostile none`` runs none
of that kind, and the report keeps that section from its last run. Exits 1 when any run failed a check.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import tempfile
import time
from pathlib import Path

from tests.chaos.clusters import BLOCK, NetnsCluster, NoNamespaces, ServeCluster
from tests.chaos.hostile import ATTACKS, HostileCluster, HostileResult, run_attack, warm_up
from tests.chaos.hostile_roles import RESTARTS, ROLE_ATTACKS, RoleCluster
from tests.chaos.hostile_store import STORE_ATTACKS, StoreCluster
from tests.chaos.load import Prompt, make_prompts
from tests.chaos.report import write_report
from tests.chaos.scenario import RunResult, Scenario, matrix, run_once
from tests.model_factory import tiny_model_dir

PROMPTS = 256
PROMPTS_PER_RUN = 48  # each run starts elsewhere in the pool: mostly fresh prompts, few prefix hits


def select(patterns: list[str]) -> list[Scenario]:
    return [s for s in matrix() if any(fnmatch.fnmatch(f"{s.fault}:{s.target}:{s.phase}", p) for p in patterns)]


def select_attacks(patterns: list[str]) -> list[str]:
    return [a for a in [*ATTACKS, *ROLE_ATTACKS, *STORE_ATTACKS] if any(fnmatch.fnmatch(a, p) for p in patterns)]


def run_hostile(names: list[str], prompts: list[Prompt], log=print) -> list[HostileResult]:
    """Every attack once: the key holders' on a cluster with one cluster key, the compromised members' on a
    cluster with a credential per member, the Responses store's on a cluster with a Redis store."""
    results = _run_on(HostileCluster, [n for n in names if n in ATTACKS], ATTACKS, prompts, log)
    results += _run_on(RoleCluster, [n for n in names if n in ROLE_ATTACKS], ROLE_ATTACKS, prompts, log)
    return results + _run_on(StoreCluster, [n for n in names if n in STORE_ATTACKS], STORE_ATTACKS, prompts, log)


def _run_on(make_cluster, names: list[str], table: dict, prompts: list[Prompt], log) -> list[HostileResult]:
    results: list[HostileResult] = []
    if not names:
        return results
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        cluster = make_cluster(str(tiny_model_dir("llama")), Path(tmp))
        failed = True
        try:
            warm_up(cluster, prompts)
            for offset, name in enumerate(names):
                start = offset * PROMPTS_PER_RUN % len(prompts)
                restarts = frozenset(RESTARTS.get(name, ()))
                result = run_attack(cluster, name, prompts[start:] + prompts[:start], table, restarts)
                results.append(result)
                log(
                    f"chaos: {name:<36} sent {result.sent} refused {dict(result.refused)} "
                    f"requests {dict(result.outcomes)} leaked {result.leaked_blocks} fds +{result.fd_growth} "
                    + ("pass" if not result.failures else f"FAIL {result.failures}")
                )
            failed = any(r.failures for r in results)
        finally:
            cluster.close(keep_logs=failed)
    return results


def run_all(
    scenarios: list[Scenario], runs: int, prompts: list[Prompt] | None = None, log=print
) -> tuple[list[RunResult], dict[Scenario, str]]:
    """Every run of every scenario, each fault family on its own cluster; scenarios that cannot run
    here map to the reason."""
    model = str(tiny_model_dir("llama"))
    prompts = prompts or make_prompts(model, BLOCK, PROMPTS)
    results: list[RunResult] = []
    not_run: dict[Scenario, str] = {}
    for kind in (ServeCluster, NetnsCluster):
        mine = [s for s in scenarios if s.fault in kind.faults]
        if not mine:
            continue
        with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:  # the serve cluster's config
            try:
                cluster = ServeCluster(model, Path(tmp)) if kind is ServeCluster else NetnsCluster(model)
            except NoNamespaces as exc:  # no namespaces here: say so instead of faking the scenario
                not_run.update({s: str(exc) for s in mine})
                continue
            failed = True  # an exception keeps the logs too
            try:
                failed = _run_scenarios(cluster, mine, runs, prompts, results, log)
            finally:
                cluster.close(keep_logs=failed)
    return results, not_run


def _run_scenarios(
    cluster, scenarios: list[Scenario], runs: int, prompts: list[Prompt], results: list[RunResult], log
) -> bool:
    """Each scenario ``runs`` times on ``cluster``, appended to ``results``; whether any run failed."""
    failed = False
    for scenario in scenarios:
        for run in range(runs):
            offset = len(results) * PROMPTS_PER_RUN % len(prompts)
            result = run_once(cluster, scenario, prompts[offset:] + prompts[:offset], run)
            results.append(result)
            recover = f"{result.recover_s:.1f} s" if result.recover_s is not None else "—"
            log(
                f"chaos: {scenario.name:<32} {result.member:<10} {dict(result.outcomes)} recover {recover} "
                f"leaked {result.leaked_blocks} " + ("pass" if not result.failures else f"FAIL {result.failures}")
            )
            if result.failures:
                failed = True
                log(cluster.logs())
    return failed


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1, help="runs per scenario (alternating the pool's workers)")
    parser.add_argument("--scenarios", nargs="+", default=["*"], help="fault:target:phase patterns")
    parser.add_argument("--hostile", nargs="+", default=["*"], help="hostile attack name patterns")
    parser.add_argument("--report", type=Path, default=Path("docs/reliability.md"))
    args = parser.parse_args(argv)
    scenarios, names = select(args.scenarios), select_attacks(args.hostile)
    if not scenarios and not names:
        parser.error(f"no scenario matches {args.scenarios} and no attack {args.hostile}")
    started = time.monotonic()
    prompts = make_prompts(str(tiny_model_dir("llama")), BLOCK, PROMPTS)
    results, not_run = run_all(scenarios, args.runs, prompts) if scenarios else ([], {})
    hostile = run_hostile(names, prompts) if names else None
    command = "python -m tests.chaos " + " ".join(argv)
    write_report(args.report, command.strip(), scenarios, results, not_run, time.monotonic() - started, hostile)
    print(f"chaos: report written to {args.report}")
    return 1 if any(r.failures for r in [*results, *(hostile or [])]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
