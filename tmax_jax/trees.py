"""Checks on pytrees of arrays that must match another's layout (weights swapped into a running
engine, a restored optimiser state)."""

from __future__ import annotations

from typing import Any

import jax

from tmax_jax.errors import ConfigError


def check_like(ref: Any, new: Any, what: str) -> None:
    """Raise ``ConfigError`` (prefixed ``what``) unless ``new`` has ``ref``'s tree structure and each
    leaf its shape and dtype; the message names the first leaf that differs."""
    ref_leaves, ref_def = jax.tree_util.tree_flatten_with_path(ref)
    new_leaves, new_def = jax.tree.flatten(new)
    if ref_def != new_def:
        raise ConfigError(
            f"{what}: a tree of another structure ({len(new_leaves)} arrays where {len(ref_leaves)} are "
            "expected, or other names)"
        )
    for (path, a), b in zip(ref_leaves, new_leaves):
        if a.shape != b.shape or a.dtype != b.dtype:
            raise ConfigError(
                f"{what}: {jax.tree_util.keystr(path)} is {b.dtype}{list(b.shape)}, expected "
                f"{a.dtype}{list(a.shape)}"
            )
