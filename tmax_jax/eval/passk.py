"""Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code", Sec. 2.1).

With n attempts of which c passed, pass@k = 1 - C(n-c, k) / C(n, k): the chance that a random size-k
subset of the attempts holds at least one pass. The binomial ratio overflows for large n, so it is
evaluated as the product  prod_{i=n-c+1}^{n} (1 - k/i), every factor in [0, 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from tmax_jax.errors import ConfigError


def pass_at_k(n: int, c: int, k: int) -> float:
    """pass@k for one task with ``n`` attempts, ``c`` of them passing."""
    if not (
        isinstance(n, (int, np.integer))
        and isinstance(c, (int, np.integer))
        and isinstance(k, (int, np.integer))
    ):
        raise ConfigError(f"pass_at_k needs integers, got n={n!r}, c={c!r}, k={k!r}")
    if n < 1:
        raise ConfigError(f"pass_at_k: n (attempts) must be >= 1, got {n}")
    if not 0 <= c <= n:
        raise ConfigError(f"pass_at_k: c (passes) must be in [0, n={n}], got {c}")
    if not 1 <= k <= n:
        raise ConfigError(f"pass_at_k: k must be in [1, n={n}] (k attempts drawn from n), got {k}")
    if n - c < k:
        # Every size-k subset must contain a pass.
        return 1.0
    i = np.arange(n - c + 1, n + 1, dtype=np.float64)
    return float(1.0 - np.prod(1.0 - k / i))


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float | None:
    """Mean pass@k over tasks given ``(n, c)`` per task; tasks with fewer than k attempts are skipped.

    Returns None when no task has k attempts (nothing to average, which is not the same as 0).
    """
    values = [pass_at_k(n, c, k) for n, c in counts if n >= k]
    return float(np.mean(values)) if values else None


def pass_at_k_curve(counts: Sequence[tuple[int, int]], ks: Iterable[int]) -> dict[int, float | None]:
    return {k: mean_pass_at_k(counts, k) for k in ks}
