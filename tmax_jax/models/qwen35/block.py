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
from tmax_jax.sharding import gather_tokens, shard_tokens


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

    def __call__(self, x, ctx, layer_cache, replay=None):
        """(output, new layer cache or None, aux): ``aux`` is empty for a dense MLP; for MoE,
        ``{"router_stats": RouterStats, "experts": int32 [B, T, K]}`` (the expert ids used).
        ``replay``: int [B, T, K] expert ids to route by (routing replay; -1 rows route as usual).

        Without a cache the residual stream is split over tokens by the ``sequence`` rule (sharding.py;
        under a mesh only): the norms run on each device's tokens, the mixer and the MLP get every
        token, and their outputs are reduce-scattered back. Decoding with a cache is left as it was."""
        seq_split = layer_cache is None
        split = shard_tokens if seq_split else (lambda a: a)
        gather = gather_tokens if seq_split else (lambda a: a)
        x = split(x)
        h = gather(rms_norm(x, self.input_layernorm[...], self.eps, zero_centred=self.zero_centred))
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
        x = split(x + h)
        h = gather(rms_norm(x, self.post_attention_layernorm[...], self.eps, zero_centred=self.zero_centred))
        if self.is_moe:
            with jax.named_scope("moe"):
                h, stats, experts = self.mlp(h, ctx["segment_ids"] > 0, replay)
            return split(x + h), new_cache, {"router_stats": stats, "experts": experts}
        with jax.named_scope("mlp"):
            x = split(x + self.mlp(h))
        return x, new_cache, {}


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
        # fn may return (x, aux): the anchor is the first output's cotangent (aux may hold integer
        # outputs, whose float0 cotangents stay out of the barrier).
        g_x, rest = (g[0], g[1:]) if isinstance(g, tuple) else (g, None)
        # x * 0 is not folded for floats, so no pass removes this dependency.
        x = x + (jnp.sum(g_x, dtype=jnp.float32) * 0.0).astype(x.dtype)
        (params, x, consts), g_x = jax.lax.optimization_barrier(((params, x, consts), g_x))
        return jax.vjp(fn, params, x, consts)[1](g_x if rest is None else (g_x, *rest))

    apply.defvjp(fwd, bwd)
    return apply(params, x, consts)


def _checkpointed(layer: DecoderLayer, x, ctx, replay, collect):
    graphdef, state = nnx.split(layer)

    def run(state, x, consts):
        ctx, replay = consts
        out, _, aux = nnx.merge(graphdef, state)(checkpoint_name(x, "layer_input"), ctx, None, replay)
        return (out, {k: aux[k] for k in collect}) if collect else out

    out = recompute_in_backward(run, state, x, (ctx, replay))
    return out if collect else (out, {})


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

    def __call__(self, x, ctx, caches, *, remat_layers: bool = False, replay=None, collect=()):
        """(output, new caches or None, aux). ``caches``: (k, v, conv, recurrent) slices of one
        period (leading axis = layer within the period, per kind) or None.

        ``remat_layers``: each layer is its own ``jax.checkpoint`` (nothing saved but its input, named
        ``layer_input``), so a backward pass through the period holds one layer's internals at a time.
        ``replay``: int ``[P, B, T, K]`` expert ids per layer of the period (MoE routing replay).
        ``collect``: MoE layer outputs to return in ``aux``, each stacked over the period's layers
        (``"router_stats"``, ``"experts"``).
        """
        collect = tuple(collect)
        auxes = []
        if remat_layers and caches is None:
            for i, layer in enumerate(self.layers):
                x, aux = _checkpointed(layer, x, ctx, None if replay is None else replay[i], collect)
                auxes.append(aux)
            return x, None, _stack_aux(auxes, collect)
        fi = li = 0
        new_k, new_v, new_conv, new_rec = [], [], [], []
        for i, (kind, layer) in enumerate(zip(self.pattern, self.layers)):
            rp = None if replay is None else replay[i]
            if kind == FULL:
                lc = None if caches is None else (caches[0][fi], caches[1][fi])
                x, nc, aux = layer(x, ctx, lc, rp)
                if nc is not None:
                    new_k.append(nc[0])
                    new_v.append(nc[1])
                fi += 1
            else:
                lc = None if caches is None else (caches[2][li], caches[3][li])
                x, nc, aux = layer(x, ctx, lc, rp)
                if nc is not None:
                    new_conv.append(nc[0])
                    new_rec.append(nc[1])
                li += 1
            auxes.append({k: aux[k] for k in collect})
        aux = _stack_aux(auxes, collect)
        if caches is None:
            return x, None, aux

        def stack(items, like):
            return jnp.stack(items) if items else like

        return (
            x,
            (
                stack(new_k, caches[0]),
                stack(new_v, caches[1]),
                stack(new_conv, caches[2]),
                stack(new_rec, caches[3]),
            ),
            aux,
        )

    def decode(self, x, ctx, caches, first, *, replay=None, collect=()):
        """(output, new caches, new conv states, aux) with ``caches`` = (k, v, conv, recurrent) of
        *every* layer (``Qwen35Cache``'s stacked arrays) and ``first`` = (the index of this period's
        first attention layer, of its first DeltaNet layer) in them. Attention layers write their new
        keys and values, DeltaNet layers their recurrent state, into the stacked arrays in place (no
        per-period slices stacked and written back). The new conv states come back one per DeltaNet
        layer, for the caller to stack once every layer has read the old ones: XLA fuses the read of
        a layer's old conv rows into many of its consumers, and an in-place write before the last of
        them would make it copy the whole array at every layer."""
        collect = tuple(collect)
        k, v, conv, rec = caches
        fa, la = first
        auxes, convs = [], []
        for i, (kind, layer) in enumerate(zip(self.pattern, self.layers)):
            rp = None if replay is None else replay[i]
            if kind == FULL:
                x, (k, v), aux = layer(x, ctx, (k, v, fa), rp)
                fa += 1
            else:
                x, (c, r), aux = layer(x, ctx, (conv[la], rec[la]), rp)
                convs.append(c.astype(conv.dtype))
                rec = rec.at[la].set(r.astype(rec.dtype))
                la += 1
            auxes.append({name: aux[name] for name in collect})
        return x, (k, v, conv, rec), convs, _stack_aux(auxes, collect)


def _stack_aux(auxes, collect):
    """Per-layer aux dicts -> one dict of arrays stacked over the period's layers."""
    return {k: jax.tree.map(lambda *a: jnp.stack(a), *(a[k] for a in auxes)) for k in collect}
