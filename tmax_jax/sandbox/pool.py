"""SandboxPool: N sandboxes in flight, a bounded queue of episodes, metrics and sure cleanup.

    with SandboxPool(SandboxConfig(), size=8) as pool:
        futs = [pool.submit(episode_fn, arg) for arg in args]   # blocks when the queue is full
        # inside episode_fn: ``with pool.sandbox(image) as sb: ...`` takes one of the N slots

Every sandbox is made fresh for one episode and closed after it (start is ~60 ms on bwrap), so no
state leaks between episodes. ``close`` (also on exceptions, SIGINT/SIGTERM, interpreter exit) kills
what is still running; sandboxes left by a dead parent are swept when the next pool starts.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from tmax_jax.errors import SandboxError
from tmax_jax.sandbox import registry
from tmax_jax.sandbox.base import EpisodeTimeout, Sandbox
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.factory import make_sandbox


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


@dataclass
class PoolMetrics:
    start_latency_s: list[float] = field(default_factory=list)
    exec_latency_s: list[float] = field(default_factory=list)
    failures: Counter = field(default_factory=Counter)
    episodes: int = 0
    in_flight_max: int = 0

    def summary(self) -> dict:
        return {
            "episodes": self.episodes,
            "start_p50_s": _pct(self.start_latency_s, 0.5),
            "start_p95_s": _pct(self.start_latency_s, 0.95),
            "exec_p50_s": _pct(self.exec_latency_s, 0.5),
            "exec_p95_s": _pct(self.exec_latency_s, 0.95),
            "exec_mean_s": statistics.fmean(self.exec_latency_s) if self.exec_latency_s else float("nan"),
            "failures": dict(self.failures),
            "in_flight_max": self.in_flight_max,
        }


class SandboxPool:
    """``size`` sandboxes at most alive at once (default: CPU count); ``queue_size`` episodes
    waiting at most (default 2 x size) before ``submit`` blocks (back-pressure)."""

    def __init__(
        self, cfg: SandboxConfig | None = None, size: int | None = None, queue_size: int | None = None
    ):
        self.cfg = cfg or SandboxConfig()
        self.size = size or os.cpu_count() or 1
        if self.size < 1:
            raise SandboxError(f"pool size must be >= 1, got {self.size}")
        self.queue_size = queue_size if queue_size is not None else 2 * self.size
        self._slots = threading.BoundedSemaphore(self.size)
        self._queue = threading.BoundedSemaphore(self.size + self.queue_size)
        self._executor = ThreadPoolExecutor(max_workers=self.size, thread_name_prefix="tmax-sandbox")
        self._lock = threading.Lock()
        self._live: set[Sandbox] = set()
        self._in_flight = 0
        self.metrics = PoolMetrics()
        self.swept = registry.sweep_stale(self.cfg.resolved_run_dir)
        registry.install_handlers()
        self._closed = False

    # ---- sandboxes -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def sandbox(self, image=None, cfg: SandboxConfig | None = None):
        """Take a slot, start a sandbox, yield it, and always close it (recording metrics)."""
        if self._closed:
            raise SandboxError("pool is closed")
        with self._slots:
            try:
                sb = make_sandbox(cfg or self.cfg, image=image)
            except Exception as e:
                self._fail("start_failed" if isinstance(e, SandboxError) else f"start_{type(e).__name__}")
                raise
            with self._lock:
                self._live.add(sb)
                self._in_flight += 1
                self.metrics.in_flight_max = max(self.metrics.in_flight_max, self._in_flight)
                self.metrics.start_latency_s.append(sb.start_latency_s)
            try:
                yield sb
                if not sb.alive():
                    self._fail("sandbox_died")
            except EpisodeTimeout:
                self._fail("episode_timeout")
                raise
            except BaseException as e:
                self._fail("sandbox_died" if not sb.alive() else f"error_{type(e).__name__}")
                raise
            finally:
                sb.close()
                with self._lock:
                    self._live.discard(sb)
                    self._in_flight -= 1
                    self.metrics.exec_latency_s.extend(sb.exec_durations)

    def _fail(self, cause: str) -> None:
        with self._lock:
            self.metrics.failures[cause] += 1

    # ---- episodes --------------------------------------------------------------------------------
    def submit(self, fn, *args, **kwargs) -> Future:
        """Queue ``fn(*args, **kwargs)`` on a worker; blocks while the queue is full."""
        if self._closed:
            raise SandboxError("pool is closed")
        self._queue.acquire()

        def job():
            try:
                return fn(*args, **kwargs)
            finally:
                with self._lock:
                    self.metrics.episodes += 1
                self._queue.release()

        try:
            return self._executor.submit(job)
        except BaseException:
            self._queue.release()
            raise

    def run(self, episode_fn, image=None, cfg: SandboxConfig | None = None) -> Future:
        """Queue ``episode_fn(sandbox)`` on a fresh sandbox."""

        def job():
            with self.sandbox(image=image, cfg=cfg) as sb:
                return episode_fn(sb)

        return self.submit(job)

    def live(self) -> list[Sandbox]:
        with self._lock:
            return list(self._live)

    def close(self, wait: bool = True) -> None:
        """Close every live sandbox (running episodes then fail fast) and stop the workers."""
        self._closed = True
        if not wait:
            for sb in self.live():
                sb.close()
        self._executor.shutdown(wait=wait, cancel_futures=not wait)
        for sb in self.live():
            sb.close()

    def __enter__(self) -> SandboxPool:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        # On an exception (or Ctrl-C) do not wait for queued episodes: kill and clean now.
        self.close(wait=exc_type is None)


def wait_all(futures, timeout: float | None = None):
    """Results of ``futures`` in order (exceptions re-raised), with an overall deadline."""
    deadline = None if timeout is None else time.monotonic() + timeout
    return [f.result(None if deadline is None else max(0.0, deadline - time.monotonic())) for f in futures]
