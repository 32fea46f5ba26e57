"""One process-wide lock around launches of multi-device programs.

The trainer and the engine's prefill and generate threads all launch jitted programs over the same
local devices. A program with collectives is enqueued device by device; when two threads launch at
once, device 0 may get program A before B while device 1 gets B before A, and the collectives of
the two programs then wait on each other forever (the NCCL-style launch-order hang on GPUs; the same
hazard applies to TPU collectives). Taking one lock for each launch makes every device see the
programs in the same order. It covers the launch only: the call returns once the program is queued
(asynchronous dispatch), so the program still overlaps with the other threads' work.

Modes, from ``TMAX_SERIAL_LAUNCH`` or :func:`set_mode`:

* ``auto`` (default): serialise when the backend is not the CPU and this process has more than one
  device. On CPU, tmax-jax turns asynchronous dispatch off, so a lock there would serialise the whole
  computation rather than the launch, and CPU collectives do not have the hazard.
* ``on``: always (tests force it on CPU to check what it covers).
* ``off``: never.

The first call of a jitted function compiles it while holding the lock; other threads' launches wait
for that compile (once per shape).

The lock is the process's one launch queue: a multi-device program is made with :func:`jit` (or
called inside :func:`serial_launch`, e.g. a reshard), never launched beside it. ``tests/test_launch.py``
instruments ``jax.jit`` / ``jax.device_put`` and fails on any multi-device launch of the engine, the
train step or a reshard made while this thread does not hold the queue (:func:`held`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from tmax_jax.errors import ConfigError

MODES = ("auto", "on", "off")
ENV_VAR = "TMAX_SERIAL_LAUNCH"

_lock = threading.RLock()
_state_lock = threading.Lock()
_mode: str | None = None  # None: read ENV_VAR on first use
_auto: bool | None = None
_launches = 0
_wait_s = 0.0
_holding = threading.local()  # this thread's serial_launch() depth

F = TypeVar("F", bound=Callable[..., Any])


def _check(mode: str, where: str) -> str:
    m = str(mode).strip().lower()
    if m not in MODES:
        raise ConfigError(f"{where}: serial launch mode must be one of {', '.join(MODES)}, got {mode!r}")
    return m


def set_mode(mode: str) -> None:
    """Set the mode for this process (``auto``, ``on`` or ``off``); overrides ``TMAX_SERIAL_LAUNCH``."""
    global _mode
    _mode = _check(mode, "set_mode")


def mode() -> str:
    global _mode
    if _mode is None:
        _mode = _check(os.environ.get(ENV_VAR, "auto"), ENV_VAR)
    return _mode


def active() -> bool:
    """Whether launches are serialised now."""
    global _auto
    m = mode()
    if m != "auto":
        return m == "on"
    if _auto is None:
        import jax

        _auto = jax.default_backend() != "cpu" and jax.local_device_count() > 1
    return _auto


@contextlib.contextmanager
def serial_launch() -> Iterator[None]:
    """Hold the launch lock (re-entrant) for the body when serialisation is active."""
    global _launches, _wait_s
    if not active():
        yield
        return
    t0 = time.perf_counter()
    with _lock:
        waited = time.perf_counter() - t0
        with _state_lock:
            _launches += 1
            _wait_s += waited
        _holding.depth = getattr(_holding, "depth", 0) + 1
        try:
            yield
        finally:
            _holding.depth -= 1


def held() -> bool:
    """Whether this thread holds the launch queue now (always False while serialisation is off)."""
    return getattr(_holding, "depth", 0) > 0


def serialized(fn: F) -> F:
    """``fn`` (e.g. a ``jax.jit`` function) called under :func:`serial_launch`."""

    @functools.wraps(fn)
    def call(*args, **kwargs):
        with serial_launch():
            return fn(*args, **kwargs)

    return call  # type: ignore[return-value]


def jit(fn: Callable[..., Any], **jit_kwargs: Any) -> Callable[..., Any]:
    """``jax.jit(fn, **jit_kwargs)`` whose every call launches through the queue. Its ``lower`` and
    ``trace`` are the jitted function's own (nothing launches): an ahead-of-time compile
    (``tmax-jax plan --compile``) lowers the very program the calls run."""
    import jax

    jitted = jax.jit(fn, **jit_kwargs)
    call = serialized(jitted)
    call.lower = jitted.lower
    call.trace = jitted.trace
    return call


def stats(reset: bool = False) -> dict[str, float]:
    """Serialised launches and seconds spent waiting for the lock, since the last reset."""
    global _launches, _wait_s
    with _state_lock:
        out = {"launches": float(_launches), "launch_wait_s": _wait_s}
        if reset:
            _launches, _wait_s = 0, 0.0
    return out
