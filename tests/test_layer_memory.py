"""Training memory of the layer stack at the recipe's widths, from XLA's compiled memory analysis.

Compile only (abstract inputs, nothing runs). The bounds are the Gated DeltaNet issue's aims: the
backward pass through the delta rule keeps at most 4 KB per token per head, and one 9B layer period
(3 DeltaNet + 1 attention layer, remat="full") at most 0.35 MiB per token. Before the custom-VJP
delta rule and the per-layer checkpoints these were 29.2 KB and 1.41 MiB (at T=8192).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tmax_jax.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
from tmax_jax.models.qwen35.delta_rule import chunked_gated_delta_rule

MiB = 2**20


def _temp_bytes(fn, *args) -> int:
    return jax.jit(jax.value_and_grad(fn)).lower(*args).compile().memory_analysis().temp_size_in_bytes


def test_delta_rule_backward_keeps_under_4kb_per_token_per_head():
    B, T, H, D = 1, 4096, 4, 128
    bf16 = jnp.bfloat16

    def loss(q, k, v, g, beta):
        out, _ = chunked_gated_delta_rule(q, k, v, g, beta)
        return out.astype(jnp.float32).sum()

    qk = jax.ShapeDtypeStruct((B, T, H, D), bf16)
    gb = jax.ShapeDtypeStruct((B, T, H), jnp.float32)
    per_token_head = _temp_bytes(loss, qk, qk, qk, gb, gb) / (T * H)
    assert per_token_head <= 4096, f"{per_token_head:.0f} B/token/head"


def test_one_9b_layer_period_keeps_under_0_35_mib_per_token():
    """One period at 9B widths, bf16 compute, f32 parameters; the vocabulary cut to 1024 so that the
    embedding's T-independent gradient does not hide the per-token cost (bench_layer_memory.py)."""
    T = 8192
    cfg = Qwen35Config.preset("9b", vocab_size=1024, num_hidden_layers=4)
    model = nnx.eval_shape(
        lambda: Qwen35ForCausalLM(
            cfg, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=nnx.Rngs(0), remat="full"
        )
    )
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(p, ids):
        return nnx.merge(graphdef, p, rest).hidden_states(ids).astype(jnp.float32).sum()

    per_token = _temp_bytes(loss, params, jax.ShapeDtypeStruct((1, T), jnp.int32)) / T / MiB
    assert per_token <= 0.35, f"{per_token:.3f} MiB/token"
