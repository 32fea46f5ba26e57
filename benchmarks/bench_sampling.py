"""Sampling cost per decode step at Qwen 3.5's vocabulary: top-p from a partial top-k (the engine's
path) against the full-vocabulary sort it replaces, and against no truncation, in one run; then the
Gumbel noise of a sampled step, the engine's unrolled Threefry against ``jax.random.gumbel``.

    python3 benchmarks/bench_sampling.py [--slots 16] [--vocab 248320] [--top-p 0.95] [--repeats 3]

The logits are peaked the way a language model's are (a few tokens hold most of the mass; scaled
Gaussian logits, reported with the mass of their 256 largest), and with one flat row. The partial
path is exact: it falls back to the sort for any step where some row's nucleus is not inside its 256
largest logits (the second case).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from tmax_jax.engine.sampling import gumbel_rows
from tmax_jax.rl.logprobs import PARTIAL_TOP_K, truncate, truncation_threshold


def timed(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--top-p", type=float, default=0.95)
    ap.add_argument("--scale", type=float, default=8.0, help="std of the Gaussian logits")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    k_S = jnp.zeros((args.slots,), jnp.int32)
    p_S = jnp.full((args.slots,), args.top_p, jnp.float32)
    partial = jax.jit(lambda z, k, p: truncate(z, k, p))
    full = jax.jit(lambda z, k, p: jnp.where(z >= truncation_threshold(z, k, p)[:, None], z, -jnp.inf))
    none = jax.jit(lambda z: truncate(z, None, None))
    print(f"{args.slots} slots x {args.vocab} vocab, top_p {args.top_p} ({jax.default_backend()})")
    peaked = rng.normal(size=(args.slots, args.vocab)) * args.scale
    one_flat = peaked.copy()
    one_flat[-1] *= 0.3 / args.scale  # one row whose nucleus spans tens of thousands of tokens
    for name, z in (("peaked rows", peaked), ("one flat row", one_flat)):
        logits = jnp.asarray(z, jnp.float32)
        probs = np.asarray(jax.nn.softmax(logits, axis=-1))
        head_mass = np.sort(probs, axis=-1)[:, ::-1][:, :PARTIAL_TOP_K].sum(-1)
        same = bool(jnp.all(partial(logits, k_S, p_S) == full(logits, k_S, p_S)))
        t_partial = timed(partial, logits, k_S, p_S, repeats=args.repeats)
        t_full = timed(full, logits, k_S, p_S, repeats=args.repeats)
        t_none = timed(none, logits, repeats=args.repeats)
        print(
            f"{name}: mass of the {PARTIAL_TOP_K} largest logits min {head_mass.min():.4f}; full sort "
            f"{t_full:.1f} ms, engine path {t_partial:.1f} ms (same kept logits: {same}), no truncation "
            f"{t_none:.1f} ms; sort / engine {t_full / t_partial:.2f}x"
        )
    keys = jax.random.split(jax.random.key(0), args.slots)
    V = args.vocab
    ours = jax.jit(lambda k: gumbel_rows(k, V))
    theirs = jax.jit(lambda k: jax.vmap(lambda r: jax.random.gumbel(r, (V,), jnp.float32))(k))
    same = bool(jnp.all(ours(keys) == theirs(keys)))
    t_ours, t_theirs = timed(ours, keys, repeats=args.repeats), timed(theirs, keys, repeats=args.repeats)
    print(
        f"gumbel noise {args.slots} x {V}: jax.random.gumbel {t_theirs:.1f} ms, engine {t_ours:.1f} ms "
        f"(bit-identical: {same}); {t_theirs / t_ours:.2f}x"
    )


if __name__ == "__main__":
    main()
