"""SIGINT / SIGTERM during a run: stop at a safe point (and, with several processes, all together)."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading

from tmax_jax.distributed import any_process


class Interrupts:
    """SIGINT and SIGTERM as KeyboardInterrupt in the main thread, at once, except inside
    ``deferred()`` blocks, whose end raises it instead (a train step must not be cut between the
    update of its donated state and the bookkeeping of that update). Several processes hold the
    whole RL loop in one ``deferred()`` block and stop at ``step_boundary()`` together."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, *, collective: bool = False, log=None):
        self.collective = collective  # several JAX processes: they decide to stop together
        self.pending = False
        self._depth = 0
        self._previous: dict = {}
        self._log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))

    def install(self) -> None:
        # Python lets only the main thread set handlers; elsewhere (a run in a thread) keep the defaults.
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}

    def _handle(self, signum, frame) -> None:
        if self._depth:
            if not self.pending:
                self._log(f"{signal.Signals(signum).name}: stopping after the current step")
            self.pending = True
            return
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def deferred(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if self.pending and not self._depth:
            raise KeyboardInterrupt

    def step_boundary(self) -> None:
        """Raise KeyboardInterrupt when a signal is pending here or, in collective mode, on any
        process (a collective: every process calls it once per step)."""
        if any_process(self.pending) if self.collective else self.pending:
            self.pending = True
            raise KeyboardInterrupt
