"""Qwen 3.5 gated full attention: GQA, per-head q/k RMSNorm before partial RoPE, sigmoid output gate."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from tmax_jax.kernels.dispatch import KERNEL_CHOICES as ATTENTION_KERNELS
from tmax_jax.models.qwen35.config import Qwen35Config
from tmax_jax.models.qwen35.flash_attention import MASKED, flash_attention
from tmax_jax.models.qwen35.norms import norm_init_value, rms_norm
from tmax_jax.models.qwen35.params import constant, make_param, normal
from tmax_jax.models.qwen35.remat import TOKEN_CHUNK, tokenwise_chunked
from tmax_jax.models.qwen35.rope import apply_partial_rope
from tmax_jax.target import several_devices, target_platform

QUERY_BLOCK = 1024  # up to this many queries and keys, one unblocked softmax (fastest on CPU)
CAUSAL_BLOCK = 128  # causal self-attention up to QUERY_BLOCK: query blocks see only keys up to their end
FLASH_BLOCK = 512  # past it, query and key blocks of the flash form
SPLASH_BLOCK = 512  # the TPU kernel's block; rows whose length it does not divide use the flash form


def _attend(q_BxTxGxRxE, k_BxGxSxE, v_BxGxSxE, mask_BxTxS, keys_transposed=False):
    """Softmax attention of every query of ``q`` over the keys where the mask is True.

    The R query heads sharing a kv head are folded into the rows ([B, G, T*R, E], one matmul per kv
    head against its keys) rather than broadcast as an extra batch dimension: XLA then emits a few
    large matmuls instead of many small ones (2-3x faster on CPU at T=1024). Scores, mask and
    softmax in float32; the probabilities are cast to the compute dtype for the value matmul.
    ``keys_transposed``: keys come as ``[B, G, E, S]`` (the decode cache's layout)."""
    B, T, G, R, E = q_BxTxGxRxE.shape
    q_BxGxNxE = q_BxTxGxRxE.transpose(0, 2, 1, 3, 4).reshape(B, G, T * R, E)
    scores = jnp.einsum(
        "bgne,bges->bgns" if keys_transposed else "bgne,bgse->bgns",
        q_BxGxNxE,
        k_BxGxSxE,
        preferred_element_type=jnp.float32,
    )
    S = scores.shape[-1]
    scores_BxGxTxRxS = scores.reshape(B, G, T, R, S) * (E**-0.5)
    scores_BxGxTxRxS = jnp.where(mask_BxTxS[:, None, :, None, :], scores_BxGxTxRxS, MASKED)
    probs = jax.nn.softmax(scores_BxGxTxRxS, axis=-1).astype(q_BxTxGxRxE.dtype).reshape(B, G, T * R, S)
    out_BxGxNxE = jnp.einsum("bgns,bgse->bgne", probs, v_BxGxSxE)
    return out_BxGxNxE.reshape(B, G, T, R, E).transpose(0, 2, 1, 3, 4)


def _unblocked(q, k, v, q_idx, q_seg, k_idx, k_seg, head_major=False):
    """Keys and values ``[B, S, G, E]``, or with ``head_major`` the cache's keys ``[B, G, E, S]`` and
    values ``[B, G, S, E]``."""
    mask_BxTxS = (k_idx[None, None, :] <= q_idx[:, :, None]) & (k_seg[:, None, :] == q_seg[:, :, None])
    if not head_major:
        k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    return _attend(q, k, v, mask_BxTxS, keys_transposed=head_major)


def _causal_unblocked(q_BxTxGxRxE, k_BxTxGxE, v_BxTxGxE, seg_BxT, block: int = CAUSAL_BLOCK):
    """Causal self-attention (keys are the queries, positions 0..T-1) in query blocks of ``block``:
    block i attends to keys ``[0, end_i)`` only, so the masked upper triangle is never computed
    (about half the work at T=1024). Same values as ``_unblocked``; gradients by autodiff."""
    T = q_BxTxGxRxE.shape[1]
    k_BxGxTxE, v_BxGxTxE = k_BxTxGxE.transpose(0, 2, 1, 3), v_BxTxGxE.transpose(0, 2, 1, 3)
    pos_T = jnp.arange(T)
    outs = []
    for start in range(0, T, block):
        end = min(start + block, T)
        causal_TxS = pos_T[None, :end] <= pos_T[start:end, None]
        same_BxTxS = seg_BxT[:, None, :end] == seg_BxT[:, start:end, None]
        outs.append(
            _attend(
                q_BxTxGxRxE[:, start:end],
                k_BxGxTxE[:, :, :end],
                v_BxGxTxE[:, :, :end],
                causal_TxS[None] & same_BxTxS,
            )
        )
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def splash_attention(q_BxTxGxRxE, k_BxTxGxE, v_BxTxGxE, seg_BxT, *, interpret: bool = False):
    """Causal self-attention with segment ids through the Pallas TPU splash kernel (forward and
    backward in O(T) memory). On CPU only in Pallas interpret mode (tests)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    B, T, G, R, E = q_BxTxGxRxE.shape
    H = G * R
    block = min(SPLASH_BLOCK, T)
    sizes = sk.BlockSizes(
        block_q=block, block_kv=block, block_kv_compute=block,
        block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
        block_q_dq=block, block_kv_dq=block,
    )  # fmt: skip
    mask = sm.MultiHeadMask([sm.CausalMask((T, T)) for _ in range(H)])
    kernel = sk.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)
    # The kernel does not scale the scores; query head h = g * R + r reads kv head h // R, as ours.
    q_BxHxTxE = (q_BxTxGxRxE * E**-0.5).reshape(B, T, H, E).transpose(0, 2, 1, 3)
    k_BxGxTxE, v_BxGxTxE = k_BxTxGxE.transpose(0, 2, 1, 3), v_BxTxGxE.transpose(0, 2, 1, 3)

    def run(q, k, v, seg):
        segs = sk.SegmentIds(q=seg, kv=seg)
        return jax.vmap(lambda q, k, v, s: kernel(q, k, v, segment_ids=s))(q, k, v, segs)

    rows, heads = _splash_mesh_axes(B, G)
    if rows or heads or several_devices():
        # XLA cannot partition a custom call: without shard_map it would gather every row and head
        # onto each device. Rows and kv heads (with their query heads) are independent.
        bhte = P(rows or None, heads, None, None)
        run = jax.shard_map(
            run, in_specs=(bhte, bhte, bhte, P(rows or None, None)), out_specs=bhte, check_vma=False
        )
    out_BxHxTxE = run(q_BxHxTxE, k_BxGxTxE, v_BxGxTxE, seg_BxT)
    return out_BxHxTxE.transpose(0, 2, 1, 3).reshape(B, T, G, R, E)


def _triton_block_sizes(head_dim: int):
    """Block sizes of the GPU kernel. Forward blocks of 64 at head dim 256 (Qwen 3.5's): two stages
    of 128-row bfloat16 key and value blocks of that width would need 256 KiB of shared memory, past
    an H100's 228 KiB; 128 up to head dim 128 (the kernel's defaults). Backward blocks: its defaults."""
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    fwd = 128 if head_dim <= 128 else 64
    return gpu_attention.BlockSizes(
        block_q=fwd, block_k=fwd, block_q_dkv=32, block_kv_dkv=32, block_q_dq=32, block_kv_dq=32
    )


def triton_attention(q_BxTxGxRxE, k_BxTxGxE, v_BxTxGxE, seg_BxT, *, interpret: bool = False):
    """Causal self-attention with segment ids through JAX's Pallas GPU (Triton) flash-attention kernel
    (``jax.experimental.pallas.ops.gpu.attention.mha``: online softmax in float32, forward and backward
    in O(T) memory, key blocks after the query block never visited). On CPU only in Pallas interpret
    mode (tests).

    Same mask as ``masked_attention(..., causal_self=True)``: query t sees key s iff s <= t and both
    have the same segment id. The kernel has no GQA: each kv head is repeated for its R query heads
    (query head h = g * R + r reads kv head g, as ours), and autodiff sums the repeats' gradients
    back. Rows are padded to whole blocks with segment id 0 at the end, where causality hides them
    from every real query; the padded queries' outputs are dropped.
    """
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    B, T, G, R, E = q_BxTxGxRxE.shape
    sizes = _triton_block_sizes(E)
    block = max(sizes.block_q, sizes.block_k, sizes.block_q_dkv, sizes.block_kv_dkv)
    pad = (-T) % block
    if pad:
        q_BxTxGxRxE = jnp.pad(q_BxTxGxRxE, [(0, 0), (0, pad), (0, 0), (0, 0), (0, 0)])
        k_BxTxGxE, v_BxTxGxE = (
            jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (k_BxTxGxE, v_BxTxGxE)
        )
        seg_BxT = jnp.pad(seg_BxT, [(0, 0), (0, pad)])

    def run(q, k, v, seg):
        b, t, g = q.shape[:3]
        out = gpu_attention.mha(
            q.reshape(b, t, g * R, E),
            jnp.repeat(k, R, axis=2),
            jnp.repeat(v, R, axis=2),
            seg.astype(jnp.int32),
            sm_scale=E**-0.5,
            causal=True,
            block_sizes=sizes,
            interpret=interpret,
        )
        return out.reshape(b, t, g, R, E)

    rows, heads = _splash_mesh_axes(B, G)
    if rows or heads or several_devices():
        # As for splash: a custom call XLA cannot partition runs per shard (rows and kv heads with
        # their query heads are independent).
        btg = P(rows or None, None, heads)
        run = jax.shard_map(
            run, in_specs=(btg, btg, btg, P(rows or None, None)), out_specs=btg, check_vma=False
        )
    out = run(q_BxTxGxRxE, k_BxTxGxE, v_BxTxGxE, seg_BxT)
    return out[:, :T] if pad else out


def attention_kernel(kernels: str, seq_len: int, backend: str | None = None) -> tuple[str, bool]:
    """``(form, interpret)`` of causal self-attention past the unblocked size, by the model config's
    ``attention_kernels`` choice on a backend (default: the target platform, ``tmax_jax.target``, read
    when the call is traced):

    - ``jax``: the blockwise JAX form (``flash_attention.py``) everywhere;
    - ``auto``: the TPU splash kernel on TPU (rows it divides into blocks), the JAX form elsewhere.
      GPUs stay on the JAX form until ``benchmarks/device_check.sh`` has run the Triton kernel on one;
    - ``pallas``: splash on TPU, the Triton kernel (``triton_attention``) on GPU, and that one in
      Pallas interpret mode on other hosts (slow: tests).
    """
    if kernels not in ATTENTION_KERNELS:
        raise ValueError(f"attention_kernels={kernels!r}; expected one of {list(ATTENTION_KERNELS)}")
    backend = target_platform() if backend is None else backend
    if kernels == "jax":
        return "flash", False
    if backend == "tpu":
        return ("splash" if seq_len % min(SPLASH_BLOCK, seq_len) == 0 else "flash"), False
    if kernels == "pallas":
        return "triton", backend != "gpu"
    return "flash", False


def _splash_mesh_axes(batch: int, kv_heads: int) -> tuple[tuple[str, ...], str | None]:
    """Mesh axes (of ``jax.set_mesh``'s mesh) splitting rows and heads; one that does not divide its
    dimension is left out."""
    from tmax_jax.sharding import BATCH_AXES, DEFAULT_RULES

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return (), None
    sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
    rows = tuple(a for a in BATCH_AXES if sizes.get(a, 1) > 1)
    if batch % math.prod(sizes[a] for a in rows):
        rows = ()
    rules = dict(DEFAULT_RULES)
    heads = rules.get("kv_heads")
    if heads != rules.get("q_heads") or sizes.get(heads, 1) <= 1 or kv_heads % sizes[heads]:
        heads = None
    return rows, heads


def masked_attention(
    q_BxTxGxRxE: jax.Array,
    k_BxSxGxE: jax.Array,
    v_BxSxGxE: jax.Array,
    q_idx_BxT: jax.Array,
    q_seg_BxT: jax.Array,
    k_idx_S: jax.Array,
    k_seg_BxS: jax.Array,
    *,
    block: int = QUERY_BLOCK,
    causal_self: bool = False,
    head_major: bool = False,
    kernels: str = "auto",
) -> jax.Array:
    """Softmax attention (scores and softmax in float32) where query t sees key s iff
    ``k_idx[s] <= q_idx[t]`` and ``k_seg[s] == q_seg[t]``.

    Up to ``block`` queries and keys, or fewer queries whose scores are no bigger: one softmax (for
    causal self-attention, in query blocks that skip the keys after them). Past it, memory is O(T):
    for causal self-attention (``causal_self``: keys are the queries, ``k_idx = q_idx = arange``) a
    Pallas kernel where ``kernels`` picks one (TPU splash, GPU Triton: ``attention_kernel``);
    otherwise the blockwise flash form with its own backward pass (flash_attention.py). cuDNN's fused
    attention (``jax.nn.dot_product_attention``) is not used: its public API takes no segment ids,
    and packing needs them.

    ``head_major``: keys and values come in the decode cache's layout, keys ``[B, G, E, S]`` and
    values ``[B, G, S, E]``, instead of ``[B, S, G, E]``. ``kernels``: the ``attention_kernels``
    choice for causal self-attention past one block (``attention_kernel``).
    """
    T, S = q_BxTxGxRxE.shape[1], v_BxSxGxE.shape[2 if head_major else 1]
    # A few queries over a long cache (decode, short prefill chunks) stay unblocked as long as their
    # scores are no bigger than one block's: padding them to a query block would multiply the work.
    if T <= block and (S <= block or T * S <= block * block):
        if causal_self:
            return _causal_unblocked(q_BxTxGxRxE, k_BxSxGxE, v_BxSxGxE, q_seg_BxT)
        return _unblocked(
            q_BxTxGxRxE, k_BxSxGxE, v_BxSxGxE, q_idx_BxT, q_seg_BxT, k_idx_S, k_seg_BxS, head_major
        )
    if head_major:
        k_BxSxGxE, v_BxSxGxE = k_BxSxGxE.transpose(0, 3, 1, 2), v_BxSxGxE.transpose(0, 2, 1, 3)
    if causal_self:
        form, interpret = attention_kernel(kernels, T)
        if form == "splash":
            return splash_attention(q_BxTxGxRxE, k_BxSxGxE, v_BxSxGxE, q_seg_BxT)
        if form == "triton":
            return triton_attention(q_BxTxGxRxE, k_BxSxGxE, v_BxSxGxE, q_seg_BxT, interpret=interpret)
    b = min(block, FLASH_BLOCK)
    bq = min(b, T)  # fewer queries than a block: one block of exactly them, not padded
    return flash_attention(q_BxTxGxRxE, k_BxSxGxE, v_BxSxGxE, q_idx_BxT, q_seg_BxT, k_idx_S, k_seg_BxS, bq, b)


def write_rows(cache: jax.Array, new: jax.Array, start_B: jax.Array, valid_BxT: jax.Array, axis: int):
    """``cache`` with row b's ``new[b]`` written along ``axis`` (positions) from ``start_B[b]`` on,
    where ``valid_BxT`` (pads and positions past the cache are left as they were).

    ``cache [B, ...]``, ``new [B, ...]`` with T positions along ``axis``. One dynamic update slice per
    row, in a loop over rows: an update XLA does in place in the donated buffer. A scatter
    (``.at[rows, ..., positions].set``) gets its own layout on TPU, so XLA copied the whole cache
    into and out of the decode loop, and on CPU a 16-bit scatter runs on a float32 copy.
    """
    B, T, S = cache.shape[0], new.shape[axis], cache.shape[axis]
    if T > S:  # more new tokens than the cache holds: only a scatter drops the overflow
        pos_BxT = jnp.where(valid_BxT, start_B[:, None] + jnp.arange(T)[None, :], S)
        at = [jnp.arange(B)[:, None]] + [slice(None)] * (axis - 1) + [pos_BxT]
        return cache.at[tuple(at)].set(jnp.moveaxis(new, axis, 1).astype(cache.dtype), mode="drop")
    new = new.astype(cache.dtype)
    window = [1, *cache.shape[1:]]
    window[axis] = T
    valid_BxT = jnp.broadcast_to(valid_BxT, (B, T))

    def row(b, buf):
        start = start_B[b]
        at = jnp.minimum(start, S - T)  # a window that fits; the tokens it shifts past S are dropped
        offset = at + jnp.arange(T) - start  # which new token each window position holds
        keep = (offset >= 0) & (offset < T) & valid_BxT[b, jnp.clip(offset, 0, T - 1)]
        idx = [b] + [0] * (cache.ndim - 1)
        idx[axis] = at
        old = jax.lax.dynamic_slice(buf, idx, window)
        src = jnp.take(
            jax.lax.dynamic_index_in_dim(new, b, 0, keepdims=False), jnp.clip(offset, 0, T - 1), axis=axis - 1
        )
        shape = [1] * cache.ndim
        shape[axis] = T
        upd = jnp.where(keep.reshape(shape), src[None], old)
        return jax.lax.dynamic_update_slice(buf, upd, idx)

    return jax.lax.fori_loop(0, B, row, cache)


class GatedAttention(nnx.Module):
    def __init__(self, cfg: Qwen35Config, *, dtype, param_dtype, rngs: nnx.Rngs, stack: int | None = None):
        D, Hq, Hkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        init = normal(cfg.initializer_range)
        self.dtype = dtype
        self.head_dim = hd
        self.eps = cfg.rms_norm_eps
        self.query_block = QUERY_BLOCK
        self.kernels = cfg.attention_kernels
        self.token_chunk = TOKEN_CHUNK
        self.gated = cfg.attn_output_gate
        self.zero_centred = cfg.zero_centred_norms
        # Query and output gate come out of one projection, interleaved per head: [q_h | gate_h]
        # (Qwen3 has no gate: the query alone).
        self.q_proj = make_param(
            rngs,
            init,
            (D, Hq, (2 if self.gated else 1) * hd),
            ("embed", "q_heads", "head_dim"),
            param_dtype,
            stack,
        )
        self.k_proj = make_param(
            rngs, init, (D, Hkv, hd), ("embed", "kv_heads", "head_dim"), param_dtype, stack
        )
        self.v_proj = make_param(
            rngs, init, (D, Hkv, hd), ("embed", "kv_heads", "head_dim"), param_dtype, stack
        )
        self.o_proj = make_param(
            rngs, init, (Hq, hd, D), ("q_heads", "head_dim", "embed"), param_dtype, stack
        )
        norm_init = constant(norm_init_value(self.zero_centred))
        self.q_norm = make_param(rngs, norm_init, (hd,), ("norm",), param_dtype, stack)
        self.k_norm = make_param(rngs, norm_init, (hd,), ("norm",), param_dtype, stack)

    def __call__(
        self,
        x_BxTxD: jax.Array,
        cos_BxTxR: jax.Array,
        sin_BxTxR: jax.Array,
        segment_ids_BxT: jax.Array,
        *,
        kv_cache: tuple[jax.Array, jax.Array] | None = None,
        lengths_B: jax.Array | None = None,
        stages: bool = False,
        fresh: bool = False,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """``stages`` (training without a cache; ``remat="full"``): the projections, norms and rope
        before attention and the gate and output projection after it run in chunks of
        ``token_chunk`` tokens, each with its own backward (remat.tokenwise_chunked). ``fresh`` (with
        a cache that holds nothing yet, every row's length 0; the caller's promise): the new tokens
        are written to the cache as always, but attention reads their own keys as causal
        self-attention (query blocks skip the keys after them; past one block the O(T) kernels)
        instead of masking the whole cache: the same values at every valid token."""
        dt, hd = self.dtype, self.head_dim
        B, T, _ = x_BxTxD.shape
        stages = stages and kv_cache is None
        w_pre = {
            "q": self.q_proj[...],
            "k": self.k_proj[...],
            "v": self.v_proj[...],
            "q_norm": self.q_norm[...],
            "k_norm": self.k_norm[...],
        }
        x_rope = (x_BxTxD, cos_BxTxR, sin_BxTxR)  # token-wise: rope's angles come per token
        if stages:
            projected = tokenwise_chunked(self._project, w_pre, x_rope, self.token_chunk)
        else:
            projected = self._project(w_pre, x_rope)
        q_BxTxHxE, gate_BxTxHxE, k_BxTxGxE, v_BxTxGxE = projected

        valid_BxT = segment_ids_BxT > 0
        new_cache = None
        if kv_cache is not None:
            # This layer's keys [B, G, E, S] and values [B, G, S, E]; the new tokens are written in place.
            cache_k, cache_v = kv_cache
            S = cache_v.shape[2]
            slot_BxT = lengths_B[:, None] + jnp.arange(T)[None, :]
            # Row b's valid token t goes to position lengths[b] + t of row b; pads and positions past
            # the cache leave it as it was.
            cache_k = write_rows(cache_k, jnp.moveaxis(k_BxTxGxE, 1, -1), lengths_B, valid_BxT, axis=3)
            cache_v = write_rows(cache_v, jnp.moveaxis(v_BxTxGxE, 1, 2), lengths_B, valid_BxT, axis=2)
            new_cache = (cache_k, cache_v)
        head_major = kv_cache is not None and not fresh
        if not head_major:
            # Causal self-attention over the new tokens: without a cache, or with a fresh one, where
            # row b's valid tokens are slots 0..n_b - 1, all the cache holds (one sequence per row).
            keys, values = k_BxTxGxE, v_BxTxGxE
            q_idx_BxT = jnp.broadcast_to(jnp.arange(T), (B, T))
            k_idx_S = jnp.arange(T)
            q_seg_BxT = segment_ids_BxT if kv_cache is None else valid_BxT.astype(jnp.int32)
            k_seg_BxS = q_seg_BxT
        else:
            keys, values = cache_k.astype(dt), cache_v.astype(dt)
            new_len_B = lengths_B + valid_BxT.sum(-1).astype(lengths_B.dtype)
            q_idx_BxT, k_idx_S = slot_BxT, jnp.arange(S)
            # Every query belongs to its row's one sequence; keys past the new length are empty slots.
            q_seg_BxT = jnp.ones((B, T), jnp.int32)
            k_seg_BxS = (k_idx_S[None, :] < new_len_B[:, None]).astype(jnp.int32)

        H = q_BxTxHxE.shape[2]
        G = values.shape[1] if head_major else values.shape[2]
        q_BxTxGxRxE = q_BxTxHxE.reshape(B, T, G, H // G, hd)
        attn_BxTxGxRxE = masked_attention(
            q_BxTxGxRxE,
            keys,
            values,
            q_idx_BxT,
            q_seg_BxT,
            k_idx_S,
            k_seg_BxS,
            block=self.query_block,
            causal_self=not head_major,
            head_major=head_major,
            kernels=self.kernels,
        )
        attn_BxTxHxE = attn_BxTxGxRxE.reshape(B, T, H, hd)
        post = (attn_BxTxHxE, gate_BxTxHxE)
        if stages:
            return tokenwise_chunked(self._output, self.o_proj[...], post, self.token_chunk), new_cache
        return self._output(self.o_proj[...], post), new_cache

    def _project(self, w, x_rope):
        """(q [B, T, H, E] normed and rotated, output gate or None, k [B, T, G, E] likewise, v) from
        ``(x, cos, sin)``."""
        dt, hd = self.dtype, self.head_dim
        x_BxTxD, cos_BxTxR, sin_BxTxR = x_rope
        qg_BxTxHx2E = jnp.einsum("btd,dhe->bthe", x_BxTxD, w["q"].astype(dt))
        q_BxTxHxE, gate_BxTxHxE = qg_BxTxHx2E[..., :hd], (qg_BxTxHx2E[..., hd:] if self.gated else None)
        k_BxTxGxE = jnp.einsum("btd,dhe->bthe", x_BxTxD, w["k"].astype(dt))
        v_BxTxGxE = jnp.einsum("btd,dhe->bthe", x_BxTxD, w["v"].astype(dt))
        q_BxTxHxE = rms_norm(q_BxTxHxE, w["q_norm"], self.eps, zero_centred=self.zero_centred)
        k_BxTxGxE = rms_norm(k_BxTxGxE, w["k_norm"], self.eps, zero_centred=self.zero_centred)
        q_BxTxHxE = apply_partial_rope(q_BxTxHxE, cos_BxTxR, sin_BxTxR)
        k_BxTxGxE = apply_partial_rope(k_BxTxGxE, cos_BxTxR, sin_BxTxR)
        return q_BxTxHxE, gate_BxTxHxE, k_BxTxGxE, v_BxTxGxE

    def _output(self, o_proj, attn_gate):
        """``o_proj(attn * sigmoid(gate))`` (no gate: ``o_proj(attn)``)."""
        attn_BxTxHxE, gate_BxTxHxE = attn_gate
        if self.gated:
            attn_BxTxHxE = attn_BxTxHxE * jax.nn.sigmoid(gate_BxTxHxE)
        # As one [B, T, H*E] x [H*E, D] matmul: with the heads as two contracted axes, XLA CPU
        # transposed the weight (not the few decode rows) at every decode step.
        B, T, H, E = attn_BxTxHxE.shape
        return jnp.einsum(
            "btc,cd->btd", attn_BxTxHxE.reshape(B, T, H * E), o_proj.astype(self.dtype).reshape(H * E, -1)
        )
