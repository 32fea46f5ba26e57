"""Qwen 3.5 text decoder for causal LM, pure JAX/nnx, with a float32 LM head.

Layers of one ``layer_pattern`` period are stacked along a leading ``layers`` axis and run with
``jax.lax.scan``, so compile time does not grow with depth (unrolled up to ``UNROLL_MAX_PERIODS``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from tmax_jax.errors import ConfigError
from tmax_jax.models.qwen35.block import PatternBlock
from tmax_jax.models.qwen35.cache import Qwen35Cache
from tmax_jax.models.qwen35.config import Qwen35Config
from tmax_jax.models.qwen35.moe import RouterStats  # noqa: F401  (router_aux_loss's argument)
from tmax_jax.models.qwen35.norms import norm_init_value, rms_norm
from tmax_jax.models.qwen35.params import constant, make_param, normal
from tmax_jax.models.qwen35.remat import recompute_in_backward
from tmax_jax.models.qwen35.rope import rope_cos_sin
from tmax_jax.rl.logprobs import head_logits
from tmax_jax.sharding import shard_tokens

f32 = jnp.float32
# Without a cache, models of up to this many layer periods unroll the period loop: a scan keeps
# compile time flat in depth, but at 2 periods the unrolled loop compiles no slower (75M model's train
# step: 8.3 vs 9.7 s) and runs 4-7% faster on CPU (no per-step slices of the stacked weights, no
# stacked gradient updates); at 4 and 8 periods it compiled 4 s and 12 s slower.
UNROLL_MAX_PERIODS = 2

# Per-layer weights up to this many elements (norm scales, conv taps, decay parameters): see
# _split_small_weights.
_SMALL_WEIGHT_ELEMENTS = 1 << 16


class _PeriodWeights(NamedTuple):
    """Period g's big weights (sliced by the loop), g, and every period's small weights, stacked
    (``None`` while in the loop's inputs); ``assemble`` makes the period's state of them."""

    big: list
    g: jax.Array
    small: list | None


def _split_small_weights(block_state, G: int):
    """(the big weights, stacked; the small ones, stacked; ``assemble(_PeriodWeights)`` -> a state).

    Inside the loop over layer periods every weight is a dynamic slice of its stacked array. XLA
    fuses the slice of a small weight into each elementwise op that reads it, which then recomputes
    the sliced index for every element it writes: on CPU the conv + SiLU fusion over [1024, 1536]
    took ~5 ms, against 0.8 ms for the same op alone, and the conv was fused (and sliced) again into
    the q, k and v consumers. (An ``optimization_barrier`` does not help: XLA removes it before
    fusing.) Here the small weights stay out of the loop's slicing: period g reads them as
    ``onehot(g) @ stacked``, a tiny dot XLA never fuses into an elementwise op, in full precision so
    it is exact. Big weights (matmul operands) are sliced by the loop as before."""
    leaves, treedef = jax.tree.flatten(block_state)
    small = [i for i, a in enumerate(leaves) if a.size // G <= _SMALL_WEIGHT_ELEMENTS]
    small_set = set(small)
    big = [a for i, a in enumerate(leaves) if i not in small_set]
    small_stacked = [leaves[i] for i in small]

    def assemble(pw: _PeriodWeights):
        onehot = jnp.arange(G) == pw.g
        picked = iter(
            jnp.tensordot(onehot.astype(a.dtype), a, axes=1, precision=jax.lax.Precision.HIGHEST)
            for a in pw.small
        )
        rest = iter(pw.big)
        return jax.tree.unflatten(
            treedef, [next(picked) if i in small_set else next(rest) for i in range(len(leaves))]
        )

    return big, small_stacked, assemble


_REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "layers": None,  # the layers' own checkpoints only: nothing wraps the period
    "dots": jax.checkpoint_policies.checkpoint_dots,
}


def packed_positions_and_groups(segment_ids_BxT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-segment positions (restarting at each packed segment) and the segment-start count.

    A segment starts where the id changes to a positive one; pads (id 0) keep the count of the
    segment before them, so they join its recurrence as no-ops.
    """
    B, T = segment_ids_BxT.shape
    prev = jnp.pad(segment_ids_BxT, ((0, 0), (1, 0)), constant_values=-1)[:, :T]
    starts_BxT = (segment_ids_BxT > 0) & (segment_ids_BxT != prev)
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    start_idx = jax.lax.cummax(jnp.where(starts_BxT, idx, 0), axis=1)
    groups_BxT = jnp.cumsum(starts_BxT.astype(jnp.int32), axis=1)
    return idx - start_idx, groups_BxT


def unstack_periods(block_state, num_periods: int) -> tuple:
    """A stacked block state (leading axis = layer period) as ``num_periods`` states, one per period."""
    return tuple(jax.tree.map(lambda a, g=g: a[g], block_state) for g in range(num_periods))


class Qwen35ForCausalLM(nnx.Module):
    def __init__(
        self,
        cfg: Qwen35Config,
        *,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
        remat: str = "none",
    ):
        if remat not in _REMAT_POLICIES:
            raise ConfigError(f"remat={remat!r}; expected one of {list(_REMAT_POLICIES)}")
        self.config = cfg
        self.dtype = jnp.dtype(dtype)
        self.param_dtype = jnp.dtype(param_dtype)
        self.remat = remat
        V, D = cfg.vocab_size, cfg.hidden_size
        self.embed_tokens = make_param(
            rngs, normal(cfg.initializer_range), (V, D), ("vocab", "embed"), param_dtype, None
        )
        self.blocks = PatternBlock(cfg, dtype=self.dtype, param_dtype=param_dtype, rngs=rngs)
        self.norm = make_param(
            rngs, constant(norm_init_value(cfg.zero_centred_norms)), (D,), ("norm",), param_dtype, None
        )
        if not cfg.tie_word_embeddings:
            self.lm_head = make_param(
                rngs, normal(cfg.initializer_range), (D, V), ("embed", "vocab"), param_dtype, None
            )

    # ---------------------------------------------------------------------------------------------
    def init_cache(self, batch_size: int, max_len: int, dtype=None) -> Qwen35Cache:
        return Qwen35Cache.create(self.config, batch_size, max_len, self.dtype if dtype is None else dtype)

    def lm_head_weight(self) -> jax.Array:
        """``[D, V]`` (the embedding transposed when tied), in the parameter dtype."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens[...].T
        return self.lm_head[...]

    def lm_head_stored(self) -> tuple[jax.Array, bool]:
        """(the head as stored, whether that is ``[V, D]``): the tied embedding is, an own head
        ``[D, V]``. For code that reads the head inside a loop, where a transposed view would be
        copied out first."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens[...], True
        return self.lm_head[...], False

    def __call__(self, input_ids, *, positions=None, segment_ids=None, cache: Qwen35Cache | None = None):
        out = self.hidden_states(input_ids, positions=positions, segment_ids=segment_ids, cache=cache)
        hidden_BxTxD, new_cache = out if cache is not None else (out, None)
        # The one float32 policy head (engine, trainer and SFT use it too).
        logits_BxTxV = head_logits(hidden_BxTxD, self.lm_head_weight())
        return logits_BxTxV if cache is None else (logits_BxTxV, new_cache)

    def hidden_states(
        self,
        input_ids,
        *,
        positions=None,
        segment_ids=None,
        cache: Qwen35Cache | None = None,
        router_stats: bool = False,
        routing: jax.Array | None = None,
        return_routing: bool = False,
        periods: tuple | None = None,
        keep_states: bool = False,
        fresh_cache: bool = False,
    ):
        """Final-norm hidden states ``[B, T, D]``, then, each only when asked for: the new cache
        (given one), a ``RouterStats``, the expert ids used (a tuple when more than one).

        ``periods`` (with a cache only): the block stack's weights as one state per layer period
        (``unstack_periods``), used instead of the stacked ``self.blocks``: the periods then run as
        an unrolled loop that reads each period's own buffers. Scanning the stacked weights copies
        every period's slice out at every step, which for a decode step of a few tokens costs about
        as much as its matmuls (the engine keeps its weights this way).

        MoE models only: ``router_stats`` returns ``[layers, E]`` per-expert sums over the valid tokens
        (load metrics; ``router_aux_loss``). ``routing`` (routing replay): int ``[layers, B, T, K]``
        expert ids each MoE layer uses instead of its router's top-k, for every token whose first id
        is >= 0 (-1: route as usual); the gate weights are still the router's probabilities at those
        ids. ``return_routing`` returns the ids used, int32 ``[layers, B, T, K]`` (what the engine
        records for replay).

        ``keep_states`` (with a cache and ``periods``; every token valid): each Gated DeltaNet layer's
        new cache entries hold its state after every token (``conv [B, T, K, C]``, ``recurrent
        [B, T, H, dk, dv]``), for a caller that keeps only a prefix of the tokens (speculative
        decoding's verify step picks the state after the last accepted one).

        ``fresh_cache`` (with a cache that holds no token yet: every row's length 0, the caller's
        promise): the new tokens are cached as always, but each attention layer attends over their
        own keys as causal self-attention (query blocks skip the keys after them; past one block the
        O(T) kernels) instead of masking the whole cache. Same values at every valid token.
        """
        cfg = self.config
        if router_stats and (cache is not None or not cfg.is_moe):
            raise ValueError("router_stats needs a MoE config (num_experts > 0) and no cache")
        if (routing is not None or return_routing) and not cfg.is_moe:
            raise ValueError("routing / return_routing need a MoE config (num_experts > 0)")
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2 or not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise ValueError(
                f"input_ids must be an integer array [B, T], got {input_ids.dtype}{input_ids.shape}"
            )
        B, T = input_ids.shape
        if segment_ids is None:
            segment_ids = jnp.ones((B, T), jnp.int32)
        segment_ids = jnp.asarray(segment_ids).astype(jnp.int32)
        if segment_ids.shape != (B, T):
            raise ValueError(f"segment_ids shape {segment_ids.shape} != input_ids shape {(B, T)}")
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"cache batch size {cache.batch_size} != input batch size {B}")
        G, P = cfg.num_groups, len(cfg.layer_pattern)
        if routing is not None:
            want = (cfg.num_hidden_layers, B, T, cfg.num_experts_per_tok)
            routing = jnp.asarray(routing)
            if routing.shape != want or not jnp.issubdtype(routing.dtype, jnp.integer):
                raise ValueError(
                    f"routing must be an integer array [layers, B, T, top_k] = {list(want)}, "
                    f"got {routing.dtype}{list(routing.shape)}"
                )
            routing = routing.reshape(G, P, *want[1:])  # layer g * P + p -> [g, p]

        def per_period(a):  # [layers_of_kind, ...] -> [G, per_period, ...]
            return a.reshape(G, a.shape[0] // G, *a.shape[1:])

        if cache is None:
            default_pos, groups = packed_positions_and_groups(segment_ids)
            lengths = None
        else:
            groups = None  # with a cache every row is one sequence continuing its cached state
            lengths = cache.lengths
            default_pos = lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None, :]
        positions = default_pos if positions is None else jnp.asarray(positions).astype(jnp.int32)
        if positions.shape != (B, T):
            raise ValueError(f"positions shape {positions.shape} != input_ids shape {(B, T)}")

        x_BxTxD = jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.dtype)
        if cache is None:
            x_BxTxD = shard_tokens(x_BxTxD)  # the scan's carry (and the period inputs it saves) split by T
        cos, sin = rope_cos_sin(positions, cfg.rotary_dim, cfg.rope_theta, cfg.yarn)
        if keep_states and (cache is None or periods is None):
            raise ValueError("keep_states needs a cache and per-period weights (periods)")
        if fresh_cache and cache is None:
            raise ValueError("fresh_cache describes a cache: pass one")
        ctx = dict(cos=cos, sin=sin, segment_ids=segment_ids, groups=groups, lengths=lengths)
        if fresh_cache:
            ctx["fresh_cache"] = True
        if keep_states:
            ctx["keep_states"] = True
        collect = (("router_stats",) if router_stats else ()) + (("experts",) if return_routing else ())

        graphdef, block_state = nnx.split(self.blocks)

        # "full": the period is one checkpoint and, inside it, every layer another; the backward pass
        # keeps each period's input, and while it runs, one period's layer inputs and one layer's
        # internals. Every layer's forward then runs three times per step: the pass itself, the
        # period's recompute and the layer's own. "layers": the layers' checkpoints without the
        # period's, so the forward runs twice (about a fifth less work per step) and the backward
        # keeps every layer's two inputs ([B, T, D] each) for the whole pass. "dots": one checkpoint
        # per period keeping its matmul outputs.
        remat_layers = self.remat in ("full", "layers")

        # Without a cache the loop slices only the big weights; each period assembles its small ones
        # inside the (possibly checkpointed) period, so the backward recomputes them (no residual).
        big, small, assemble = _split_small_weights(block_state, G)

        def with_small(state):  # the stacked small weights, an explicit input (custom_vjp below)
            return state._replace(small=small) if isinstance(state, _PeriodWeights) else state

        def weights(state):
            return assemble(state) if isinstance(state, _PeriodWeights) else state

        def period(x, xs):
            state, caches, replay = xs
            block = nnx.merge(graphdef, weights(with_small(state)))
            x, new, aux = block(x, ctx, caches, remat_layers=remat_layers, replay=replay, collect=collect)
            return x, (new, aux)

        policy = _REMAT_POLICIES[self.remat]
        if self.remat == "full" and cache is None:

            def run(state, x, consts):
                ctx, replay = consts
                block = nnx.merge(graphdef, weights(state))
                x, _, aux = block(x, ctx, None, remat_layers=True, replay=replay, collect=collect)
                return (x, aux) if collect else x

            def period(x, xs):
                out = recompute_in_backward(run, with_small(xs[0]), x, (ctx, xs[2]))
                return (out[0], (None, out[1])) if collect else (out, (None, {}))

        elif self.remat not in ("none", "layers"):
            period = jax.checkpoint(period, policy=policy, prevent_cse=False)

        if periods is not None and (cache is None or len(periods) != G):
            raise ValueError(
                f"periods: {G} per-period states are used with a cache only, got "
                f"{len(periods)} {'with' if cache is not None else 'without'} a cache"
            )
        if cache is None:
            x_BxTxD, (_, aux) = jax.lax.scan(
                period,
                x_BxTxD,
                (_PeriodWeights(big, jnp.arange(G), None), None, routing),
                unroll=G <= UNROLL_MAX_PERIODS,
            )
            new_cache = None
        elif periods is not None:
            # Static indices: each period reads its own weight buffers and every layer its own cache
            # buffers, which it updates in place.
            full = (list(cache.k), list(cache.v), list(cache.conv), list(cache.recurrent))
            n_full = cfg.num_full_layers // G
            n_lin = cfg.num_linear_layers // G
            auxes = []
            for g in range(G):
                block = nnx.merge(graphdef, periods[g])
                x_BxTxD, full, aux_g = block.decode(
                    x_BxTxD,
                    ctx,
                    full,
                    (g * n_full, g * n_lin),
                    replay=None if routing is None else routing[g],
                    collect=collect,
                )
                auxes.append(aux_g)
            aux = jax.tree.map(lambda *xs: jnp.stack(xs), *auxes)
            new_cache = self._next_cache(cache, *full, segment_ids)
        else:
            # The whole cache rides in the loop's carry and each period writes its slice back in
            # place: as the scan's stacked output it would be a second, cache-sized buffer written in
            # full and copied back at every decode step.
            # (The per-layer buffers are stacked for the loop and split after it: copies, which the
            # unrolled form, the engine's default, does not make.)
            caches = tuple(per_period(a) for a in cache.stacked())

            def period_in_place(carry, xs):
                x, full = carry
                state, replay, g = xs
                mine = tuple(jax.lax.dynamic_index_in_dim(a, g, 0, keepdims=False) for a in full)
                x, (new, aux) = period(x, (state, mine, replay))
                full = tuple(
                    jax.lax.dynamic_update_index_in_dim(a, n.astype(a.dtype), g, 0) for a, n in zip(full, new)
                )
                return (x, full), aux

            (x_BxTxD, new), aux = jax.lax.scan(
                period_in_place, (x_BxTxD, caches), (block_state, routing, jnp.arange(G))
            )
            # [G, per period, ...] -> one array per layer, in model order.
            per_layer = [list(a.reshape(-1, *a.shape[2:])) for a in new]
            new_cache = self._next_cache(cache, *per_layer, segment_ids)

        hidden_BxTxD = rms_norm(
            x_BxTxD, self.norm[...], cfg.rms_norm_eps, zero_centred=cfg.zero_centred_norms
        )
        # [periods, layers per period, ...] -> [layers, ...] in model order (layer = g * P + p).
        aux = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), aux)
        out = [hidden_BxTxD] + ([] if cache is None else [new_cache])
        out += [aux[k] for k in collect]
        return out[0] if len(out) == 1 else tuple(out)

    @staticmethod
    def _next_cache(cache: Qwen35Cache, k, v, conv, rec, segment_ids) -> Qwen35Cache:
        """``k``, ``v``, ``conv``, ``rec``: the new per-layer arrays."""
        n_new = (segment_ids > 0).sum(-1).astype(cache.lengths.dtype)
        return cache.replace(
            lengths=cache.lengths + n_new, k=tuple(k), v=tuple(v), conv=tuple(conv), recurrent=tuple(rec)
        )

    def unstack_periods(self) -> tuple:
        """The block stack's state as one ``nnx.State`` per layer period (copies; ``hidden_states``'
        ``periods``)."""
        return unstack_periods(nnx.state(self.blocks), self.config.num_groups)

    def router_aux_loss(self, stats: RouterStats) -> jax.Array:
        """``router_aux_loss_coef`` times the load-balancing loss of ``stats`` (transformers'
        ``load_balancing_loss_func`` over all layers): add it to a loss only when wanted; RL keeps it
        off by default."""
        return self.config.router_aux_loss_coef * stats.aux_loss()
