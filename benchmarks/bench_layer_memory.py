"""Temporaries of training through one 9B layer period, from XLA's compiled memory analysis.

One period of Qwen 3.5 9B (3 Gated DeltaNet + 1 gated attention layer, each with its MLP; 9B widths),
bfloat16 compute, float32 parameters, built abstractly (``nnx.eval_shape``: no weights allocated):
``jax.jit(jax.value_and_grad(f)).lower(...).compile().memory_analysis().temp_size_in_bytes`` for
``f(params) = sum(model.hidden_states(ids))``, gradients for every parameter. The vocabulary is cut to
1024 so that the embedding's gradient (248320 x 4096 float32 = 3.8 GiB, independent of T) does not
hide the per-token cost. Printed per T as MiB/token (total / T) and as the slope between consecutive
T (the marginal cost of one more token). Compiling only, nothing runs.

    python benchmarks/bench_layer_memory.py
    python benchmarks/bench_layer_memory.py --seqs 4096,16384 --remat full,dots
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from flax import nnx

from tmax_jax.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

MiB = 2**20


def period_temp_bytes(seq: int, remat: str, rows: int = 1, preset: str = "9b", periods: int = 1) -> int:
    cfg = Qwen35Config.preset(preset, vocab_size=1024, num_hidden_layers=4 * periods)
    model = nnx.eval_shape(
        lambda: Qwen35ForCausalLM(
            cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0), remat=remat
        )
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, ids):
        return nnx.merge(graphdef, p, rest).hidden_states(ids).astype(jnp.float32).sum()

    ids = jax.ShapeDtypeStruct((rows, seq), jnp.int32)
    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, ids).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="2048,4096,8192")
    ap.add_argument("--remat", default="full")
    ap.add_argument("--preset", default="9b")
    ap.add_argument("--periods", type=int, default=1, help="stack this many periods (scanned)")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    print(
        f"{args.periods} x one {args.preset} layer period (3 DeltaNet + 1 attention), bf16 compute, "
        "f32 params, B=1"
    )
    print(f"{'remat':>8} {'T':>7} {'temp MiB':>10} {'MiB/token':>10} {'slope MiB/token':>16}")
    for remat in args.remat.split(","):
        prev = None
        for T in seqs:
            b = period_temp_bytes(T, remat, preset=args.preset, periods=args.periods)
            slope = "" if prev is None else f"{(b - prev[1]) / (T - prev[0]) / MiB:16.3f}"
            print(f"{remat:>8} {T:>7} {b / MiB:10.1f} {b / T / MiB:10.3f} {slope}", flush=True)
            prev = (T, b)


if __name__ == "__main__":
    main()
