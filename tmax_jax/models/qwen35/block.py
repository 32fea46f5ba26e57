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
from tmax_jax.models.qwen35.remat import recompute_in_backward
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

    @property
    def mixer(self):
        return self.self_attn if self.kind == FULL else self.linear_attn

    def __call__(self, x, ctx, layer_cache, replay=None):
        """(output, new layer cache or None, aux): ``aux`` is empty for a dense MLP; for MoE,
        ``{"router_stats": RouterStats, "experts": int32 [B, T, K]}`` (the expert ids used).
        ``replay``: int [B, T, K] expert ids to route by (routing replay; -1 rows route as usual).

        Without a cache the residual stream is split over tokens by the ``sequence`` rule (sharding.py;
        under a mesh only): the norms run on each device's tokens, the mixer and the MLP get every
        token, and their outputs are reduce-scattered back. Decoding with a cache is left as it was."""
        x, new_cache = _mix_half(self, self.input_layernorm[...], self.mixer, x, ctx, layer_cache)
        x, aux = _mlp_half(
            self, self.post_attention_layernorm[...], self.mlp, x, ctx, replay, layer_cache is None
        )
        return x, new_cache, aux


def _mix_half(layer: DecoderLayer, norm_w, mixer, x, ctx, layer_cache, stages: bool = False):
    """``x + mixer(norm(x))`` and the mixer's new cache. ``layer`` gives static settings only; the
    weights come in as ``norm_w`` and ``mixer`` (so a checkpoint can pass them explicitly).
    ``stages``: the mixer checkpoints its stages (GatedDeltaNet / GatedAttention ``__call__``)."""
    seq_split = layer_cache is None
    split = shard_tokens if seq_split else (lambda a: a)
    gather = gather_tokens if seq_split else (lambda a: a)
    x = split(x)
    h = gather(rms_norm(x, norm_w, layer.eps, zero_centred=layer.zero_centred))
    if layer.kind == FULL:
        with jax.named_scope("gated_attention"):
            h, new_cache = mixer(
                h,
                ctx["cos"],
                ctx["sin"],
                ctx["segment_ids"],
                kv_cache=layer_cache,
                lengths_B=ctx["lengths"],
                stages=stages,
                fresh=ctx.get("fresh_cache", False),
            )
    else:
        with jax.named_scope("gated_deltanet"):
            h, new_cache = mixer(
                h,
                ctx["segment_ids"],
                ctx["groups"],
                state=layer_cache,
                stages=stages,
                keep_states=ctx.get("keep_states", False),
            )
    return split(x + h), new_cache


def _mlp_half(layer: DecoderLayer, norm_w, mlp, x, ctx, replay, seq_split: bool):
    """``x + mlp(norm(x))`` and the MoE aux dict (empty for a dense MLP)."""
    split = shard_tokens if seq_split else (lambda a: a)
    gather = gather_tokens if seq_split else (lambda a: a)
    h = gather(rms_norm(x, norm_w, layer.eps, zero_centred=layer.zero_centred))
    if layer.is_moe:
        with jax.named_scope("moe"):
            h, stats, experts = mlp(h, ctx["segment_ids"] > 0, replay)
        return split(x + h), {"router_stats": stats, "experts": experts}
    with jax.named_scope("mlp"):
        return split(x + mlp(h)), {}


def _checkpointed(layer: DecoderLayer, x, ctx, replay, collect):
    """One layer as two hand-made checkpoints, the mixer half and the MLP half: the backward pass
    recomputes each half only when it reaches it, so the MLP's backward never runs beside the
    mixer's recomputed internals. Each half saves its input (named ``layer_input`` / ``mlp_input``)."""
    mixer_def, mixer_state = nnx.split(layer.mixer)
    mlp_def, mlp_state = nnx.split(layer.mlp)

    def run_mix(state, x, ctx):
        norm_w, mixer_state = state
        x = checkpoint_name(x, "layer_input")
        return _mix_half(layer, norm_w, nnx.merge(mixer_def, mixer_state), x, ctx, None, stages=True)[0]

    def run_mlp(state, x, consts):
        ctx, replay = consts
        norm_w, mlp_state = state
        x = checkpoint_name(x, "mlp_input")
        out, aux = _mlp_half(layer, norm_w, nnx.merge(mlp_def, mlp_state), x, ctx, replay, True)
        return (out, {k: aux[k] for k in collect}) if collect else out

    x = recompute_in_backward(run_mix, (layer.input_layernorm[...], mixer_state), x, ctx)
    out = recompute_in_backward(run_mlp, (layer.post_attention_layernorm[...], mlp_state), x, (ctx, replay))
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
        """(output, new caches, aux) with ``caches`` = (k, v, conv, recurrent): lists of *every*
        layer's arrays (``Qwen35Cache``'s), and ``first`` = (the index of this period's first
        attention layer, of its first DeltaNet layer) in them. Each layer reads its own buffers and
        its new ones replace them in the lists (in place under jit: no stacked array is sliced or
        written back)."""
        collect = tuple(collect)
        k, v, conv, rec = (list(c) for c in caches)
        fa, la = first
        auxes = []
        for i, (kind, layer) in enumerate(zip(self.pattern, self.layers)):
            rp = None if replay is None else replay[i]
            if kind == FULL:
                x, (k[fa], v[fa]), aux = layer(x, ctx, (k[fa], v[fa]), rp)
                fa += 1
            else:
                x, (c, r), aux = layer(x, ctx, (conv[la], rec[la]), rp)
                conv[la], rec[la] = c.astype(conv[la].dtype), r.astype(rec[la].dtype)
                la += 1
            auxes.append({name: aux[name] for name in collect})
        return x, (k, v, conv, rec), _stack_aux(auxes, collect)


def _stack_aux(auxes, collect):
    """Per-layer aux dicts -> one dict of arrays stacked over the period's layers."""
    return {k: jax.tree.map(lambda *a: jnp.stack(a), *(a[k] for a in auxes)) for k in collect}
