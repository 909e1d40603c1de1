"""CPU-seconds and peak RSS of a process tree, read from /proc (Linux; no psutil).

``/proc/<pid>/stat`` gives utime + stime in clock ticks (this process only, all its threads);
``/proc/<pid>/status`` gives VmHWM, the peak resident set. A snapshot is taken before and after a
measured run; CPU is reported as the difference, peak RSS as the high-water mark at the end.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(slots=True, frozen=True)
class ProcSample:
    pid: int
    name: str  # the module it runs ("gateway", "prefill_node", ...) or its executable
    cpu_s: float  # user + system, since the process started
    peak_rss_mb: float


def parse_stat(text: str) -> tuple[int, float]:
    """(ppid, cpu seconds) from the text of /proc/<pid>/stat; the command name may hold spaces and
    parentheses, so fields are counted from the last ')'."""
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): ppid is field 4, utime 14, stime 15 (1-based, proc(5)).
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def parse_vm_hwm_mb(status_text: str) -> float:
    for line in status_text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0  # reported in kB
    return 0.0


def _name(pid: int) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    argv = [a.decode(errors="replace") for a in argv if a]
    is_python = bool(argv) and Path(argv[0]).name.startswith("python")  # llama-server's -m is its model
    if is_python and "-m" in argv and argv.index("-m") + 1 < len(argv):
        module = argv[argv.index("-m") + 1]
        rest = argv[argv.index("-m") + 2 :]
        worker = next(
            (a.split("=", 1)[1] for a in rest if a.startswith(("prefill.worker_id=", "decode.worker_id="))), ""
        )
        return worker or (module + (" " + rest[0] if module == "cluster" and rest else ""))
    return Path(argv[0]).name if argv else str(pid)


def tree_pids(root: int) -> list[int]:
    """``root`` and all its descendants alive now."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid, _ = parse_stat((entry / "stat").read_text())
            except (OSError, ValueError):
                continue  # exited while we looked
            children.setdefault(ppid, []).append(int(entry.name))
    out, stack = [], [root]
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def sample_tree(root: int) -> dict[int, ProcSample]:
    samples = {}
    for pid in tree_pids(root):
        try:
            _, cpu = parse_stat(Path(f"/proc/{pid}/stat").read_text())
            rss = parse_vm_hwm_mb(Path(f"/proc/{pid}/status").read_text())
            samples[pid] = ProcSample(pid, _name(pid), cpu, rss)
        except (OSError, ValueError):
            continue
    return samples


def self_sample(name: str) -> ProcSample:
    pid = os.getpid()
    _, cpu = parse_stat(Path(f"/proc/{pid}/stat").read_text())
    return ProcSample(pid, name, cpu, parse_vm_hwm_mb(Path(f"/proc/{pid}/status").read_text()))


def cpu_delta(before: dict[int, ProcSample], after: dict[int, ProcSample]) -> list[ProcSample]:
    """Per process alive at the end: CPU spent between the snapshots (all of it if it started since)."""
    return [
        ProcSample(pid, s.name, s.cpu_s - (before[pid].cpu_s if pid in before else 0.0), s.peak_rss_mb)
        for pid, s in sorted(after.items())
    ]
