"""Decode cache, packing, padding and causality of the JAX Qwen 3.5 (against its own full forward,
which test_qwen35_parity ties to transformers)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tmax_jax.errors import ConfigError
from tmax_jax.models.qwen35 import Qwen35Cache, Qwen35Config, Qwen35ForCausalLM

MAX_LEN = 96


# Gradient tests compile a backward pass: one DeltaNet + one attention layer keeps that quick.
SMALL = dict(num_hidden_layers=2, layer_types=("linear_attention", "full_attention"), intermediate_size=64)


def perturbed_model(tie: bool, seed: int = 0, small: bool = False, **kw) -> Qwen35ForCausalLM:
    cfg = Qwen35Config.preset("tiny", tie_word_embeddings=tie, **(SMALL if small else {}))
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(seed), **kw)
    params = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    # Norm weights start at 0 (zero-centred) or 1; move everything so no path is an identity, but keep
    # the stacked projection matrices ([layers, in, out...]) well conditioned.
    leaves = [
        x + jax.random.normal(k, x.shape, x.dtype) * (0.1 if x.ndim <= 2 else 0.03)
        for x, k in zip(leaves, keys)
    ]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


@pytest.fixture(scope="module")
def model():
    return perturbed_model(tie=True)


@pytest.fixture(scope="module")
def pure(model):
    """The engine's way: one jitted pure function over nnx.split state."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def run(state, ids, segment_ids, cache):
        return nnx.merge(graphdef, state)(ids, segment_ids=segment_ids, cache=cache)

    @jax.jit
    def full(state, ids, segment_ids):
        return nnx.merge(graphdef, state)(ids, segment_ids=segment_ids)

    return state, run, full


def test_prefill_then_decode_equals_full_forward_with_different_row_lengths(model, pure):
    state, run, full = pure
    rng = np.random.default_rng(0)
    lens = np.array([70, 50])
    steps = 6
    total = 76
    ids = rng.integers(0, 512, (2, total)).astype(np.int32)
    seg_full = (np.arange(total)[None] < (lens[:, None] + steps)).astype(np.int32)
    ref = np.asarray(full(state, ids, seg_full))

    prompt = np.where(np.arange(70)[None] < lens[:, None], ids[:, :70], 0).astype(np.int32)
    seg = (np.arange(70)[None] < lens[:, None]).astype(np.int32)
    cache = model.init_cache(2, MAX_LEN, dtype=jnp.float32)
    logits, cache = run(state, prompt, seg, cache)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens)
    for b in range(2):
        np.testing.assert_allclose(np.asarray(logits)[b, : lens[b]], ref[b, : lens[b]], atol=2e-5, rtol=1e-4)
    for s in range(steps):
        tok = ids[np.arange(2), lens + s][:, None]
        logits, cache = run(state, tok, np.ones((2, 1), np.int32), cache)
        np.testing.assert_allclose(
            np.asarray(logits)[:, 0], ref[np.arange(2), lens + s], atol=2e-5, rtol=1e-4
        )
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens + steps)
    assert all(a.dtype == jnp.float32 for a in cache.recurrent)


@pytest.mark.parametrize("query_block", [1024, 64])
def test_fresh_cache_prefill_attends_its_own_tokens(model, pure, query_block):
    """``fresh_cache=True`` (the engine's first prefill of a request): attention reads the chunk's
    own keys causally instead of masking the whole cache. Against the full forward (tied to
    transformers) and the masked-cache prefill, with right-padded rows longer than one causal block:
    the same logits at valid tokens, the same cache, and decoding on from it gives the full
    forward's logits. ``query_block`` 64 sends both through the blockwise (flash) form."""
    from tmax_jax.rl.logprobs import head_logits

    state, _, full = pure
    if query_block != 1024:
        model = nnx.clone(model)
        for layer in model.blocks.layers:
            if hasattr(layer, "self_attn"):
                layer.self_attn.query_block = query_block
    graphdef, state = nnx.split(model)

    @functools.partial(jax.jit, static_argnums=4)
    def prefill(state, ids, seg, cache, fresh):
        m = nnx.merge(graphdef, state)
        h, cache = m.hidden_states(ids, segment_ids=seg, cache=cache, fresh_cache=fresh)
        return head_logits(h, m.lm_head_weight()), cache

    step = jax.jit(lambda state, ids, cache: nnx.merge(graphdef, state)(ids, cache=cache))
    rng = np.random.default_rng(7)
    lens, T, steps = np.array([300, 170]), 300, 3
    ids = rng.integers(0, 512, (2, T + steps)).astype(np.int32)
    ref = np.asarray(
        full(state, ids, (np.arange(T + steps)[None] < (lens[:, None] + steps)).astype(np.int32))
    )
    seg = (np.arange(T)[None] < lens[:, None]).astype(np.int32)
    prompt = np.where(seg > 0, ids[:, :T], 0).astype(np.int32)
    out = {}
    for fresh in (True, False):
        out[fresh] = prefill(state, prompt, seg, model.init_cache(2, 320, dtype=jnp.float32), fresh)
    (logits, cache), (masked_logits, masked_cache) = out[True], out[False]
    for b in range(2):
        n = lens[b]
        np.testing.assert_allclose(np.asarray(logits)[b, :n], ref[b, :n], atol=2e-5, rtol=1e-4)
        np.testing.assert_allclose(np.asarray(logits)[b, :n], np.asarray(masked_logits)[b, :n], atol=2e-5)
    for got, want in zip(jax.tree.leaves(cache), jax.tree.leaves(masked_cache)):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(cache.lengths), lens)
    for s in range(steps):
        logits, cache = step(state, ids[np.arange(2), lens + s][:, None], cache)
        np.testing.assert_allclose(
            np.asarray(logits)[:, 0], ref[np.arange(2), lens + s], atol=2e-5, rtol=1e-4
        )
    with pytest.raises(ValueError, match="fresh_cache describes a cache"):
        model.hidden_states(prompt, fresh_cache=True)


def test_multi_turn_prefill_on_top_of_a_cache_then_decode(model, pure):
    """Second turn (T > 1) prefills only its new tokens from the cached state (chunked form)."""
    state, run, full = pure
    rng = np.random.default_rng(1)
    ids = rng.integers(0, 512, (2, 76)).astype(np.int32)
    ref = np.asarray(full(state, ids, np.ones((2, 76), np.int32)))
    cache = model.init_cache(2, MAX_LEN, dtype=jnp.float32)
    _, cache = run(state, ids[:, :6], np.ones((2, 6), np.int32), cache)
    logits, cache = run(state, ids[:, 6:76], np.ones((2, 70), np.int32), cache)
    np.testing.assert_allclose(np.asarray(logits), ref[:, 6:76], atol=2e-5, rtol=1e-4)


def test_right_padding_leaves_the_cache_exactly_as_the_unpadded_prefill(model, pure):
    state, run, _ = pure
    rng = np.random.default_rng(2)
    ids = rng.integers(0, 512, (2, 70)).astype(np.int32)
    seg_pad = np.ones((2, 70), np.int32)
    seg_pad[1, 50:] = 0
    _, padded = run(state, ids, seg_pad, model.init_cache(2, MAX_LEN, dtype=jnp.float32))
    short = np.stack([ids[0], np.concatenate([ids[1, :50], ids[1, :20]])])  # other filler, same shape
    seg_short = seg_pad.copy()
    _, other = run(state, short, seg_short, model.init_cache(2, MAX_LEN, dtype=jnp.float32))
    # Different pad *contents* give the same cache: pads are no-ops.
    for name in ("lengths", "k", "v", "conv", "recurrent"):
        np.testing.assert_array_equal(
            np.asarray(getattr(padded, name)), np.asarray(getattr(other, name)), name
        )
    # And the padded row's cache equals that of prefilling just its 50 valid tokens (cache dims
    # kept equal by padding row 0 the same way).
    _, unpadded = run(
        state,
        np.stack([ids[1], ids[1]]).astype(np.int32)[:, :70],
        np.array([[1] * 50 + [0] * 20, [1] * 50 + [0] * 20], np.int32),
        model.init_cache(2, MAX_LEN, dtype=jnp.float32),
    )
    np.testing.assert_allclose(
        np.stack(padded.recurrent)[:, 1], np.stack(unpadded.recurrent)[:, 0], atol=1e-6
    )
    np.testing.assert_allclose(np.stack(padded.conv)[:, 1], np.stack(unpadded.conv)[:, 0], atol=1e-6)
    # Keys [B, G, E, S], values [B, G, S, E] (per layer, stacked here).
    np.testing.assert_allclose(
        np.stack(padded.k)[:, 1, ..., :50], np.stack(unpadded.k)[:, 0, ..., :50], atol=1e-6
    )
    np.testing.assert_allclose(
        np.stack(padded.v)[:, 1, :, :50], np.stack(unpadded.v)[:, 0, :, :50], atol=1e-6
    )
    assert not np.stack(padded.k)[:, 1, ..., 50:].any(), "pads must not be written to the KV cache"
    assert not np.stack(padded.v)[:, 1, :, 50:].any(), "pads must not be written to the KV cache"


def test_packed_segments_equal_separate_forwards(model, pure):
    state, _, full = pure
    rng = np.random.default_rng(3)
    bounds = [(0, 20), (20, 60), (60, 76)]
    ids = rng.integers(0, 512, (2, 76)).astype(np.int32)
    seg = np.zeros((2, 76), np.int32)
    for i, (lo, hi) in enumerate(bounds):
        seg[0, lo:hi] = i + 1
    seg[1, :] = 1
    packed = np.asarray(full(state, ids, seg))
    for lo, hi in bounds:
        row = np.zeros((2, 76), np.int32)
        row[0, : hi - lo] = ids[0, lo:hi]
        alone_seg = np.zeros((2, 76), np.int32)
        alone_seg[0, : hi - lo] = 1
        alone = np.asarray(full(state, row, alone_seg))
        np.testing.assert_allclose(packed[0, lo:hi], alone[0, : hi - lo], atol=2e-5, rtol=1e-4)


def test_no_gradient_flows_from_later_tokens_to_earlier_logits():
    model = perturbed_model(tie=False, seed=4, small=True)
    T, t = 70, 40
    ids = jnp.asarray(np.random.default_rng(4).permutation(512)[:T][None].astype(np.int32))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params):
        m = nnx.merge(graphdef, params, rest)
        return m(ids)[:, : t + 1].sum()

    grads = jax.jit(jax.grad(loss))(params)
    g_embed = np.asarray(grads["embed_tokens"][...])
    later, earlier = np.asarray(ids[0, t + 1 :]), np.asarray(ids[0, : t + 1])
    assert not g_embed[later].any(), "logits at t depend on tokens after t"
    assert (np.abs(g_embed[earlier]).sum(-1) > 0).all()


def test_remat_changes_neither_logits_nor_gradients():
    ids = jnp.asarray(np.random.default_rng(5).integers(0, 512, (1, 70)).astype(np.int32))

    def value_and_grad(model):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        f = jax.jit(jax.value_and_grad(lambda p: nnx.merge(graphdef, p, rest)(ids).std()))
        return f(params)

    v0, g0 = value_and_grad(perturbed_model(tie=True, seed=5, small=True))
    for remat in ("full", "layers", "dots"):
        v1, g1 = value_and_grad(perturbed_model(tie=True, seed=5, small=True, remat=remat))
        np.testing.assert_allclose(v0, v1, rtol=1e-6, err_msg=remat)
        for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6, rtol=1e-5, err_msg=remat)


def test_remat_layers_runs_each_layer_forward_twice_full_three_times():
    """The delta rule's chunk loops in the compiled gradient of one period (3 DeltaNet layers): "none"
    runs each layer's forward once, "layers" twice (the pass and the layer's own recompute), "full"
    three times (the period's recompute as well); each layer's backward loop once in every mode."""
    ids = jnp.asarray(np.random.default_rng(6).integers(0, 512, (1, 70)).astype(np.int32))
    loops = {}
    for remat in ("none", "layers", "full"):
        model = perturbed_model(tie=True, seed=6, small=True, remat=remat)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        loss = lambda p, g=graphdef, r=rest: nnx.merge(g, p, r)(ids).std()  # noqa: E731
        loops[remat] = jax.jit(jax.grad(loss)).lower(params).as_text().count("stablehlo.while")
    lin = model.config.num_linear_layers
    assert loops["layers"] - loops["none"] == lin, loops
    assert loops["full"] - loops["layers"] == lin, loops


def test_remat_layers_keeps_layer_inputs_not_weight_copies():
    """What the backward keeps under "layers" (jax's saved_residuals, the memory plan's source): each
    layer's two inputs, [B, T, D] each, and no copy of a big weight (each layer's weights reach its
    checkpoint as slices of the period loop's inputs, which the loop does not stack again). Only the
    small ones (norms, conv taps, decay parameters: read through a one-hot dot) are saved."""
    from jax._src.ad_checkpoint import saved_residuals

    from tmax_jax.models.qwen35 import Qwen35Config
    from tmax_jax.models.qwen35.model import _SMALL_WEIGHT_ELEMENTS

    cfg = Qwen35Config.preset("tiny", hidden_size=512, intermediate_size=1024, num_hidden_layers=8)
    ids = jnp.zeros((2, 64), jnp.int32)
    saved = {}
    for remat in ("full", "layers"):
        model = nnx.eval_shape(lambda r=remat: Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0), remat=r))
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        res = saved_residuals(lambda p, g=graphdef, r=rest: nnx.merge(g, p, r)(ids).sum(), params)
        saved[remat] = [a for a, src in res if "from the argument" not in src]
    row = (2, 64, 512)
    # [B, T, D] buffers kept, counted in rows (some stacked over the periods by the loop).
    inputs = {
        remat: sum(a.size for a in avals if a.shape[-3:] == row) // np.prod(row)
        for remat, avals in saved.items()
    }
    assert inputs["layers"] >= 2 * cfg.num_hidden_layers > inputs["full"], inputs
    # The MLP's weights ([512, 1024] and [1024, 512], big) are never saved, stacked or not.
    assert not [a.shape for a in saved["layers"] if a.shape[-2:] in ((512, 1024), (1024, 512))]
    # Beyond what "full" keeps too (e.g. the tied head's transpose): small weights, one per period.
    full_shapes = {a.shape for a in saved["full"]}
    extra = [a for a in saved["layers"] if a.shape[-3:] != row and a.shape not in full_shapes]
    assert extra and all(a.size // cfg.num_groups <= _SMALL_WEIGHT_ELEMENTS for a in extra), extra


def test_cache_layout_reset_rows_and_pytree(model):
    cfg = model.config
    cache = model.init_cache(3, 32, dtype=jnp.bfloat16)
    assert isinstance(cache, Qwen35Cache)
    # One K and one V buffer per attention layer (decode reads and writes them in place).
    assert len(cache.k) == len(cache.v) == cfg.num_full_layers
    for a in cache.k:  # keys with positions minor: decode's scores are a plain matmul per head
        assert a.shape == (3, cfg.num_key_value_heads, cfg.head_dim, 32) and a.dtype == jnp.bfloat16
    for a in cache.v:
        assert a.shape == (3, cfg.num_key_value_heads, 32, cfg.head_dim) and a.dtype == jnp.bfloat16
    assert len(cache.conv) == len(cache.recurrent) == cfg.num_linear_layers
    for a in cache.conv:
        assert a.shape == (3, cfg.linear_conv_kernel_dim, cfg.conv_dim) and a.dtype == jnp.bfloat16
    for a in cache.recurrent:  # the delta-rule state stays float32 whatever the cache dtype
        assert (
            a.shape == (3, cfg.linear_num_value_heads, cfg.linear_key_head_dim, 16) and a.dtype == jnp.float32
        )
    assert cache.max_len == 32
    filled = dataclasses.replace(
        cache,
        lengths=jnp.array([5, 6, 7], jnp.int32),
        k=tuple(jnp.ones_like(a) for a in cache.k),
        recurrent=tuple(jnp.ones_like(a) for a in cache.recurrent),
    )
    reset = jax.jit(lambda c, r: c.reset_rows(r))(filled, jnp.array([False, True, False]))
    np.testing.assert_array_equal(np.asarray(reset.lengths), [5, 0, 7])
    k = np.stack(reset.k).astype(np.float32)
    assert not k[:, 1].any() and k[:, 0].all() and k[:, 2].all()
    rec = np.stack(reset.recurrent)
    assert not rec[:, 1].any() and rec[:, 0].all() and rec[:, 2].all()
    assert len(jax.tree.leaves(cache)) == 1 + 2 * cfg.num_full_layers + 2 * cfg.num_linear_layers
    # narrow / widen_into: attention reads a prefix of every layer's keys, written back in place.
    small = filled.narrow(16)
    assert all(a.shape[3] == 16 for a in small.k) and all(a.shape[2] == 16 for a in small.v)
    assert small.max_len == 16
    back = small.replace(k=tuple(a * 2 for a in small.k)).widen_into(filled)
    kb = np.stack(back.k).astype(np.float32)
    assert (kb[..., :16] == 2).all() and (kb[..., 16:] == 1).all() and back.max_len == 32


def test_bad_inputs_are_named_errors(model):
    with pytest.raises(ValueError, match="input_ids must be an integer array"):
        model(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="segment_ids shape"):
        model(jnp.zeros((1, 4), jnp.int32), segment_ids=jnp.ones((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="cache batch size"):
        model(jnp.zeros((1, 4), jnp.int32), cache=model.init_cache(2, 8))
    with pytest.raises(ConfigError, match="remat"):
        Qwen35ForCausalLM(model.config, rngs=nnx.Rngs(0), remat="sometimes")
