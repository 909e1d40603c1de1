"""How many CPU threads a decode step takes when a prefill worker shares this worker's cores.

``pdserve serve`` on one machine gives each worker its share of the cores (cores // workers threads).
With one prefill worker and one decode worker, the prefill worker only works on this worker's prompts:
while none is out there (no request awaiting its KV), the prefill worker's cores idle. A step then
takes them as well (``decode.idle_prefill_threads``) and gives them back from the first step that sends
a prompt out, so the two never run more threads than there are cores for longer than the step in
which a prompt arrives: the engine's threads run in lockstep, and one that shares its core with the
prefill worker stalls them all (docs/performance.md).

The C kernels' values do not depend on the thread count: each output is one sum in one order whichever
thread computes it (kernels/cpu/linear.c), and decode attention splits by sequence and KV head. Torch's
own reductions (the sampler's log-softmax) may differ in the last bit, as between any two thread counts.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StepThreads:
    def __init__(self, borrowed: int) -> None:
        self.own = torch.get_num_threads()
        self.borrowed = borrowed

    def set_for_step(self, prompts_out: Callable[[], bool]) -> None:
        """Set torch's (and so the C kernels') thread count for the next step. ``prompts_out`` is asked
        only where there are threads to borrow: most workers have none, and it scans the requests."""
        if not self.borrowed:
            return
        threads = self.own if prompts_out() else self.own + self.borrowed
        if threads != torch.get_num_threads():
            torch.set_num_threads(threads)
