"""Task-prompt data loading through grain: seeded shuffling, per-process shards, epochs, resumable state.

Every host of a multi-host run builds the same pipeline and reads only its own shard
(``jax.process_index()`` of ``jax.process_count()``), so no prompt is rolled out twice in an epoch.
Shards are cut *before* shuffling, which makes them disjoint by construction; with
``drop_remainder`` every shard has the same length, so all hosts run the same number of steps and
the collectives of the train step never wait on a host that ran out of prompts.

The iterator's position is a small dict (grain's own state plus our batch counter): saving it with
the train state and restoring it makes a resumed run see exactly the prompts it would have seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grain

from tmax_jax.errors import ConfigError, TaskFormatError


@dataclasses.dataclass(frozen=True)
class DataConfig:
    seed: int = 0
    shuffle: bool = True
    num_epochs: int | None = None  # None: repeat forever (RL runs stop by step count)
    drop_remainder: bool = True  # equal shard sizes across processes (see module docstring)
    reseed_each_epoch: bool = True  # a fresh permutation per epoch, still a function of the seed only

    def __post_init__(self) -> None:
        if self.num_epochs is not None and self.num_epochs < 1:
            raise ConfigError(f"data.num_epochs must be >= 1 or null, got {self.num_epochs}")


def discover_tasks(root: str | Path) -> list[dict[str, str]]:
    """Task records ``{"task_id", "path"}`` for every Harbor or TMAX task directory under ``root``.

    Task ids are the directories relative to ``root``, sorted, so every host enumerates the corpus
    identically. Directory detection is the task loader's (``tmax_jax.tasks.find_tasks``).
    """
    from tmax_jax.tasks import find_tasks

    root = Path(root)
    records = [
        {"task_id": p.relative_to(root).as_posix() if p != root else p.name, "path": str(p)}
        for p in find_tasks(root)
    ]
    if not records:
        raise TaskFormatError(
            f"no task directories (Harbor task.toml + instruction.md, or TMAX task.json) under {root}"
        )
    return sorted(records, key=lambda r: r["task_id"])


def read_instruction(path: str | Path) -> str:
    """The prompt of a Harbor or TMAX task directory, as the task loader reads it."""
    from tmax_jax.tasks import load_task

    return load_task(path).instruction


def _with_instruction(record: Mapping[str, Any]) -> dict[str, Any]:
    if "instruction" in record:
        return dict(record)
    return {**record, "instruction": read_instruction(record["path"])}


def _process_shard() -> tuple[int, int]:
    import jax

    return jax.process_index(), jax.process_count()


def prompt_dataset(
    records: Sequence[Mapping[str, Any]],
    cfg: DataConfig = DataConfig(),
    *,
    shard_index: int | None = None,
    shard_count: int | None = None,
) -> grain.MapDataset:
    """A grain MapDataset of prompt records (with ``instruction`` read lazily) for one shard.

    ``shard_index``/``shard_count`` default to this JAX process's index/count.
    """
    if shard_index is None or shard_count is None:
        pi, pc = _process_shard()
        shard_index = pi if shard_index is None else shard_index
        shard_count = pc if shard_count is None else shard_count
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ConfigError(f"shard_index must be in [0, shard_count={shard_count}), got {shard_index}")
    records = [dict(r) for r in records]
    for i, r in enumerate(records):
        if "task_id" not in r or ("path" not in r and "instruction" not in r):
            raise TaskFormatError(
                f"prompt record {i} needs 'task_id' and 'path' or 'instruction', got {sorted(r)}"
            )
    n = len(records) - (len(records) % shard_count if cfg.drop_remainder else 0)
    if n < shard_count:
        raise ConfigError(
            f"{len(records)} prompts cannot fill {shard_count} shards (one prompt each at least)"
        )
    ds = grain.MapDataset.source(records[:n])[shard_index::shard_count]
    if cfg.shuffle:
        ds = ds.shuffle(seed=cfg.seed)
    ds = ds.repeat(cfg.num_epochs, reseed_each_epoch=cfg.reseed_each_epoch)
    return ds.map(_with_instruction)


class PromptLoader:
    """Batches of prompt records from one shard, with a checkpointable position.

    ``get_state()`` returns plain JSON data; ``set_state(state)`` on a loader built with the same
    records and config continues with exactly the same next batches.
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        batch_size: int,
        cfg: DataConfig = DataConfig(),
        *,
        shard_index: int | None = None,
        shard_count: int | None = None,
    ):
        if batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
        self.batch_size = batch_size
        self.cfg = cfg
        if shard_index is None or shard_count is None:
            pi, pc = _process_shard()
            shard_index = pi if shard_index is None else shard_index
            shard_count = pc if shard_count is None else shard_count
        self._dataset = prompt_dataset(records, cfg, shard_index=shard_index, shard_count=shard_count)
        self._iter = iter(self._dataset.to_iter_dataset())
        self._fingerprint = _fingerprint(records, cfg, shard_index, shard_count)
        self.batches_done = 0

    def next_batch(self) -> list[dict[str, Any]]:
        """The next ``batch_size`` prompts; a short final batch at the end of finite epochs.

        Raises StopIteration when the finite epochs are exhausted.
        """
        batch = []
        for _ in range(self.batch_size):
            try:
                batch.append(next(self._iter))
            except StopIteration:
                break
        if not batch:
            raise StopIteration
        self.batches_done += 1
        return batch

    def __iter__(self):
        return self

    def __next__(self) -> list[dict[str, Any]]:
        return self.next_batch()

    def get_state(self) -> dict[str, Any]:
        return {
            "grain": self._iter.get_state(),
            "batches_done": self.batches_done,
            "fingerprint": self._fingerprint,
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        if state.get("fingerprint") != self._fingerprint:
            raise ConfigError(
                "prompt loader state was saved for different prompts, shard or data config "
                f"(saved {state.get('fingerprint')!r}, now {self._fingerprint!r})"
            )
        self._iter.set_state(state["grain"])
        self.batches_done = int(state["batches_done"])

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.get_state()))

    def load(self, path: str | Path) -> None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"prompt loader state not found: {path}")
        self.set_state(json.loads(path.read_text()))


def _fingerprint(
    records: Iterable[Mapping[str, Any]], cfg: DataConfig, shard_index: int, shard_count: int
) -> str:
    h = hashlib.sha256()
    for r in records:
        h.update(str(r.get("task_id")).encode() + b"\0")
    h.update(repr((dataclasses.astuple(cfg), shard_index, shard_count)).encode())
    return h.hexdigest()[:16]
