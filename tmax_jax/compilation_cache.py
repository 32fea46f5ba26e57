"""JAX's persistent compilation cache, shared by every tmax-jax command that compiles."""

from __future__ import annotations

import os
from pathlib import Path


def enable_compilation_cache(min_compile_secs: float = 2.0) -> str:
    """Keep compiled train/engine steps on disk, so a resumed or repeated run skips recompiling.

    Each distinct packed-row count compiles the train step once (tens of seconds on a laptop CPU);
    JAX's persistent cache makes that a one-time cost per machine. ``JAX_COMPILATION_CACHE_DIR``
    wins when set (the TPU launcher sets it); otherwise ``~/.cache/tmax-jax/jax``. Only executables
    that took ``min_compile_secs`` or more to build get a disk entry
    (``JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS`` wins when set). JAX writes entries whole under a
    file lock, so processes sharing the directory are safe.
    """
    import jax

    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(Path.home() / ".cache" / "tmax-jax" / "jax")
    jax.config.update("jax_compilation_cache_dir", path)
    secs = os.environ.get("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS") or min_compile_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", float(secs))
    return path
