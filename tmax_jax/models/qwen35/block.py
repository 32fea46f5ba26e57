"""One period of the layer pattern (e.g. 3 Gated DeltaNet + 1 gated attention layers), each a
pre-norm residual mixer followed by a pre-norm residual SwiGLU; parameters stacked over periods."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tmax_jax.models.qwen35.attention import GatedAttention
from tmax_jax.models.qwen35.config import FULL, Qwen35Config
from tmax_jax.models.qwen35.deltanet import GatedDeltaNet
from tmax_jax.models.qwen35.mlp import SwiGLU
from tmax_jax.models.qwen35.moe import SparseMoeBlock
from tmax_jax.models.qwen35.norms import norm_init_value, rms_norm
from tmax_jax.models.qwen35.params import constant, make_param


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen35Config, kind: str, *, dtype, param_dtype, rngs: nnx.Rngs, stack: int):
        kw = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs, stack=stack)
        self.kind = kind
        self.eps = cfg.rms_norm_eps
        self.zero_centred = cfg.zero_centred_norms
        D = cfg.hidden_size
        norm_init = constant(norm_init_value(self.zero_centred))
        self.input_layernorm = make_param(rngs, norm_init, (D,), ("norm",), param_dtype, stack)
        self.post_attention_layernorm = make_param(rngs, norm_init, (D,), ("norm",), param_dtype, stack)
        if kind == FULL:
            self.self_attn = GatedAttention(cfg, **kw)
        else:
            self.linear_attn = GatedDeltaNet(cfg, **kw)
        self.is_moe = cfg.is_moe
        self.mlp = SparseMoeBlock(cfg, **kw) if cfg.is_moe else SwiGLU(cfg, **kw)

    def __call__(self, x, ctx, layer_cache):
        h = rms_norm(x, self.input_layernorm[...], self.eps, zero_centred=self.zero_centred)
        if self.kind == FULL:
            with jax.named_scope("gated_attention"):
                h, new_cache = self.self_attn(
                    h,
                    ctx["cos"],
                    ctx["sin"],
                    ctx["segment_ids"],
                    kv_cache=layer_cache,
                    lengths_B=ctx["lengths"],
                )
        else:
            with jax.named_scope("gated_deltanet"):
                h, new_cache = self.linear_attn(h, ctx["segment_ids"], ctx["groups"], state=layer_cache)
        x = x + h
        h = rms_norm(x, self.post_attention_layernorm[...], self.eps, zero_centred=self.zero_centred)
        if self.is_moe:
            with jax.named_scope("moe"):
                h, stats = self.mlp(h, ctx["segment_ids"] > 0)
            if ctx.get("router_stats") is not None:
                ctx["router_stats"].append(stats)
            return x + h, new_cache
        with jax.named_scope("mlp"):
            x = x + self.mlp(h)
        return x, new_cache


def recompute_in_backward(fn, params, x, consts):
    """``fn(params, x, consts)``, whose backward pass recomputes it from its arguments alone: a
    hand-made checkpoint that keeps nothing else.

    jax.checkpoint is not enough on every backend: XLA's CPU pipeline drops optimization barriers,
    then schedules recomputes early or merges them with the forward pass's identical ops, and a
    rematerialised period holds every layer's internals at once. Here the recompute reads its input
    through a data dependency on the output's cotangent, so it runs only when its backward does.
    """

    @jax.custom_vjp
    def apply(params, x, consts):
        return fn(params, x, consts)

    def fwd(params, x, consts):
        return fn(params, x, consts), (params, x, consts)

    def bwd(res, g):
        params, x, consts = res
        # x * 0 is not folded for floats, so no pass removes this dependency.
        x = x + (jnp.sum(g, dtype=jnp.float32) * 0.0).astype(x.dtype)
        (params, x, consts), g = jax.lax.optimization_barrier(((params, x, consts), g))
        return jax.vjp(fn, params, x, consts)[1](g)

    apply.defvjp(fwd, bwd)
    return apply(params, x, consts)


def _checkpointed(layer: DecoderLayer, x, ctx):
    graphdef, state = nnx.split(layer)

    def run(state, x, ctx):
        return nnx.merge(graphdef, state)(checkpoint_name(x, "layer_input"), ctx, None)[0]

    return recompute_in_backward(run, state, x, ctx)


class PatternBlock(nnx.Module):
    """The layers of one pattern period; every parameter has a leading ``layers`` axis of num_groups."""

    def __init__(self, cfg: Qwen35Config, *, dtype, param_dtype, rngs: nnx.Rngs):
        self.pattern = cfg.layer_pattern
        self.layers = nnx.List(
            [
                DecoderLayer(cfg, kind, dtype=dtype, param_dtype=param_dtype, rngs=rngs, stack=cfg.num_groups)
                for kind in self.pattern
            ]
        )

    def __call__(self, x, ctx, caches, *, remat_layers: bool = False):
        """``caches``: (k, v, conv, recurrent) slices of one period (leading axis = layer within the
        period, per kind) or None.

        ``remat_layers``: each layer is its own ``jax.checkpoint`` (nothing saved but its input, named
        ``layer_input``), so a backward pass through the period holds one layer's internals at a time.
        """
        if remat_layers and caches is None:
            for layer in self.layers:
                x = _checkpointed(layer, x, ctx)
            return x, None
        fi = li = 0
        new_k, new_v, new_conv, new_rec = [], [], [], []
        for kind, layer in zip(self.pattern, self.layers):
            if kind == FULL:
                lc = None if caches is None else (caches[0][fi], caches[1][fi])
                x, nc = layer(x, ctx, lc)
                if nc is not None:
                    new_k.append(nc[0])
                    new_v.append(nc[1])
                fi += 1
            else:
                lc = None if caches is None else (caches[2][li], caches[3][li])
                x, nc = layer(x, ctx, lc)
                if nc is not None:
                    new_conv.append(nc[0])
                    new_rec.append(nc[1])
                li += 1
        if caches is None:
            return x, None

        def stack(items, like):
            return jnp.stack(items) if items else like

        return x, (
            stack(new_k, caches[0]),
            stack(new_v, caches[1]),
            stack(new_conv, caches[2]),
            stack(new_rec, caches[3]),
        )
