"""Outcome-reward advantages per group (GRPO-style baselines), with soft filtering of flat groups.

Runs on the host (NumPy): rewards arrive one trajectory at a time from the sandboxes, and the result
is broadcast to per-token advantages when trajectories are packed into train rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from tmax_jax.errors import ConfigError
from tmax_jax.rl.config import AdvantageConfig


@dataclasses.dataclass(frozen=True)
class GroupAdvantages:
    advantages: np.ndarray  # float32 [N], 0 for trajectories of dropped groups
    keep: np.ndarray  # bool [N], False for trajectories of dropped groups
    dropped_groups: tuple  # group ids whose rewards were all equal (no learning signal)
    zero_pass_groups: tuple  # group ids where every reward was <= 0 (task never solved)
    all_pass_groups: tuple  # group ids where every sample got the same positive reward (always solved)
    group_ids_seen: tuple = ()

    def stats(self) -> dict[str, float]:
        n_groups = len(self.group_ids_seen)
        return {
            "groups": float(n_groups),
            "groups_dropped": float(len(self.dropped_groups)),
            "groups_zero_pass": float(len(self.zero_pass_groups)),
            "groups_all_pass": float(len(self.all_pass_groups)),
            "trajectories_kept": float(self.keep.sum()),
            "advantage_abs_mean": float(np.abs(self.advantages[self.keep]).mean())
            if self.keep.any()
            else 0.0,
        }


class NonFiniteAdvantageError(ConfigError):
    """A reward or advantage that is inf or NaN: one such value would poison the whole update."""


def _describe(i: int, gids: list, names: Sequence[str] | None) -> str:
    who = f"trajectory {i}"
    if names is not None:
        who += f" (task {names[i]!r})"
    return f"{who} of group {gids[i]!r}"


def _check_finite(values: np.ndarray, what: str, gids: list, names: Sequence[str] | None) -> None:
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
        listed = "; ".join(f"{_describe(int(i), gids, names)}: {float(values[i])}" for i in bad[:4])
        more = f" (and {bad.size - 4} more)" if bad.size > 4 else ""
        raise NonFiniteAdvantageError(
            f"non-finite {what} for {listed}{more}; a reward must be one finite number in [0, 1] "
            "(tmax_jax.tasks.reward.parse_reward)"
        )


def group_advantages(
    rewards: Sequence[float] | np.ndarray,
    group_ids: Sequence | np.ndarray,
    cfg: AdvantageConfig = AdvantageConfig(),
    names: Sequence[str] | None = None,
) -> GroupAdvantages:
    """``A_i = R_i - mean_{j in group(i)} R_j`` (``mode="centered"``), divided by the group's std when
    ``mode="std"``. Groups whose rewards are all equal get ``keep=False`` (and advantage 0).

    ``rewards``: [N] floats; ``group_ids``: [N] hashable ids (one id per prompt; its samples share it);
    ``names``: [N] task names, for error messages. A non-finite reward, or a finite one so large that
    its advantage is not finite in float32 (``1e308``: the group mean overflows), raises
    ``NonFiniteAdvantageError`` naming the trajectory, its task and group.
    """
    r = np.asarray(rewards, dtype=np.float64)
    if r.ndim != 1:
        raise ConfigError(f"rewards must be 1-D [N], got shape {r.shape}")
    gids = list(group_ids)
    if len(gids) != r.shape[0]:
        raise ConfigError(f"group_ids has {len(gids)} entries but rewards has {r.shape[0]}")
    if names is not None and len(names) != r.shape[0]:
        raise ConfigError(f"names has {len(names)} entries but rewards has {r.shape[0]}")
    _check_finite(r, "reward", gids, names)
    if cfg.mode not in ("centered", "std"):
        raise ConfigError(f"advantage.mode must be 'centered' or 'std', got {cfg.mode!r}")

    order: dict = {}
    for i, g in enumerate(gids):
        order.setdefault(g, []).append(i)

    adv = np.zeros_like(r)
    keep = np.ones(r.shape[0], dtype=bool)
    dropped, zero_pass, all_pass = [], [], []
    for g, idx in order.items():
        rg = r[idx]
        if np.all(rg <= 0):
            zero_pass.append(g)
        if np.all(rg > 0) and np.all(rg == rg.max()):
            all_pass.append(g)
        # Exact equality: graded verifiers give fractional rewards, and any spread is a signal.
        if np.all(rg == rg[0]):
            if cfg.drop_constant_groups:
                dropped.append(g)
                keep[idx] = False
            continue
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is caught just below, by name
            centred = rg - rg.mean()
            if cfg.mode == "std":
                centred = centred / (rg.std() + cfg.std_eps)
        adv[idx] = centred
    with np.errstate(over="ignore"):
        adv32 = adv.astype(np.float32)
    _check_finite(adv32, "advantage", gids, names)
    return GroupAdvantages(
        advantages=adv32,
        keep=keep,
        dropped_groups=tuple(dropped),
        zero_pass_groups=tuple(zero_pass),
        all_pass_groups=tuple(all_pass),
        group_ids_seen=tuple(order),
    )
