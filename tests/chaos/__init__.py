"""Chaos tool: faults (SIGKILL, SIGSTOP/SIGCONT, link-down) hit a prefill worker, a decode worker or the
gateway of a loaded 2 + 2 cluster at each phase of a request; every run checks that no request hangs
or comes back corrupted, nothing leaks, and the cluster recovers. ``python -m tests.chaos``; the CI
subset is tests/test_chaos.py; the report is docs/reliability.md."""
