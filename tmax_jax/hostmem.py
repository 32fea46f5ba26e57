"""How glibc's malloc serves XLA's CPU runtime: keep a program's temporaries mapped between calls.

XLA's CPU client allocates a program's temporaries as one block per execution (936 MiB for the 75M
train step at 8 x 64 tokens, ``benchmarks/bench_train_step.py``) and frees it when the program ends.
glibc serves any block over its mmap threshold (at most 32 MiB) with a fresh ``mmap``, so every step
faults that block in again, 4 KiB at a time, zero-filled by the kernel: 240K page faults, about
0.2 s of a 1.7 s step on this project's 2-core CI machine.

``configure()`` (``reuse``) turns that off for the process:

* ``mallopt(M_MMAP_MAX, 0)``: no block is served by its own ``mmap``; big ones come from the heap;
* ``mallopt(M_TRIM_THRESHOLD, 2 GiB - 1)`` (an ``int``): a freed block's pages stay mapped, and the
  next call reuses them;
* JAX's CPU dispatch made synchronous (``jax_cpu_enable_async_dispatch``): a single-device program
  then runs on the calling thread. Only the main thread allocates from glibc's main heap; every
  other thread has an arena whose heap is capped at 64 MiB, so a bigger block allocated on one of
  XLA's dispatch threads would be ``mmap``-ed whatever the settings say. (One arena for all threads,
  ``M_ARENA_MAX=1``, also works, but its lock slowed the tiny model's step by 30%.)

The cost: the process keeps up to 2 GiB of freed heap (and whatever fragmentation holds) instead of
returning it to the system, and a single-device CPU computation no longer overlaps the Python that
dispatched it. That suits a CPU training or serving process, so ``auto`` applies it only where JAX
can only run on the CPU. It must run before JAX's backend starts (the first ``jax.devices()`` or
array); later it is skipped. The ``tmax-jax`` CLI calls it for every command that runs JAX.

``TMAX_JAX_HOST_MALLOC`` overrides the mode: ``auto`` (default), ``reuse`` (always), ``system``
(leave glibc and JAX as they are).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.metadata
import importlib.util
import os
import sys

from tmax_jax.errors import ConfigError

ENV = "TMAX_JAX_HOST_MALLOC"
MODES = ("auto", "reuse", "system")

# glibc's mallopt parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int

_applied: str | None = None


def _libc():
    """glibc, or None on another C library (musl, macOS), where none of this applies."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.gnu_get_libc_version()
    except (OSError, AttributeError):
        return None
    return libc


def _jax_backend_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # a JAX without the probe: assume the worst
        return True


def cpu_only() -> bool:
    """True when JAX can only run on the CPU here: ``JAX_PLATFORMS`` names cpu alone, or no
    accelerator plugin (CUDA, ROCm, TPU's libtpu) is installed, or libtpu is but this host has no
    TPU chip (libtpu on a CPU host compiles for TPU topologies only: ``tmax-jax plan --compile``).
    Starts no backend."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if platforms:
        return platforms == "cpu"
    try:
        plugins = list(importlib.metadata.entry_points(group="jax_plugins"))
    except Exception:  # a broken metadata entry must not stop a run: assume an accelerator may exist
        return False
    if plugins:
        return False
    return importlib.util.find_spec("libtpu") is None or not _tpu_chips()


def _tpu_chips() -> bool:
    """Whether this host exposes TPU chips (``/dev/accel*`` on v4 and earlier, ``/dev/vfio`` since)."""
    return bool(glob.glob("/dev/accel*")) or bool(glob.glob("/dev/vfio/[0-9]*"))


def configure(mode: str | None = None) -> str:
    """Apply ``mode`` (default: ``$TMAX_JAX_HOST_MALLOC`` or ``auto``) once per process.

    Returns what happened: ``"reuse"`` (applied now or earlier), ``"system"`` (left as is), or
    ``"skipped: <why>"``.
    """
    global _applied
    if _applied is not None:
        return _applied
    mode = (mode or os.environ.get(ENV) or "auto").strip().lower()
    if mode not in MODES:
        raise ConfigError(f"{ENV}={mode!r}: expected one of {', '.join(MODES)}")
    if mode == "system" or (mode == "auto" and not cpu_only()):
        _applied = "system"
        return _applied
    libc = _libc()
    if libc is None:
        _applied = "skipped: not glibc"
        return _applied
    if _jax_backend_started():
        # Not cached: every later caller is told the same.
        return "skipped: the JAX backend has already started its threads"
    for param, value in ((_M_MMAP_MAX, 0), (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)):
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:
            _applied = f"skipped: mallopt({param}, {value}) refused"
            return _applied
    import jax

    jax.config.update("jax_cpu_enable_async_dispatch", False)
    _applied = "reuse"
    return _applied
