"""Pack trajectories into fixed-shape train rows: the batch contract of ``TrainStep``.

Train batch (every field ``[B, T]``; B = rows, T = ``seq_len``):

| field | dtype | meaning |
| --- | --- | --- |
| ``input_ids`` | int32 | tokens fed to the model (a trajectory's tokens without its last one) |
| ``segment_ids`` | int32 | 1, 2, ... per packed trajectory within a row; 0 on padding (right side only) |
| ``positions`` | int32 | position within its own trajectory (restarts at every segment), 0 on padding |
| ``targets`` | int32 | the next token (the one whose logprob is trained), 0 on padding |
| ``response_mask`` | float32 | 1 where the *target* was sampled by the policy, else 0 |
| ``rollout_logprobs`` | float32 | the rollout engine's logprob of the target (0 where not generated) |
| ``advantages`` | float32 | the trajectory's advantage, broadcast over its tokens (so packing works) |

A trajectory of L tokens fills L - 1 positions: input i predicts token i + 1, so a target's mask and
logprob are the trajectory's ``response_mask[i + 1]`` / ``rollout_logprobs[i + 1]``.

MoE runs with routing replay add ``routed_experts`` (int16 ``[B, T, layers, top_k]``, see
``routing_field``): the experts the rollout engine routed *input* i to, so it is the trajectory's
``routed_experts[i]``; -1 where not recorded (prompt tokens, padding), which the train step re-routes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from tmax_jax.errors import ConfigError

BATCH_FIELDS = (
    "input_ids",
    "segment_ids",
    "positions",
    "targets",
    "response_mask",
    "rollout_logprobs",
    "advantages",
)
_INT_FIELDS = ("input_ids", "segment_ids", "positions", "targets")
# The optional routing-replay field (the train step's ``routing_replay``); -1 = not recorded.
ROUTING_FIELD = "routed_experts"


class TrajectoryLike(Protocol):
    tokens: Sequence[int]
    response_mask: Sequence[int]
    rollout_logprobs: Sequence[float]


def empty_batch(num_rows: int, seq_len: int) -> dict[str, np.ndarray]:
    return {
        k: np.zeros((num_rows, seq_len), np.int32 if k in _INT_FIELDS else np.float32) for k in BATCH_FIELDS
    }


def validate_batch(batch, *, rows_multiple: int = 1) -> tuple[int, int]:
    """Check the batch contract; returns (B, T). Raises ConfigError naming the offending field."""
    missing = [k for k in BATCH_FIELDS if k not in batch]
    if missing:
        raise ConfigError(f"train batch is missing fields {missing} (needs {list(BATCH_FIELDS)})")
    extra = sorted(set(batch) - set(BATCH_FIELDS))
    if extra:
        raise ConfigError(f"train batch has unknown fields {extra}")
    shape = tuple(np.shape(batch["input_ids"]))
    if len(shape) != 2:
        raise ConfigError(f"train batch input_ids must be [B, T], got shape {shape}")
    for k in BATCH_FIELDS:
        v = batch[k]
        if tuple(np.shape(v)) != shape:
            raise ConfigError(f"train batch field {k!r} has shape {tuple(np.shape(v))}, expected {shape}")
        want = np.int32 if k in _INT_FIELDS else np.float32
        if np.dtype(v.dtype) != want:
            raise ConfigError(
                f"train batch field {k!r} must be {np.dtype(want).name}, got {np.dtype(v.dtype).name}"
            )
    if shape[0] % rows_multiple:
        raise ConfigError(f"train batch has {shape[0]} rows, not a multiple of {rows_multiple}")
    return shape


def pack_trajectories(
    trajectories: Sequence[TrajectoryLike],
    advantages: Sequence[float],
    *,
    seq_len: int,
    num_rows: int | None = None,
    rows_multiple: int = 1,
) -> tuple[dict[str, np.ndarray], list[tuple[int, int, int]]]:
    """First-fit-decreasing packing of trajectories into rows of ``seq_len`` positions.

    ``num_rows`` fixes the row count (static shapes: one compile for every step); otherwise the rows
    used are rounded up to ``rows_multiple`` (data * fsdp * micro_batches). Returns the batch and,
    per trajectory, ``(row, start, length)`` of its segment.
    """
    if len(trajectories) != len(advantages):
        raise ConfigError(f"{len(trajectories)} trajectories but {len(advantages)} advantages")
    if seq_len < 1:
        raise ConfigError(f"seq_len must be >= 1, got {seq_len}")
    lengths = []
    for i, tr in enumerate(trajectories):
        n = len(tr.tokens)
        if len(tr.response_mask) != n or len(tr.rollout_logprobs) != n:
            raise ConfigError(
                f"trajectory {i}: tokens/response_mask/rollout_logprobs lengths differ "
                f"({n}, {len(tr.response_mask)}, {len(tr.rollout_logprobs)})"
            )
        if n < 2:
            raise ConfigError(f"trajectory {i} has {n} token(s); at least 2 are needed for one target")
        if n - 1 > seq_len:
            raise ConfigError(f"trajectory {i} needs {n - 1} positions but seq_len is {seq_len}")
        lengths.append(n - 1)

    free: list[int] = []  # remaining space per row
    placement: list[tuple[int, int, int]] = [(-1, -1, -1)] * len(trajectories)
    for i in sorted(range(len(trajectories)), key=lambda j: -lengths[j]):
        row = next((r for r, space in enumerate(free) if space >= lengths[i]), None)
        if row is None:
            row = len(free)
            free.append(seq_len)
        placement[i] = (row, seq_len - free[row], lengths[i])
        free[row] -= lengths[i]

    rows = len(free)
    if num_rows is not None:
        if rows > num_rows:
            raise ConfigError(f"trajectories need {rows} rows of {seq_len} but num_rows is {num_rows}")
        rows = num_rows
    rows = max(rows, 1)
    rows = -(-rows // rows_multiple) * rows_multiple

    batch = empty_batch(rows, seq_len)
    seg_count = [0] * rows
    # Segment ids in left-to-right order within each row.
    for i in sorted(range(len(trajectories)), key=lambda j: placement[j][:2]):
        row, start, n = placement[i]
        tr = trajectories[i]
        tokens = np.asarray(tr.tokens, np.int64)
        if tokens.min() < 0:
            raise ConfigError(f"trajectory {i} has a negative token id")
        seg_count[row] += 1
        sl = slice(start, start + n)
        batch["input_ids"][row, sl] = tokens[:-1]
        batch["targets"][row, sl] = tokens[1:]
        batch["segment_ids"][row, sl] = seg_count[row]
        batch["positions"][row, sl] = np.arange(n)
        batch["response_mask"][row, sl] = np.asarray(tr.response_mask, np.float32)[1:]
        batch["rollout_logprobs"][row, sl] = np.asarray(tr.rollout_logprobs, np.float32)[1:]
        batch["advantages"][row, sl] = np.float32(advantages[i])
    return batch, placement


def routing_field(
    trajectories: Sequence[TrajectoryLike],
    placement: Sequence[tuple[int, int, int]],
    shape: tuple[int, int],
    routing_shape: tuple[int, int],
) -> np.ndarray:
    """The ``routed_experts`` field of a batch packed by ``pack_trajectories``: int16
    ``[B, T, layers, top_k]``, each input token's recorded experts (a trajectory's
    ``routed_experts``), -1 where none were recorded."""
    out = np.full((*shape, *routing_shape), -1, np.int16)
    for i, (tr, (row, start, n)) in enumerate(zip(trajectories, placement)):
        rec = getattr(tr, "routed_experts", None)
        if rec is None:
            continue
        if tuple(rec.shape) != (n + 1, *routing_shape):
            raise ConfigError(
                f"trajectory {i}: routed_experts has shape {list(rec.shape)}, expected "
                f"[{n + 1} tokens, {routing_shape[0]} layers, top_k {routing_shape[1]}]"
            )
        out[row, start : start + n] = rec[:-1]
    return out


def pad_rows_pow2(batch: dict[str, np.ndarray], multiple: int) -> dict[str, np.ndarray]:
    """Pad a packed batch with empty rows to a power-of-two row count (also a multiple of
    ``multiple``), so a run compiles its step for a few row counts only."""
    rows = batch["input_ids"].shape[0]
    target = max(multiple, 1 << max(rows - 1, 0).bit_length())
    return _pad_rows_to(batch, -(-target // multiple) * multiple)


def _pad_rows_to(batch: dict[str, np.ndarray], target: int) -> dict[str, np.ndarray]:
    """``batch`` with empty rows appended up to ``target`` rows."""
    rows = batch["input_ids"].shape[0]
    if target == rows:
        return batch
    return {
        k: np.pad(
            v,
            [(0, target - rows)] + [(0, 0)] * (v.ndim - 1),
            constant_values=-1 if k == ROUTING_FIELD else 0,
        )
        for k, v in batch.items()
    }


def pad_rows_across_processes(batch: dict[str, np.ndarray], rows_multiple: int) -> dict[str, np.ndarray]:
    """``pad_rows_pow2`` for this process's share of a global batch: every JAX process pads its local
    rows to the same power-of-two count (the largest any of them needs), so the rows assemble into one
    global batch of ``rows_multiple``-divisible size. A collective (all processes call it each step);
    with one process it is ``pad_rows_pow2(batch, rows_multiple)``."""
    import jax

    from tmax_jax.distributed import allgather_json

    nproc = jax.process_count()
    if rows_multiple % nproc:
        raise ConfigError(
            f"rows_multiple {rows_multiple} (data * fsdp * micro_batches) is not divisible by the "
            f"{nproc} JAX processes: each must feed the same number of rows"
        )
    batch = pad_rows_pow2(batch, rows_multiple // nproc)
    return _pad_rows_to(batch, max(allgather_json(int(batch["input_ids"].shape[0]))))
