"""Token trajectories: one whole multi-turn episode as the policy saw it.

``tokens`` is the conversation exactly as fed to the rollout engine. ``response_mask[i]`` is 1 exactly
where token i was sampled by the policy (0 on prompt, tool output and template glue), and
``rollout_logprobs[i]`` / ``policy_versions[i]`` are the engine's logprob and weight version for
that token (0.0 / -1 elsewhere). MoE rollouts with routing recorded also keep ``routed_experts``
(int16 ``[len(tokens), layers, top_k]``): the experts each token was routed to when the engine fed it
back during decoding, -1 for tokens it prefilled (prompts, tool output, each turn's last token). It
is a train input only: not written by ``to_json`` (it is ~``layers * top_k`` ints per token).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from tmax_jax.errors import TmaxError


@dataclasses.dataclass
class Trajectory:
    task_id: str
    group_id: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    response_mask: list[int] = dataclasses.field(default_factory=list)
    rollout_logprobs: list[float] = dataclasses.field(default_factory=list)
    policy_versions: list[int] = dataclasses.field(default_factory=list)
    reward: float = 0.0
    num_turns: int = 0
    num_format_errors: int = 0
    finish_reason: str = ""
    messages: list[dict] = dataclasses.field(default_factory=list)
    info: dict = dataclasses.field(default_factory=dict)
    routed_experts: np.ndarray | None = dataclasses.field(default=None, compare=False, repr=False)

    def append(
        self, ids: Iterable[int], *, generated: bool, logprobs=None, versions=None, experts=None
    ) -> None:
        """Add ``ids``; ``experts`` (generated ids of a routing-recording engine): their recorded
        routing, ``[len(ids), layers, top_k]``."""
        ids = list(ids)
        self._append_routing(len(ids), experts)
        self.tokens.extend(ids)
        self.response_mask.extend([1 if generated else 0] * len(ids))
        if generated:
            if logprobs is None or len(logprobs) != len(ids):
                raise TmaxError(
                    f"generated tokens need one logprob each: {len(ids)} tokens, {logprobs and len(logprobs)}"
                )
            self.rollout_logprobs.extend(float(x) for x in logprobs)
            vs = list(versions) if versions is not None else [0] * len(ids)
            self.policy_versions.extend(int(v) for v in vs)
        else:
            self.rollout_logprobs.extend([0.0] * len(ids))
            self.policy_versions.extend([-1] * len(ids))

    def _append_routing(self, n: int, experts) -> None:
        if experts is None:
            if self.routed_experts is not None:
                pad = np.full((n, *self.routed_experts.shape[1:]), -1, np.int16)
                self.routed_experts = np.concatenate([self.routed_experts, pad])
            return
        experts = np.asarray(experts)
        if experts.ndim != 3 or experts.shape[0] != n or not np.issubdtype(experts.dtype, np.integer):
            raise TmaxError(
                f"routed experts must be integer [tokens, layers, top_k] for {n} tokens, "
                f"got {experts.dtype}{list(experts.shape)}"
            )
        if self.routed_experts is None:  # earlier tokens were never fed by a recording engine
            self.routed_experts = np.full((len(self.tokens), *experts.shape[1:]), -1, np.int16)
        elif self.routed_experts.shape[1:] != experts.shape[1:]:
            raise TmaxError(
                f"routed experts [layers, top_k] {list(experts.shape[1:])} differ from the "
                f"trajectory's {list(self.routed_experts.shape[1:])}"
            )
        self.routed_experts = np.concatenate([self.routed_experts, experts.astype(np.int16)])

    @property
    def num_generated(self) -> int:
        return sum(self.response_mask)

    @property
    def min_version(self) -> int:
        gen = [v for v, m in zip(self.policy_versions, self.response_mask) if m]
        return min(gen) if gen else -1

    def validate(self) -> None:
        n = len(self.tokens)
        for name in ("response_mask", "rollout_logprobs", "policy_versions"):
            if len(getattr(self, name)) != n:
                raise TmaxError(
                    f"trajectory {self.task_id}: {name} has {len(getattr(self, name))} entries, tokens {n}"
                )
        if self.routed_experts is not None and len(self.routed_experts) != n:
            raise TmaxError(
                f"trajectory {self.task_id}: routed_experts has {len(self.routed_experts)} rows, tokens {n}"
            )

    def to_json(self) -> dict:
        out = dataclasses.asdict(dataclasses.replace(self, routed_experts=None))
        del out["routed_experts"]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> Trajectory:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(obj) - fields
        if unknown:
            raise TmaxError(f"unknown trajectory fields: {sorted(unknown)}")
        traj = cls(**obj)
        traj.validate()
        return traj


def write_jsonl(path: str | Path, trajectories: Iterable[Trajectory]) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        for t in trajectories:
            f.write(json.dumps(t.to_json()) + "\n")


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Trajectory]]:
    """(line number, trajectory) for each record of a JSONL file written by ``write_jsonl``."""
    with Path(path).open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                traj = Trajectory.from_json(json.loads(line))
            except (json.JSONDecodeError, TypeError, TmaxError) as e:
                raise TmaxError(f"{path}:{lineno}: not a trajectory record: {e}") from e
            yield lineno, traj


def read_jsonl(path: str | Path) -> Iterator[Trajectory]:
    for _, traj in iter_jsonl(path):
        yield traj
