"""Orbax checkpoints of the train state: params, AdamW state, step, RNG and the data-iterator state,
and, in runs that fit speculative decoding's draft as they train, the draft's own state.

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
        # Handlers named up front: a fresh process can then read an item it has not written (draft).
        handlers = dict(
            state=ocp.StandardCheckpointHandler(),
            data=ocp.JsonCheckpointHandler(),
            draft=ocp.StandardCheckpointHandler(),
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

    def steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(
        self,
        step: int,
        state,
        data_state: dict[str, Any] | None = None,
        *,
        force: bool = False,
        draft: Any = None,
    ) -> bool:
        """Start saving ``state`` as ``step`` when the interval says so (or ``force``); returns whether it did.

        ``data_state`` must be JSON-serialisable (e.g. a grain iterator's ``get_state()``). ``draft``:
        a pytree of arrays saved beside the state as the step's ``draft`` item (``restore_draft``).
        """
        if not force and int(step) % self.save_every:
            return False
        items = dict(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(dict(data_state or {})))
        if draft is not None:
            items["draft"] = ocp.args.StandardSave(draft)
        return self.manager.save(int(step), args=ocp.args.Composite(**items), force=force)

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

    def has_draft(self, step: int) -> bool:
        """Whether checkpoint ``step`` holds a ``draft`` item."""
        self.wait()
        return (self.directory / str(int(step)) / "draft").is_dir()

    def restore_draft(self, step: int, abstract_draft) -> Any:
        """Step ``step``'s ``draft`` item in ``abstract_draft``'s structure, shapes and shardings, or
        None when the step has none (a run that started fitting its draft after that step)."""
        if not self.has_draft(step):
            return None
        # Arrays of other shapes (another draft module) are named here, before orbax fails on them.
        saved = sorted(
            (tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(self.manager.item_metadata(step)["draft"])
        )
        want = sorted((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(abstract_draft))
        if saved != want:
            raise CheckpointError(
                f"the draft saved with checkpoint step {step} in {self.directory} does not match this "
                f"run's draft module: {len(saved)} arrays saved, {len(want)} expected, shapes "
                f"{sorted(set(saved) ^ set(want))[:4]} in one but not the other"
            )
        args = ocp.args.Composite(draft=ocp.args.StandardRestore(abstract_draft))
        try:
            return jax.block_until_ready(self.manager.restore(int(step), args=args)["draft"])
        except Exception as e:  # a damaged item, or one of another structure (a different draft)
            raise CheckpointError(
                f"the draft saved with checkpoint step {step} in {self.directory} is unreadable: {e}"
            ) from e

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
