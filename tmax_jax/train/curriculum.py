"""Curriculum over the training prompts: TMAX's soft filtering and active sampling.

Soft filtering: every prompt keeps the pass rates of its last ``window`` groups. A prompt whose
recent pass rate is 0 or 1 (over at least ``min_groups`` groups) teaches nothing in a group-relative
objective (all its episodes get advantage 0), so it is drawn with weight ``saturated_weight``
instead of 1, and retired once it stayed saturated for ``retire_after`` groups in a row (0 = never).
A saturated prompt is still drawn now and then, so a policy that drifts lets it back in.

Active sampling (``ActiveSampler``): a step draws ``k`` prompts, runs their groups and keeps drawing
``k`` more until it has ``k`` groups whose rewards are not all equal, or ``max_draws`` draws were made.
The batch holds the first ``k`` informative groups and every flat group drawn (the trainer's soft
filter gives flat groups no rows, but they count in the step's pass rate); informative groups beyond
``k`` are dropped and counted, so the train step's row count stays bounded.

The state (histories, streaks, retired prompts) is plain JSON and goes into the checkpoint with the
prompt loader's position. Draws are seeded by (run seed, step, draw, process), so a resumed run
draws what the uninterrupted one would have.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from tmax_jax.errors import ConfigError
from tmax_jax.train.config import CurriculumConfig


class Curriculum:
    def __init__(self, num_prompts: int, cfg: CurriculumConfig):
        if num_prompts < 1:
            raise ConfigError(f"curriculum: need at least 1 prompt, got {num_prompts}")
        self.cfg = cfg
        self.n = num_prompts
        self.history: list[list[float]] = [[] for _ in range(num_prompts)]
        self.streak = [0] * num_prompts  # consecutive groups with pass rate 0 or 1
        self.retired: set[int] = set()

    # ------------------------------------------------------------------ bookkeeping
    def record(self, prompt: int, pass_rate: float) -> None:
        """One finished group of ``prompt`` with this pass rate (fraction of its episodes that passed)."""
        if not 0 <= prompt < self.n:
            raise IndexError(f"curriculum: prompt {prompt} out of range [0, {self.n})")
        if not 0.0 <= pass_rate <= 1.0:
            raise ValueError(f"curriculum: pass rate must be in [0, 1], got {pass_rate}")
        h = self.history[prompt]
        h.append(float(pass_rate))
        del h[: -self.cfg.window]
        self.streak[prompt] = self.streak[prompt] + 1 if pass_rate in (0.0, 1.0) else 0
        if self.cfg.retire_after and self.streak[prompt] >= self.cfg.retire_after:
            self.retired.add(prompt)

    def recent_pass_rate(self, prompt: int) -> float | None:
        h = self.history[prompt]
        return float(np.mean(h)) if h else None

    def saturated(self, prompt: int) -> bool:
        h = self.history[prompt]
        return len(h) >= self.cfg.min_groups and float(np.mean(h)) in (0.0, 1.0)

    def weights(self) -> np.ndarray:
        """Draw weight per prompt: 1, ``saturated_weight`` when saturated, 0 when retired. When that
        leaves nothing to draw, every prompt is un-retired (and weighted 1)."""
        w = np.array([self.cfg.saturated_weight if self.saturated(i) else 1.0 for i in range(self.n)])
        for i in self.retired:
            w[i] = 0.0
        if not w.any():
            self.retired.clear()
            self.streak = [0] * self.n
            w = np.ones(self.n)
        return w

    def sample(self, rng: np.random.Generator, k: int, shard: tuple[int, int] = (0, 1)) -> list[int]:
        """``k`` distinct prompts (fewer only when there are fewer than ``k``), drawn by weight; when
        fewer than ``k`` have weight > 0 the rest are drawn uniformly from the others. ``shard=(i, n)``
        draws only prompts ``i, i + n, ...`` (JAX process i of n: processes never share a prompt)."""
        index, count = shard
        mine = np.arange(index, self.n, count)
        k = min(k, len(mine))
        w = self.weights()
        live = mine[w[mine] > 0]
        take = min(k, len(live))
        chosen = list(rng.choice(live, size=take, replace=False, p=w[live] / w[live].sum())) if take else []
        if take < k:
            rest = np.setdiff1d(mine, chosen)
            chosen += list(rng.choice(rest, size=k - take, replace=False))
        return [int(i) for i in chosen]

    def stats(self) -> dict:
        return {
            "curriculum/saturated_prompts": sum(self.saturated(i) for i in range(self.n)),
            "curriculum/retired_prompts": len(self.retired),
        }

    # ------------------------------------------------------------------ checkpoint state
    def state_dict(self) -> dict:
        return {
            "n": self.n,
            "history": [list(h) for h in self.history],
            "streak": list(self.streak),
            "retired": sorted(self.retired),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("n") != self.n:
            raise ConfigError(
                f"curriculum state is for {state.get('n')} prompts, this run has {self.n} (the task set changed)"
            )
        self.history = [list(map(float, h))[-self.cfg.window :] for h in state["history"]]
        self.streak = [int(s) for s in state["streak"]]
        self.retired = {int(i) for i in state["retired"]}


def informative(rewards: Sequence[float]) -> bool:
    """A group carries a learning signal when its rewards are not all equal (and it has two or more)."""
    return len(rewards) >= 2 and max(rewards) != min(rewards)


class ActiveSampler:
    """Draws prompts from a ``Curriculum`` until a step has ``k`` informative groups (or ``max_draws``).

    ``run_groups(prompts, draw)`` runs one group per prompt index and returns, per prompt, a
    ``(group, rewards, pass_rate)`` triple; ``draw`` (0, 1, ...) lets the caller seed episodes apart.
    Each JAX process draws from its own shard of the prompts and keeps its own statistics.
    """

    def __init__(
        self, curriculum: Curriculum, k: int, seed: int, *, process_index: int = 0, process_count: int = 1
    ):
        if k < 1:
            raise ConfigError(f"curriculum: prompts per draw must be >= 1, got {k}")
        self.curriculum = curriculum
        self.k = k
        self.seed = seed
        self.process_index = process_index
        self.process_count = process_count

    def rng(self, step: int, draw: int) -> np.random.Generator:
        return np.random.default_rng([self.seed & 0xFFFFFFFF, step, draw, self.process_index])

    def step(self, step: int, run_groups: Callable[[list[int], int], list[tuple]]) -> tuple[list, dict]:
        """The groups of ``step`` and its curriculum metrics."""
        cur = self.curriculum
        kept, flat, extra = [], [], 0
        draws = drawn = 0
        while draws < cur.cfg.max_draws and len(kept) < self.k:
            prompts = cur.sample(self.rng(step, draws), self.k, (self.process_index, self.process_count))
            results = run_groups(prompts, draws)
            draws += 1
            for p, (group, rewards, pass_rate) in zip(prompts, results):
                drawn += 1
                if rewards:  # a group whose every episode failed to start says nothing of the prompt
                    cur.record(p, pass_rate)
                if informative(rewards):
                    if len(kept) < self.k:
                        kept.append(group)
                    else:
                        extra += 1
                else:
                    flat.append(group)
        metrics = {
            "curriculum/draws": draws,
            "curriculum/groups_drawn": drawn,
            "curriculum/informative_groups": len(kept),
            "curriculum/flat_groups": len(flat),
            "curriculum/extra_informative_dropped": extra,
            "curriculum/short": int(len(kept) < self.k),
            **cur.stats(),
        }
        return kept + flat, metrics
