"""pass@k against the closed form (exact rationals) and brute-force enumeration of k-subsets."""

import itertools
import math
from fractions import Fraction

import pytest

from tmax_jax.errors import ConfigError
from tmax_jax.eval.passk import mean_pass_at_k, pass_at_k, pass_at_k_curve


def _closed_form(n: int, c: int, k: int) -> Fraction:
    return 1 - Fraction(math.comb(n - c, k), math.comb(n, k))


def _brute_force(n: int, c: int, k: int) -> Fraction:
    outcomes = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(any(outcomes[i] for i in s) for s in subsets)
    return Fraction(hits, len(subsets))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_matches_brute_force_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(_brute_force(n, c, k)), abs=1e-12), (n, c, k)


@pytest.mark.parametrize("n,c,k", [(200, 3, 10), (1000, 10, 100), (1000, 1, 1), (5000, 4000, 50), (64, 0, 8)])
def test_matches_closed_form_for_large_n(n, c, k):
    # math.comb(5000, 50) is far beyond float range: the product form must still be exact to ~1e-12.
    assert pass_at_k(n, c, k) == pytest.approx(float(_closed_form(n, c, k)), abs=1e-12)


def test_pass_at_1_is_the_pass_rate():
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_mean_skips_tasks_with_too_few_attempts():
    counts = [(4, 1), (4, 0), (2, 2)]
    expected = (float(_closed_form(4, 1, 3)) + 0.0) / 2
    assert mean_pass_at_k(counts, 3) == pytest.approx(expected)
    assert mean_pass_at_k([(2, 1)], 3) is None
    curve = pass_at_k_curve(counts, [1, 2])
    assert curve[1] == pytest.approx((0.25 + 0.0 + 1.0) / 3)


@pytest.mark.parametrize("n,c,k,word", [(0, 0, 1, "n"), (3, 4, 1, "c"), (3, 1, 4, "k"), (3, 1, 0, "k")])
def test_bad_input_names_the_argument(n, c, k, word):
    with pytest.raises(ConfigError, match=rf"\b{word}\b"):
        pass_at_k(n, c, k)
