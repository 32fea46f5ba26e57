"""Qwen 3.5's multi-token-prediction (MTP) module, the draft model of speculative decoding.

Published Qwen 3.5 checkpoints carry it as ``mtp.*`` tensors (transformers ignores them). At
position ``i`` it reads the target's final-norm hidden state ``h_i`` and the embedding of the token
at ``i + 1`` and predicts the token at ``i + 2``:

    x   = fc([norm_e(embed(t_{i+1})), norm_h(h_i)])      fc: [2D] -> [D], no bias
    x   = decoder layers (full gated attention + MLP, the target's layer kind), at position i
    out = norm(x); logits = the target's head(out)

The embedding and head are the target model's. The layers attend over their own KV cache; its rows
are those of the target's (one MTP position per target position), so it rides in the engine's cache
as extra attention layers (``Qwen35Cache.k[num_full_layers:]``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from tmax_jax.models.qwen35.block import DecoderLayer
from tmax_jax.models.qwen35.cache import Qwen35Cache
from tmax_jax.models.qwen35.config import FULL, Qwen35Config
from tmax_jax.models.qwen35.norms import norm_init_value, rms_norm
from tmax_jax.models.qwen35.params import constant, make_param, normal
from tmax_jax.models.qwen35.rope import rope_cos_sin


class MultiTokenPredictor(nnx.Module):
    def __init__(self, cfg: Qwen35Config, num_layers: int = 1, *, dtype=jnp.float32, param_dtype=jnp.float32,
                 rngs: nnx.Rngs):  # fmt: skip
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(
                f"MultiTokenPredictor: num_layers must be a positive integer, got {num_layers!r}"
            )
        D = cfg.hidden_size
        self.config = cfg
        self.num_layers = num_layers
        self.dtype = jnp.dtype(dtype)
        norm_init = constant(norm_init_value(cfg.zero_centred_norms))
        self.pre_fc_norm_embedding = make_param(rngs, norm_init, (D,), ("norm",), param_dtype, None)
        self.pre_fc_norm_hidden = make_param(rngs, norm_init, (D,), ("norm",), param_dtype, None)
        self.fc = make_param(
            rngs, normal(cfg.initializer_range), (2 * D, D), (None, "embed"), param_dtype, None
        )
        self.layers = DecoderLayer(
            cfg, FULL, dtype=self.dtype, param_dtype=param_dtype, rngs=rngs, stack=num_layers
        )
        self.norm = make_param(rngs, norm_init, (D,), ("norm",), param_dtype, None)

    def kv_shapes(self, batch_size: int, max_len: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One layer's (K, V) cache shapes, the target's attention-layer layout."""
        return Qwen35Cache.kv_shapes(self.config, batch_size, max_len)

    def __call__(self, embed_VxD, hidden_BxTxD, next_ids_BxT, positions_BxT, segment_ids_BxT,
                 kv: tuple | None = None, lengths_B=None, fresh_cache: bool = False):  # fmt: skip
        """(final-norm MTP hidden states ``[B, T, D]``, new ``kv``).

        ``embed_VxD``: the target's token embedding. ``hidden_BxTxD``: the target's (or, when
        drafting further ahead, this module's own) final-norm hidden states; ``next_ids_BxT``: the
        token after each position. ``kv``: ((k, v) per layer) with ``lengths_B`` tokens cached per
        row, written at ``lengths_B + t`` for valid tokens (segment id > 0), or None (no cache:
        ``segment_ids`` pack sequences as in the target's forward). ``fresh_cache``: ``kv`` holds
        nothing yet (``Qwen35ForCausalLM.hidden_states``' flag of that name)."""
        cfg, dt = self.config, self.dtype
        eps, zc = cfg.rms_norm_eps, cfg.zero_centred_norms
        e_BxTxD = jnp.take(embed_VxD, next_ids_BxT, axis=0).astype(dt)
        e_BxTxD = rms_norm(e_BxTxD, self.pre_fc_norm_embedding[...], eps, zero_centred=zc)
        h_BxTxD = rms_norm(hidden_BxTxD.astype(dt), self.pre_fc_norm_hidden[...], eps, zero_centred=zc)
        x_BxTxD = jnp.einsum(
            "btc,cd->btd", jnp.concatenate([e_BxTxD, h_BxTxD], axis=-1), self.fc[...].astype(dt)
        )
        cos, sin = rope_cos_sin(positions_BxT, cfg.rotary_dim, cfg.rope_theta, cfg.yarn)
        seg = jnp.asarray(segment_ids_BxT).astype(jnp.int32)
        ctx = dict(cos=cos, sin=sin, segment_ids=seg, groups=None, lengths=lengths_B)
        if fresh_cache and kv is not None:
            ctx["fresh_cache"] = True
        graphdef, state = nnx.split(self.layers)
        new_kv = []
        for i in range(self.num_layers):
            layer = nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], state))
            x_BxTxD, cache_i, _ = layer(x_BxTxD, ctx, None if kv is None else kv[i])
            new_kv.append(cache_i)
        out = rms_norm(x_BxTxD, self.norm[...], eps, zero_centred=zc)
        return out, (None if kv is None else tuple(new_kv))


def oracle_draft(model, mix: float = 0.0, mtp: MultiTokenPredictor | None = None):
    """``(model', mtp')``: a copy of ``model`` whose mixers and MLPs write ``mix`` times their outputs,
    and a one-layer module (a copy of ``mtp``'s, else a new one) that passes the embedding of the
    token it is fed, unchanged, to the model's final norm. At ``mix`` 0 every logit row of ``model'``
    is a function of the fed token alone and the draft predicts it exactly (the mechanics' best case:
    benchmarks, tests); above 0 the model's states decide part of it and the draft is right only
    part of the time. A diagnostic, not a way to train a draft."""
    model = nnx.clone(model)
    for layer in model.blocks.layers:
        mixer = layer.self_attn.o_proj if hasattr(layer, "self_attn") else layer.linear_attn.out_proj
        for w in (mixer, layer.mlp.down_proj):
            w.set_value((mix * w[...].astype(jnp.float32)).astype(w[...].dtype))
    cfg, D = model.config, model.config.hidden_size
    if mtp is None:
        mtp = MultiTokenPredictor(cfg, 1, dtype=model.dtype, param_dtype=model.param_dtype, rngs=nnx.Rngs(1))
    else:
        mtp = nnx.clone(mtp)

    def put(param, value):
        param.set_value(jnp.asarray(value, param[...].dtype))

    put(mtp.fc, jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))]))  # keep the embedding half
    put(mtp.pre_fc_norm_embedding, jnp.full((D,), norm_init_value(cfg.zero_centred_norms)))
    put(mtp.norm, model.norm[...])
    for w in (mtp.layers.self_attn.o_proj, mtp.layers.mlp.down_proj):  # the layer adds nothing
        put(w, jnp.zeros(w[...].shape))
    return model, mtp
