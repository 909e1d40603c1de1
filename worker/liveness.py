"""A worker's liveness, reported apart from how long its steps take.

The loop used to send its heartbeats between steps, so one long step (a big prefill on a loaded machine,
a first compile, a swap) silenced a live worker past ``gateway.worker_timeout_s``: the gateway dropped it
and failed every request it held (7 of 8 requests of a served run on 2 loaded cores, one step of 18 s).
Now the loop still builds and sends its heartbeats (fresh load figures, at once on a drain or a LoRA
change), and a thread of its own sends the last one again whenever the loop has sent none for an
interval: the process is alive as long as that thread runs. The C kernels (ctypes) and torch ops release
the GIL, and pure Python yields it every few milliseconds, so the thread runs during any step
(tests/test_worker_liveness.py checks it against a long C prefill step).

Every heartbeat says how far the loop has got: the turns it has completed and how long the turn under way
has run. The gateway keeps dropping a silent worker (its process, host or network is gone) and tells a
busy worker (heartbeats, a step that ends) from a wedged one (heartbeats, a step that never ends: past
``gateway.worker_step_timeout_s`` it is taken out of rotation; gateway/workers/registry.py). The worker
knows that deadline too: when its own step passes it, the thread logs it and writes every thread's stack
(faulthandler), once per step, so the log says where the loop is stuck (what vLLM's watchdog proposal
and ``py-spy dump`` give an operator), without anyone attaching to the process.

Sockets: the thread sends on the loop's own DEALERs (the gateway knows a worker by one connection per
gateway), which ``GatewayLinks`` serializes with its lock: a ZeroMQ socket is used by one thread at a time.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from protocol.serving import Goodbye, Heartbeat
from worker.gateway_links import GatewayLinks

log = logging.getLogger(__name__)


class StepWatch:
    """How far the worker's loop has got, as another thread reads it: turns completed, and since when the
    one under way has run. The loop writes, the heartbeat thread reads; each is a single attribute."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.steps_completed = 0
        self._started_at: float | None = None

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around one turn of the loop; a turn that raised has ended too."""
        self._started_at = self._clock()
        try:
            yield
        finally:
            self.steps_completed += 1
            self._started_at = None

    def running_s(self) -> float:
        started = self._started_at  # read once: the loop may end the turn meanwhile
        return max(self._clock() - started, 0.0) if started is not None else 0.0


class Liveness:
    """The worker's heartbeats to every gateway: the loop's, stamped with its progress, and the same again
    from a thread of their own while the loop is late (``start`` to ``stop``)."""

    def __init__(
        self,
        links: GatewayLinks,
        interval_s: float,
        watch: StepWatch,
        *,
        stuck_after_s: float = 0.0,
        stacks_to: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``stuck_after_s``: a step running longer is reported with every thread's stack, once
        (``gateway.worker_step_timeout_s``; 0: never), to ``stacks_to`` (a real file; stderr by default)."""
        assert interval_s > 0 and stuck_after_s >= 0, (interval_s, stuck_after_s)
        self._links, self._interval_s, self.watch, self._clock = links, interval_s, watch, clock
        self._stuck_after_s, self._stacks_to = stuck_after_s, stacks_to
        self._latest: Heartbeat | None = None  # the loop's newest: the thread repeats it
        self._sent_at = float("-inf")
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.num_sent_by_thread = 0
        self._reported_step = -1  # steps_completed when the step under way was reported stuck

    def send(self, record: Heartbeat) -> None:
        """From the loop: ``record`` to every gateway, and the one the thread repeats from now on."""
        self._latest = record
        self._broadcast(record)

    def _broadcast(self, record: Heartbeat) -> None:
        stamped = dataclasses.replace(
            record, steps_completed=self.watch.steps_completed, step_running_s=self.watch.running_s()
        )
        self._links.broadcast(stamped)
        self._sent_at = self._clock()

    def start(self, first: Heartbeat) -> None:
        """Sends ``first`` (the registration) and starts the thread, which has it to repeat from then on,
        even if the loop's first turn is a long step."""
        self.send(first)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="heartbeats", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # Looks twice an interval, so that a heartbeat is at most half an interval later than the loop's
        # would have been; a send is one short lock on the links.
        while not self._stop.wait(self._interval_s / 2):
            self._report_if_stuck()
            latest = self._latest
            if latest is None or self._clock() - self._sent_at < self._interval_s:
                continue
            try:
                self._broadcast(latest)
                self.num_sent_by_thread += 1
            except Exception:  # never let a send end the thread: the worker would look dead
                log.exception("heartbeat from the liveness thread failed")

    def _report_if_stuck(self) -> None:
        step, running_s = self.watch.steps_completed, self.watch.running_s()
        if not self._stuck_after_s or running_s <= self._stuck_after_s or step == self._reported_step:
            return
        self._reported_step = step
        log.error(
            "one step of this worker's loop has run for %.0f s (gateway.worker_step_timeout_s is %g s): "
            "the gateway takes it out of rotation until the step ends; every thread's stack follows",
            running_s,
            self._stuck_after_s,
        )
        faulthandler.dump_traceback(file=self._stacks_to or sys.stderr, all_threads=True)

    def stop(self) -> None:
        """The thread ends (idempotent): before the links close, and before a Goodbye (a heartbeat after
        it would register the worker again)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def goodbye(self, worker_id: str) -> None:
        """From the loop, at the end of a drain: no more heartbeats, then Goodbye to every gateway."""
        self.stop()
        self._links.broadcast(Goodbye(worker_id))
