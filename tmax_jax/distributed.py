"""Multi-controller JAX: every host runs the same program; ``jax.distributed.initialize`` joins them.

On TPU pods and SLURM/Kubernetes GPU clusters JAX discovers the coordinator itself (``auto``); a bare
cluster passes the coordinator address, process count and id explicitly. A single host skips it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Literal

import jax
import numpy as np

from tmax_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    mode: Literal["off", "auto", "explicit"] = "off"
    coordinator_address: str | None = None  # "host:port" of process 0 (explicit mode)
    num_processes: int | None = None
    process_id: int | None = None
    local_device_ids: tuple[int, ...] | None = None
    initialization_timeout_s: int = 300

    def __post_init__(self) -> None:
        if self.mode == "explicit":
            missing = [
                n for n in ("coordinator_address", "num_processes", "process_id") if getattr(self, n) is None
            ]
            if missing:
                raise ConfigError(f"distributed.mode=explicit needs {missing}")
            if not 0 <= self.process_id < self.num_processes:
                raise ConfigError(
                    f"distributed.process_id={self.process_id} is outside [0, {self.num_processes})"
                )


_initialized = False


def synchronous_cpu_dispatch() -> None:
    """Dispatch CPU computations synchronously. Seen here (jax 0.10.2, 2 cores): train steps queued by
    CPU async dispatch with donated state, and cross-process CPU collectives, never complete (every
    XLA thread idles, the host waits forever). It costs nothing measurable at CPU scale, changes
    nothing on TPU/GPU, and must run before the backend starts (so not behind jax.default_backend())."""
    jax.config.update("jax_cpu_enable_async_dispatch", False)


def initialize(cfg: DistributedConfig) -> bool:
    """Join the JAX distributed runtime when configured; returns whether this call initialised it.

    Must run before anything touches a device (jax.devices(), creating arrays).
    """
    global _initialized
    if cfg.mode == "off" or _initialized:
        return False
    kwargs = {"initialization_timeout": cfg.initialization_timeout_s}
    if cfg.mode == "explicit":
        kwargs |= {
            "coordinator_address": cfg.coordinator_address,
            "num_processes": cfg.num_processes,
            "process_id": cfg.process_id,
        }
    if cfg.local_device_ids is not None:
        kwargs["local_device_ids"] = list(cfg.local_device_ids)
    # CPU collectives across processes (gloo) hang under CPU async dispatch too.
    synchronous_cpu_dispatch()
    jax.distributed.initialize(**kwargs)
    _initialized = True
    return True


def is_primary() -> bool:
    """Process 0 writes logs, metrics and HF exports; every process writes its checkpoint shards."""
    return jax.process_index() == 0


def allgather_json(obj):
    """Every process's ``obj`` (any JSON-serialisable value), in process order, on every process.

    A collective: all processes must call it, in the same order relative to their other collectives.
    One process returns ``[obj]`` at no cost.
    """
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.array([data.size], np.int32))).reshape(-1)
    buf = np.zeros(int(sizes.max()), np.uint8)
    buf[: data.size] = data
    gathered = np.asarray(multihost_utils.process_allgather(buf))
    return [json.loads(bytes(gathered[p, : sizes[p]]).decode()) for p in range(len(sizes))]


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (a collective, like :func:`allgather_json`)."""
    return any(allgather_json(bool(flag)))


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier ``name`` (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def primary_first(name: str):
    """Process 0 runs the block, then the others do: for files that one process must create before
    the rest read them (the run's config.yaml, generated tasks, a tiny init checkpoint). If process 0
    fails inside the block the others wait until the distributed runtime notices it is gone."""
    if not is_primary():
        barrier(f"{name}:primary")
    yield
    if is_primary():
        barrier(f"{name}:primary")
