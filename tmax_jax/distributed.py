"""Multi-controller JAX: every host runs the same program; ``jax.distributed.initialize`` joins them.

On TPU pods and SLURM/Kubernetes GPU clusters JAX discovers the coordinator itself (``auto``); a bare
cluster passes the coordinator address, process count and id explicitly. A single host skips it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax

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
    jax.distributed.initialize(**kwargs)
    _initialized = True
    return True


def is_primary() -> bool:
    """Process 0 writes logs, metrics and HF exports; every process writes its checkpoint shards."""
    return jax.process_index() == 0
