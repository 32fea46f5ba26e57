"""The executability filter: keep a task when its environment builds, its initial-state test
passes, and (for tasks with a reference solution) a no-op scores 0 and the solution scores 1.

Both checks share one sandbox: initial-state test, verifier on the untouched state (the no-op
reward), reference solution, verifier again (the oracle reward).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tmax_jax.errors import TmaxError
from tmax_jax.sandbox import SandboxConfig, SandboxPool, make_sandbox
from tmax_jax.tasks.environment import prepare_image, sandbox_config_for
from tmax_jax.tasks.loader import load_task
from tmax_jax.tasks.runner import initial_state, run_oracle, verify


@dataclass
class FilterResult:
    path: str
    kept: bool
    reason: str
    noop_reward: float | None = None
    oracle_reward: float | None = None
    duration_s: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def check_task(
    path: str | Path, cfg: SandboxConfig | None = None, pool: SandboxPool | None = None
) -> FilterResult:
    t0 = time.monotonic()
    cfg = cfg or (pool.cfg if pool is not None else SandboxConfig())

    def done(kept, reason, noop=None, oracle=None):
        return FilterResult(str(path), kept, reason, noop, oracle, time.monotonic() - t0)

    try:
        task = load_task(path)
    except TmaxError as e:
        return done(False, f"bad task: {e}")
    try:
        image = prepare_image(task, cfg)
    except TmaxError as e:
        return done(False, f"environment build failed: {e}")
    scfg = sandbox_config_for(task, cfg)
    try:
        ctx = pool.sandbox(image=image, cfg=scfg) if pool is not None else make_sandbox(scfg, image=image)
        with ctx as sb:
            ok, why, _ = initial_state(task, sb)
            if not ok:
                return done(False, why)
            if task.solution is None:
                return done(True, "kept: environment builds, initial state ok (no reference solution)")
            noop, why, _ = verify(task, sb)
            if noop != 0.0:
                return done(False, f"no-op scores {noop:g} ({why})", noop)
            res = run_oracle(task, sb)
            oracle, why, log = verify(task, sb)
            if oracle != 1.0:
                tail = (log or res.output)[-300:]
                return done(False, f"reference solution scores {oracle:g} ({why}): {tail}", noop, oracle)
    except TmaxError as e:
        return done(False, f"sandbox error: {e}")
    return done(True, "kept", noop, oracle)


def filter_tasks(
    paths, cfg: SandboxConfig | None = None, concurrency: int | None = None, progress=None
) -> list[FilterResult]:
    """``check_task`` for every path on a SandboxPool; results in the order of ``paths``."""
    paths = list(paths)
    with SandboxPool(cfg or SandboxConfig(), size=concurrency) as pool:
        futs = [pool.submit(check_task, p, pool.cfg, pool) for p in paths]
        out = []
        for f in futs:
            out.append(f.result())
            if progress is not None:
                progress(out[-1])
    return out
