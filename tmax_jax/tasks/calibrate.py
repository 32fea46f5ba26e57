"""Calibration: run a policy k times per task, record pass rates, keep a difficulty band.

TMAX keeps tasks whose pass rate under the policy is neither 0 nor 1 (those groups carry no
advantage signal); the trainer also drops zero-variance groups at run time. ``calibrate`` records
every task's rewards; ``in_band`` selects the tasks whose pass rate lies in (lo, hi).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tmax_jax.errors import ConfigError, TmaxError
from tmax_jax.sandbox import SandboxConfig, SandboxPool
from tmax_jax.tasks.loader import load_task
from tmax_jax.tasks.runner import run_task


@dataclass
class Calibration:
    task: str
    path: str
    k: int
    passes: int
    pass_rate: float
    mean_reward: float
    rewards: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def calibrate(
    task_dirs, agent, k: int, cfg: SandboxConfig | None = None, concurrency: int | None = None
) -> list[Calibration]:
    """``agent``: ``"oracle"``, None, or a callable ``agent(task, shell)`` (one instance is shared
    by all attempts, so it must be safe to call from several threads)."""
    if k < 1:
        raise ConfigError(f"k must be >= 1, got {k}")
    dirs = [Path(d) for d in task_dirs]
    with SandboxPool(cfg or SandboxConfig(), size=concurrency) as pool:
        tasks = {}
        for d in dirs:
            try:
                tasks[d] = load_task(d)
            except TmaxError as e:
                tasks[d] = e
        futs = {
            d: [pool.submit(run_task, t, agent, pool.cfg, pool=pool) for _ in range(k)]
            for d, t in tasks.items()
            if not isinstance(t, Exception)
        }
        out = []
        for d, t in tasks.items():
            if isinstance(t, Exception):
                out.append(Calibration(d.name, str(d), k, 0, 0.0, 0.0, [], [f"bad task: {t}"]))
                continue
            res = [f.result() for f in futs[d]]
            rewards = [r.reward for r in res]
            passes = sum(r.passed for r in res)
            errors = [
                r.reason for r in res if r.reason.startswith(("sandbox error", "environment build failed"))
            ]
            out.append(Calibration(t.name, str(d), k, passes, passes / k, sum(rewards) / k, rewards, errors))
    return out


def in_band(results: list[Calibration], lo: float = 0.0, hi: float = 1.0) -> list[Calibration]:
    """Tasks whose pass rate is strictly between ``lo`` and ``hi`` (the default drops 0 and 1)."""
    if not 0.0 <= lo < hi <= 1.0:
        raise ConfigError(f"difficulty band must satisfy 0 <= lo < hi <= 1, got ({lo}, {hi})")
    return [r for r in results if lo < r.pass_rate < hi and not r.errors]


def write_report(results: list[Calibration], path: Path, lo: float, hi: float) -> None:
    band = {r.path for r in in_band(results, lo, hi)}
    rows = [{**asdict(r), "in_band": r.path in band} for r in results]
    path.write_text(json.dumps({"band": [lo, hi], "tasks": rows}, indent=2) + "\n")
