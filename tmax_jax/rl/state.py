"""Orbax checkpoints of the train state: params, AdamW state, step, RNG and the data-iterator state.

Saves run asynchronously every ``save_every`` steps and keep the newest ``keep``. A restore walks the
steps newest first; a checkpoint that fails to read (truncated file, missing array, bad metadata) is
reported and the previous one is used, so a run killed mid-write resumes from the last good step.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from tmax_jax.errors import CheckpointError

log = logging.getLogger(__name__)


class TrainCheckpointer:
    def __init__(self, directory: str | Path, *, save_every: int = 1, keep: int = 3, async_save: bool = True):
        if save_every < 1:
            raise CheckpointError(f"save_every must be >= 1, got {save_every}")
        if keep < 1:
            raise CheckpointError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory).absolute()
        self.save_every = save_every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=1,  # the interval is applied in save(), so step 0 is not special
            enable_async_checkpointing=async_save,
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(
        self, step: int, state, data_state: dict[str, Any] | None = None, *, force: bool = False
    ) -> bool:
        """Start saving ``state`` as ``step`` when the interval says so (or ``force``); returns whether it did.

        ``data_state`` must be JSON-serialisable (e.g. a grain iterator's ``get_state()``).
        """
        if not force and int(step) % self.save_every:
            return False
        args = ocp.args.Composite(
            state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(dict(data_state or {}))
        )
        return self.manager.save(int(step), args=args, force=force)

    def wait(self) -> None:
        """Block until pending asynchronous saves are on disk."""
        self.manager.wait_until_finished()

    def restore(self, step: int, abstract_state) -> tuple[Any, dict]:
        """Restore exactly ``step`` into ``abstract_state``'s shapes and shardings (raises on failure)."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
        try:
            out = self.manager.restore(int(step), args=args)
            state = jax.block_until_ready(out["state"])
        except Exception as e:  # orbax / tensorstore raise many kinds for damaged files
            raise CheckpointError(f"checkpoint step {step} in {self.directory} is unreadable: {e}") from e
        return state, dict(out["data"] or {})

    def restore_latest(self, abstract_state) -> tuple[int, Any, dict] | None:
        """``(step, state, data_state)`` from the newest readable checkpoint, or None when there is none."""
        self.manager.reload()
        for step in sorted(self.manager.all_steps(), reverse=True):
            try:
                state, data = self.restore(step, abstract_state)
            except CheckpointError as e:
                msg = f"{e}; falling back to the previous checkpoint"
                log.warning(msg)
                print(f"tmax-jax: warning: {msg}", file=sys.stderr)
                continue
            return step, state, data
        return None

    def close(self) -> None:
        self.wait()
        self.manager.close()

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
