"""The rollout engine: JetStream's Engine interface for the Qwen 3.5 model in tmax_jax.models.

Decode state holds ``max_concurrent_decodes`` slots: the model's cache batched over slots (KV cache
for attention layers, conv and float32 recurrent state for Gated DeltaNet layers, per-slot lengths)
plus each slot's pending token, PRNG key and sampling settings. ``prefill`` runs one request on a
power-of-two bucket of its length, ``prefill_many`` several at once (one batched call per length
bucket; requests with the same prompt share one prefill, whose cache each of them forks), ``insert``
copies a request's state into a slot, ``generate`` is one jitted step over all slots and
``generate_block`` several steps in one call. Attention in prefill and in blocks reads only a
power-of-two bucket of the live length, not ``max_cache_length``. Parameters are an argument of
every jitted function, so :meth:`Engine.update_params` swaps weights without recompiling.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from tmax_jax import launch
from tmax_jax.engine import sampling
from tmax_jax.engine.engine_api import EngineAPI, ResultTokens
from tmax_jax.engine.sampling import SamplingParams
from tmax_jax.errors import ConfigError, TmaxError
from tmax_jax.rl.logprobs import head_logits
from tmax_jax.trees import check_like

# Columns of ResultTokens.data.
_TOKENS, _VALID, _LENGTHS = (0, 1), (1, 2), (2, 3)


@struct.dataclass
class Prefix:
    """One prefilled request: its cache (batch 1) and first sampled token, not yet in the cache."""

    cache: Any
    token: jax.Array  # int32 [1]
    log_prob: jax.Array  # float32 [1]
    key: jax.Array  # PRNG key [1]: the request's base key (or its raw key data [1, 2], uint32)
    temperature: jax.Array  # float32 [1]
    top_k: jax.Array  # int32 [1]
    top_p: jax.Array  # float32 [1]
    max_tokens: jax.Array  # int32 [1]
    stop_ids: jax.Array  # int32 [1, max_stop_tokens], -1 = unused
    # Host-side: tokens held in ``cache`` (prompt so far). Not traced.
    length: int = struct.field(pytree_node=False, default=0)


@struct.dataclass
class DecodeState:
    """Everything a generate step transforms, batched over slots."""

    cache: Any
    tokens: jax.Array  # int32 [S]: the token each slot feeds next (its last sampled one)
    generated: jax.Array  # int32 [S]: tokens generated so far
    active: jax.Array  # bool [S]
    key: jax.Array  # PRNG key [S]
    temperature: jax.Array  # float32 [S]
    top_k: jax.Array  # int32 [S]
    top_p: jax.Array  # float32 [S]
    max_tokens: jax.Array  # int32 [S]
    stop_ids: jax.Array  # int32 [S, max_stop_tokens]


@struct.dataclass
class DecodeBlock:
    """The output of ``generate_block``: step ``j``'s token of slot ``s`` at ``[j, s]``. A slot's
    tokens after it stopped (stop token, ``max_tokens``, full cache) are not ``valid``. A speculative
    engine's step ``j`` fills rows ``j * R .. j * R + R - 1`` (``R = Engine.tokens_per_step``); the
    first is valid for every slot decoding, the others for the tokens the step emitted."""

    tokens: jax.Array  # int32 [K, S]
    valid: jax.Array  # bool [K, S]
    log_prob: jax.Array  # float32 [K, S]
    generated: jax.Array  # int32 [K, S]: tokens the slot has generated after this step
    # Engines with record_routing (MoE): int32 [K, S, layers, top_k], the expert ids each MoE layer
    # routed step j's input token of slot s to (the token sampled the step before; at step 0 the
    # prefix's first token). Routing replay feeds them to the train step. None otherwise.
    experts: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class PrefillRequest:
    """One request for :meth:`Engine.prefill_many` (the arguments of :meth:`Engine.prefill`)."""

    tokens: Sequence[int]
    sampling_params: SamplingParams | None = None
    max_tokens: int | None = None
    stop_token_ids: Sequence[int] | None = None
    existing_prefix: Prefix | None = None


def _typed_key(key: jax.Array, like: jax.Array) -> jax.Array:
    """``key`` as ``like``'s typed PRNG keys (a prefix made by ``prefill_many`` holds raw key data)."""
    if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    return jax.random.wrap_key_data(key, impl=jax.random.key_impl(like))


class PeriodParams(struct.PyTreeNode):
    """The engine's weights when the model runs its layer periods unrolled (``unroll_periods``):
    the model's state without its block stack, and the stack as one state per layer period."""

    rest: Any
    periods: tuple


# Weights every layer casts to its compute dtype before each use (its matmuls, the conv): the engine
# keeps them in that dtype, so decode streams half the bytes of float32 parameters and computes the
# same values as the trainer, whose cast gives the same numbers. Norms, gates' float32 parameters and
# the float32 head keep the parameters' dtype.
_COMPUTE_DTYPE_WEIGHTS = frozenset(
    {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "conv_weight",
        "out_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "gate_up_proj",
        "router",
        "shared_expert_gate",
    }
)


def _in_compute_dtype(tree: Any, dtype: Any) -> Any:
    """``tree`` with the ``_COMPUTE_DTYPE_WEIGHTS`` leaves wider than ``dtype`` cast to it."""
    if dtype is None:
        return tree
    dtype = jnp.dtype(dtype)

    def cast(path, a):
        names = {str(getattr(k, "key", getattr(k, "name", k))) for k in path}
        wide = jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize > dtype.itemsize
        return a.astype(dtype) if wide and names & _COMPUTE_DTYPE_WEIGHTS else a

    return jax.tree_util.tree_map_with_path(cast, tree)


def _rest(state: Any) -> nnx.State:
    """The model's state without its block stack (``PeriodParams.rest``)."""
    return nnx.State({k: v for k, v in state.items() if k != "blocks"})


def _leaf_refs(leaves: list) -> tuple | None:
    """Weak references to the leaves of the model state the engine's weights are made from (None
    where a leaf takes no weak reference)."""
    try:
        return tuple(weakref.ref(a) for a in leaves)
    except TypeError:
        return None


def _same_leaves(refs: tuple | None, leaves: list) -> bool:
    """Whether ``leaves`` are the very (live, immutable) JAX arrays ``refs`` point to. NumPy leaves
    never count: they can change in place."""
    return (
        refs is not None
        and len(refs) == len(leaves)
        and all(isinstance(a, jax.Array) and r() is a and not a.is_deleted() for r, a in zip(refs, leaves))
    )


def _is_abstract(tree: Any) -> bool:
    """Whether ``tree`` holds shapes only (an ``nnx.eval_shape`` model's state): nothing to launch."""
    return any(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(tree))


def _compiled_outputs(jitted: Any, *args: Any) -> Any:
    """What ``jitted(*args)`` returns, as ``ShapeDtypeStruct``s with the shardings its compiled
    program gives them (the shardings a call would return), for abstract ``args``."""
    compiled = jitted.lower(*args).compile()
    return jax.tree.map(
        lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype, sharding=o.sharding), compiled.out_info
    )


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n - 1).bit_length())


def _batch_axes(make_cache: Any) -> list[int]:
    """For each leaf of ``make_cache(batch)``'s cache, the axis that indexes batch rows (found from
    two abstract caches)."""
    a = jax.tree.leaves(jax.eval_shape(lambda: make_cache(2)))
    b = jax.tree.leaves(jax.eval_shape(lambda: make_cache(3)))
    axes = []
    for x, y in zip(a, b):
        diff = [i for i, (p, q) in enumerate(zip(x.shape, y.shape)) if p != q]
        if len(diff) != 1 or x.shape[diff[0]] != 2:
            raise TmaxError(f"cannot find the batch axis of a cache leaf with shapes {x.shape} / {y.shape}")
        axes.append(diff[0])
    return axes


class Engine(EngineAPI):
    """Continuous-batching decode engine over a :class:`Qwen35ForCausalLM` (any model with its cache API).

    Args:
      model: the flax nnx model; its parameters become the engine's (``update_params`` swaps them).
      max_concurrent_decodes: decode slots.
      max_cache_length: tokens per slot (prompt + generation); static, part of every compile.
      max_prefill_length: longest single prefill; longer prompts are prefilled in chunks.
      cache_dtype: dtype of KV/conv caches (DeltaNet recurrent state is float32 regardless).
      eos_token_ids: tokens that end a request unless a request gives its own stop tokens.
      tokenizer: returned by ``get_tokenizer`` (the orchestrator uses it for stop strings).
      decode_steps: decode steps per ``generate_block`` call (the orchestrator's block size).
      min_attend_bucket: smallest KV length attention reads (live lengths round up to a power of two
        at least this; fewer buckets, fewer compiles).
      max_prefill_batch: most prompts prefilled in one call by ``prefill_many``.
      prompt_cache_entries: prefilled prompts kept (cache + last logits) so that later requests with
        the same prompt and weights fork them instead of prefilling again; each costs one slot's cache
        memory; 0 = off. A weight update empties it.
      record_routing: record each MoE layer's expert ids per token (routing replay).
      unroll_periods: keep the block stack as one weight state per layer period (``PeriodParams``,
        a copy made at construction and at each ``update_params``) and run the periods unrolled in
        prefill and decode. Scanning the stacked weights instead makes XLA copy each period's slice
        at every decode step; unrolling costs compile time that grows with the period count.
      mtp, speculative_tokens: speculative decoding. ``mtp`` is the checkpoint's multi-token-prediction
        module (``checkpoints.load_mtp``); each decode step of ``generate_block`` drafts
        ``speculative_tokens`` tokens with it and verifies them in one forward pass of the model over
        ``speculative_tokens + 1`` tokens per slot. Each draft is sampled with the key the model's
        own token at its position uses, and kept only when it equals that token, so every emitted
        token and logprob is the model's own (the tokens are those of decoding without drafts, up to
        float rounding between the two forms); a step emits 1 to ``speculative_tokens + 1`` tokens.
        The draft reads the cache as extra attention layers. 0 = off.
    """

    def __init__(
        self,
        model: Any,
        *,
        max_concurrent_decodes: int = 8,
        max_cache_length: int = 1024,
        max_prefill_length: int = 512,
        min_prefill_bucket: int = 16,
        cache_dtype: Any = jnp.float32,
        eos_token_ids: Sequence[int] = (),
        default_sampling: SamplingParams = SamplingParams(temperature=0.0),
        max_stop_tokens: int = 8,
        tokenizer: Any = None,
        mesh: jax.sharding.Mesh | None = None,
        decode_steps: int = 8,
        min_attend_bucket: int = 128,
        max_prefill_batch: int = 8,
        prompt_cache_entries: int = 4,
        record_routing: bool = False,
        unroll_periods: bool = True,
        mtp: Any = None,
        speculative_tokens: int = 0,
    ):
        for name, v in [
            ("decode_steps", decode_steps),
            ("min_attend_bucket", min_attend_bucket),
            ("max_prefill_batch", max_prefill_batch),
            ("max_concurrent_decodes", max_concurrent_decodes),
            ("max_cache_length", max_cache_length),
            ("max_prefill_length", max_prefill_length),
            ("min_prefill_bucket", min_prefill_bucket),
            ("max_stop_tokens", max_stop_tokens),
        ]:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"Engine: {name} must be a positive integer, got {v!r}")
        if max_prefill_length > max_cache_length:
            raise ConfigError(
                f"Engine: max_prefill_length ({max_prefill_length}) exceeds max_cache_length ({max_cache_length})"
            )
        if len(eos_token_ids) > max_stop_tokens:
            raise ConfigError(
                f"Engine: {len(eos_token_ids)} eos tokens but max_stop_tokens={max_stop_tokens}"
            )
        if record_routing and not getattr(getattr(model, "config", None), "is_moe", False):
            raise ConfigError("Engine: record_routing needs a MoE model (num_experts > 0)")
        if (
            isinstance(speculative_tokens, bool)
            or not isinstance(speculative_tokens, int)
            or speculative_tokens < 0
        ):
            raise ConfigError(
                f"Engine: speculative_tokens must be an integer >= 0, got {speculative_tokens!r}"
            )
        if speculative_tokens and mtp is None:
            raise ConfigError(
                "Engine: speculative_tokens needs the draft module: mtp=load_mtp(checkpoint) "
                "(the checkpoint must hold mtp.* tensors)"
            )
        if speculative_tokens and record_routing:
            raise ConfigError("Engine: speculative decoding does not record MoE routing (record_routing)")
        if speculative_tokens and not unroll_periods:
            raise ConfigError(
                "Engine: speculative decoding runs the layer periods unrolled (unroll_periods=True)"
            )
        if speculative_tokens and mtp.config.hidden_size != model.config.hidden_size:
            raise ConfigError(
                f"Engine: the MTP module's hidden size {mtp.config.hidden_size} != the model's "
                f"{model.config.hidden_size}"
            )
        self._draft_k = speculative_tokens
        self.tokens_per_step = speculative_tokens + 1
        if speculative_tokens:
            self._mtp_graphdef, self._mtp_state = nnx.split(mtp)
            self._mtp_layers = mtp.num_layers
            self._n_full = model.config.num_full_layers
        else:
            self._mtp_graphdef = self._mtp_state = None
            self._mtp_layers = self._n_full = 0
        self.record_routing = bool(record_routing)
        # (layers, top_k) of each token's recorded experts (DecodeBlock.experts); None without recording.
        self.routing_shape = (
            (model.config.num_hidden_layers, model.config.num_experts_per_tok) if record_routing else None
        )
        self._graphdef, state = nnx.split(model)
        # Expected shapes of the model's own (stacked) state: what update_params checks new weights against.
        self._spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
        self._unroll = bool(unroll_periods) and hasattr(model, "unstack_periods") and "blocks" in state
        self._num_periods = model.config.num_groups if self._unroll else 0
        self._unstack_jit = launch.jit(self._unstack_impl)
        self._own_periods_jit = launch.jit(self._own_periods_impl)
        self._copy_jit = launch.jit(lambda tree: jax.tree.map(jnp.copy, tree))
        # The compute dtype the layers cast their matmul weights to, where it is narrower than theirs.
        dtype = getattr(model, "dtype", None)
        wide = [a.dtype for a in jax.tree.leaves(state) if jnp.issubdtype(a.dtype, jnp.floating)]
        narrow = dtype is not None and any(jnp.dtype(d).itemsize > jnp.dtype(dtype).itemsize for d in wide)
        self._compute_dtype = jnp.dtype(dtype) if narrow else None
        self._cast_jit = launch.jit(
            lambda tree: jax.tree.map(jnp.copy, _in_compute_dtype(tree, self._compute_dtype))
        )
        self._params = self._engine_params(state)
        self._source = _leaf_refs(jax.tree.leaves(state))
        self._version = 0
        self._lock = threading.Lock()
        self._slots = max_concurrent_decodes
        self._max_len = max_cache_length
        self._max_prefill = max_prefill_length
        self._min_bucket = min(_next_pow2(min_prefill_bucket), max_prefill_length)
        self._cache_dtype = cache_dtype
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.default_sampling = default_sampling
        self._max_stop = max_stop_tokens
        self._tokenizer = tokenizer
        self._mesh = mesh
        if self._draft_k:
            self._mtp_state = self._on_model_devices(self._mtp_state)
        if (
            isinstance(prompt_cache_entries, bool)
            or not isinstance(prompt_cache_entries, int)
            or prompt_cache_entries < 0
        ):
            raise ConfigError(
                f"Engine: prompt_cache_entries must be an integer >= 0, got {prompt_cache_entries!r}"
            )
        self.decode_steps = decode_steps
        self._min_attend = _next_pow2(min_attend_bucket)
        self._max_prefill_batch = _next_pow2(max_prefill_batch)
        self._prompt_cache_entries = prompt_cache_entries
        self._prompt_cache: collections.OrderedDict[tuple[int, ...], tuple[Any, jax.Array]] = (
            collections.OrderedDict()
        )
        # Prefill work: rows prefilled, calls made, requests that forked a prompt already prefilled.
        self.prefill_counts: collections.Counter[str] = collections.Counter()
        self._axes = _batch_axes(lambda b: self._init_cache(model, b, max_cache_length))
        self._cache_treedef = jax.tree.structure(
            jax.eval_shape(lambda: self._init_cache(model, 1, max_cache_length))
        )
        head = jax.eval_shape(lambda st: nnx.merge(self._graphdef, st).lm_head_weight(), state)
        self.vocab_size = int(head.shape[-1])
        # Trace counts per jitted function: a retrace is a recompile, so tests can assert none happen.
        self.trace_counts: collections.Counter[str] = collections.Counter()
        probe = jax.eval_shape(lambda: self._init_cache(model, 1, max_cache_length))
        self._narrowable = hasattr(probe, "narrow") and hasattr(probe, "widen_into")
        on_mesh = self._on_mesh
        self._prefill_fresh_jit = launch.jit(on_mesh(self._prefill_fresh_impl), static_argnums=(3,))
        self._prefill_cont_jit = launch.jit(on_mesh(self._prefill_cont_impl), static_argnums=(4,))
        self._row_jit = launch.jit(self._row_impl)
        self._sample_first_jit = launch.jit(self._sample_first_impl)
        self._first_tokens_jit = launch.jit(self._first_tokens_impl)
        self._generate_jit = launch.jit(on_mesh(self._generate_impl), donate_argnums=(1,))
        self._block_jit = launch.jit(
            on_mesh(self._generate_block_impl), static_argnums=(3,), donate_argnums=(1,)
        )
        self._live_length_jit = launch.jit(self._live_length_impl)
        self._insert_jit = launch.jit(self._insert_impl, donate_argnums=(1,))
        self._extract_jit = launch.jit(self._extract_impl)
        self._deactivate_jit = launch.jit(self._deactivate_impl, donate_argnums=(0,))
        self._init_decode_state_jit = launch.jit(self._init_decode_state_impl)

    # ----------------------------------------------------------------- properties (JetStream API)
    @property
    def max_concurrent_decodes(self) -> int:
        return self._slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def max_cache_length(self) -> int:
        return self._max_len

    @property
    def max_prefill_batch(self) -> int:
        return self._max_prefill_batch

    @property
    def mesh(self) -> jax.sharding.Mesh:
        if self._mesh is None:
            leaf = jax.tree.leaves(self._params)[0]
            sharding = getattr(leaf, "sharding", None)
            if isinstance(sharding, jax.sharding.NamedSharding):
                self._mesh = sharding.mesh
            else:
                device = next(iter(leaf.devices())) if hasattr(leaf, "devices") else jax.devices()[0]
                self._mesh = jax.sharding.Mesh(np.array([device]), ("data",))
        return self._mesh

    @property
    def params(self) -> Any:
        return self._params

    def _on_mesh(self, fn: Any) -> Any:
        """``fn`` traced under the weights' mesh when it spans several devices, as the train step is
        traced under its own: the model's Pallas kernels then run per shard (``shard_map``), which a
        custom call XLA cannot partition needs (Mosaic refuses to be partitioned automatically)."""

        @functools.wraps(fn)
        def traced(*args, **kwargs):
            mesh = self.mesh
            if mesh.size == 1 or not jax.sharding.get_abstract_mesh().empty:
                return fn(*args, **kwargs)
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return fn(*args, **kwargs)

        return traced

    def _on_model_devices(self, tree: Any) -> Any:
        """``tree`` (the MTP module's weights) where the model's are: as it is when every leaf is
        already on the model's devices (``load_mtp(mesh=)``), else replicated over the model's mesh."""
        devices = jax.tree.leaves(self._params)[0].sharding.device_set
        if all(x.sharding.device_set == devices for x in jax.tree.leaves(tree)):
            return tree
        return jax.device_put(tree, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    @property
    def version(self) -> int:
        """Policy version: 0 at construction, +1 per ``update_params``."""
        return self._version

    def current_params(self) -> tuple[Any, int]:
        with self._lock:
            return self._params, self._version

    # ----------------------------------------------------------------- weights
    def load_params(self, *args, **kwargs) -> Any:
        return self._params

    def update_draft(self, mtp: Any) -> None:
        """New weights for the MTP module (a module or its ``nnx.state``, the structure and shapes the
        engine was built with), used from the next call on. What the engine samples does not change,
        only how many drafts survive; the draft KV the slots hold stays (made by the old weights)."""
        if not self._draft_k:
            raise ConfigError("update_draft: this engine does not decode speculatively")
        state = nnx.state(mtp) if isinstance(mtp, nnx.Module) else mtp
        check_like(self._mtp_state, state, "update_draft: the MTP weights differ")
        with launch.serial_launch():  # a reshard onto the model's devices is a launch too
            self._mtp_state = self._on_model_devices(state)

    def update_params(self, new_params: Any, version: int | None = None, *, copy: bool = False) -> int:
        """Swap in new weights (an nnx model or its ``nnx.state``) of identical structure and shapes.

        The jitted prefill/generate take parameters as arguments, so this never recompiles. Returns
        the new policy version (``version`` if given, else the previous one + 1).

        Given the very arrays the current weights were made from (``generate()`` passes the model's
        state at every call), the engine keeps the weights it made from them instead of splitting
        them into periods again; the version and the prompt cache change as for new weights.

        ``copy``: the engine keeps weights in buffers of its own, made by one program, so the caller
        may donate or overwrite ``new_params`` afterwards (a train step's state). Splitting the block
        stack into periods is itself that copy for the blocks, so the caller needs none of its own
        (which would be a second full copy of the weights alive during the swap).
        """
        if isinstance(new_params, nnx.Module):
            # A model whose leaves are the arrays the weights came from skips its state's (slower)
            # graph walk; an unusual order of leaves just takes the full path below.
            if not copy and _same_leaves(self._source, jax.tree.leaves(new_params)):
                return self._swap(self._params, self._source, version)
            new_params = nnx.state(new_params)
        # The engine's own form (``params``) is checked against its current weights, the model's
        # state against the model's shapes (and then split into periods: one copy of the blocks).
        ref = self._params if isinstance(new_params, PeriodParams) else self._spec
        check_like(ref, new_params, "update_params: new parameters differ from the engine's")
        new_leaves = jax.tree.leaves(new_params)
        # JAX arrays are immutable: the same array objects hold the same values.
        if not copy and not isinstance(new_params, PeriodParams) and _same_leaves(self._source, new_leaves):
            return self._swap(self._params, self._source, version)
        source = None if copy or isinstance(new_params, PeriodParams) else _leaf_refs(new_leaves)
        return self._swap(self._engine_params(new_params, copy=copy), source, version)

    def _swap(self, params: Any, source: tuple | None, version: int | None) -> int:
        with self._lock:
            self._params = params
            self._source = source
            self._version = self._version + 1 if version is None else int(version)
            self._prompt_cache.clear()  # prefilled with the old weights
            return self._version

    def _engine_params(self, state: Any, copy: bool = False) -> Any:
        """The model's state in the engine's form (``PeriodParams`` when unrolling periods, the
        layers' matmul weights in the compute dtype: ``_in_compute_dtype``); with ``copy``, every
        leaf in a new buffer (one program)."""
        if isinstance(state, PeriodParams):
            return self._copy_jit(state) if copy else state
        if not self._unroll:
            narrow = self._compute_dtype is not None
            if _is_abstract(state):  # shapes only (ahead-of-time compiles)
                return _compiled_outputs(self._cast_jit, state) if narrow else state
            return self._cast_jit(state) if (copy or narrow) else state
        if _is_abstract(state):  # shapes only (ahead-of-time compiles): the periods' shapes
            return PeriodParams(
                rest=_rest(state), periods=_compiled_outputs(self._unstack_jit, state["blocks"])
            )
        if copy:
            return self._own_periods_jit(state)
        return PeriodParams(rest=_rest(state), periods=self._unstack_jit(state["blocks"]))

    def _unstack_impl(self, blocks):
        blocks = _in_compute_dtype(blocks, self._compute_dtype)
        return tuple(jax.tree.map(lambda a, g=g: a[g], blocks) for g in range(self._num_periods))

    def _own_periods_impl(self, state):
        return PeriodParams(
            rest=jax.tree.map(jnp.copy, _rest(state)), periods=self._unstack_impl(state["blocks"])
        )

    def _merge(self, params: Any) -> tuple[Any, tuple | None]:
        """(model, per-period block states or None) from the engine's form of the weights."""
        if isinstance(params, PeriodParams):
            state = nnx.State(dict(params.rest))
            state["blocks"] = params.periods[0]  # the stack's structure; its values are not read
            return nnx.merge(self._graphdef, state), params.periods
        return nnx.merge(self._graphdef, params), None

    def _hidden(self, model: Any, periods: tuple | None, tokens, **kwargs):
        if periods is not None:
            kwargs["periods"] = periods
        return model.hidden_states(tokens, **kwargs)

    # ----------------------------------------------------------------- tokenizer (JetStream API)
    def get_tokenizer(self) -> Any:
        return self._tokenizer

    def build_tokenizer(self, metadata: Any) -> Any:
        """JetStream's tokenizer face (padding ``encode``, ``stop_tokens``...) over ``metadata``."""
        from tmax_jax.engine.jetstream_tokenizer import JetStreamTokenizer

        return JetStreamTokenizer(metadata, stop_tokens=set(self.eos_token_ids) or None)

    def get_prefix_destination_sharding(self) -> Any:
        return None

    # ----------------------------------------------------------------- state
    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        # Built under jit so every leaf is its own buffer (donation rejects aliased zeros); the
        # parameters are an argument so they are never baked into the program as constants.
        return self._init_decode_state_jit(self._params)

    def _init_decode_state_impl(self, params) -> DecodeState:
        s = self._slots
        model, _ = self._merge(params)
        return DecodeState(
            cache=self._init_cache(model, s, self._max_len),
            tokens=jnp.zeros((s,), jnp.int32),
            generated=jnp.zeros((s,), jnp.int32),
            active=jnp.zeros((s,), bool),
            key=jax.random.split(jax.random.key(0), s),
            temperature=jnp.zeros((s,), jnp.float32),
            top_k=jnp.zeros((s,), jnp.int32),
            top_p=jnp.ones((s,), jnp.float32),
            max_tokens=jnp.ones((s,), jnp.int32),
            stop_ids=jnp.full((s, self._max_stop), -1, jnp.int32),
        )

    def _logits(self, model: Any, hidden_NxD: jax.Array) -> jax.Array:
        # The policy head the trainer applies to hidden_states() (one precision policy).
        return head_logits(hidden_NxD, model.lm_head_weight())

    # ----------------------------------------------------------------- prefill
    def attend_length(self, n: int) -> int:
        """KV length attention reads when no row holds more than ``n`` tokens after the call: a power
        of two, at least ``min_attend_bucket``, at most ``max_cache_length``."""
        if not self._narrowable:
            return self._max_len
        return min(self._max_len, max(self._min_attend, _next_pow2(n)))

    def _narrow(self, cache, length: int):
        return cache.narrow(length) if self._narrowable and length < self._max_len else cache

    def _widen(self, small, full):
        return small.widen_into(full) if self._narrowable and small is not full else small

    def _last_logits(self, model, hidden_BxTxD, true_len_B):
        last_B = jnp.maximum(true_len_B - 1, 0)
        last_BxD = jnp.take_along_axis(hidden_BxTxD, last_B[:, None, None], axis=1)[:, 0]
        return self._logits(model, last_BxD)

    def _init_cache(self, model, batch: int, length: int):
        """The model's cache, and with speculative decoding the draft's: its KV as extra attention
        layers, its pending inputs as ``draft`` (``_draft_prefill``)."""
        cache = model.init_cache(batch, length, dtype=self._cache_dtype)
        if not self._draft_k:
            return cache
        k_shape, v_shape = cache.kv_shapes(model.config, batch, length)
        extra_k = tuple(jnp.zeros(k_shape, self._cache_dtype) for _ in range(self._mtp_layers))
        extra_v = tuple(jnp.zeros(v_shape, self._cache_dtype) for _ in range(self._mtp_layers))
        k1, D = self._draft_k + 1, model.config.hidden_size
        draft = dict(
            hidden=jnp.zeros((batch, k1, D), model.dtype),
            ids=jnp.zeros((batch, k1), jnp.int32),
            n=jnp.zeros((batch,), jnp.int32),
        )
        return cache.replace(k=cache.k + extra_k, v=cache.v + extra_v, draft=draft)

    def _mtp_kv(self, cache):
        n = self._n_full
        return tuple((cache.k[n + i], cache.v[n + i]) for i in range(self._mtp_layers))

    def _with_mtp_kv(self, cache, kv):
        n = self._n_full
        return cache.replace(k=cache.k[:n] + tuple(a for a, _ in kv), v=cache.v[:n] + tuple(b for _, b in kv))

    def _draft_prefill(self, model, mtp, cache, hidden_BxTxD, tokens_BxT, true_len_B, base_B):
        """After a prefill of ``tokens_BxT[b, :true_len_B[b]]`` (``base_B`` tokens cached before it,
        None: none): the draft module reads every position whose next token is known — the pending
        ones of the cache before (``draft``; the last one's next token is this chunk's first) and the
        chunk's but its last — and the chunk's last hidden state becomes the one pending input,
        whose next token is the one sampled from it (set by ``insert`` or the next chunk)."""
        B, T, D = hidden_BxTxD.shape
        k1 = self._draft_k + 1  # pending-input rows of the draft state
        t = jnp.arange(T)
        h_BxTxD = hidden_BxTxD
        next_BxT = jnp.concatenate([tokens_BxT[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
        valid_BxT = t[None] < (true_len_B - 1)[:, None]
        if base_B is None:
            start_B = jnp.zeros((B,), jnp.int32)
        else:  # the pending inputs first (n of them), then the chunk's, left-aligned in one row
            dr = cache.draft
            n_B = dr["n"]
            ids = jax.vmap(lambda r, i, v: r.at[i].set(v))(
                dr["ids"], jnp.maximum(n_B - 1, 0), tokens_BxT[:, 0]
            )
            j = jnp.arange(k1 + T)
            from_chunk = j[None] >= n_B[:, None]
            src = jnp.where(from_chunk, k1 + j[None] - n_B[:, None], j[None])  # index into [pending | chunk]
            # The last k1 - n rows run past the end: they repeat the chunk's last row (not valid).
            # Unclipped, the gather fills them with NaN, which the draft's attention writes into its
            # KV past the live tokens, and a zero attention weight times NaN is NaN: every later
            # draft of the slot is lost (the emitted tokens stay right; only drafts die).
            src = jnp.minimum(src, k1 + T - 1)
            both_h = jnp.concatenate([dr["hidden"].astype(h_BxTxD.dtype), h_BxTxD], axis=1)
            both_ids = jnp.concatenate([ids, next_BxT], axis=1)
            both_valid = jnp.concatenate([jnp.arange(k1)[None] < n_B[:, None], valid_BxT], axis=1)
            h_BxTxD = jnp.take_along_axis(both_h, src[..., None], axis=1)
            next_BxT = jnp.take_along_axis(both_ids, src, axis=1)
            valid_BxT = jnp.take_along_axis(both_valid, src, axis=1)
            start_B = base_B - n_B
            t = j
        positions = start_B[:, None] + t[None]
        mtp_model = nnx.merge(self._mtp_graphdef, mtp)
        _, kv = mtp_model(
            model.embed_tokens[...], h_BxTxD, next_BxT, positions, valid_BxT.astype(jnp.int32),
            self._mtp_kv(cache), start_B, fresh_cache=base_B is None,
        )  # fmt: skip
        last_B = jnp.maximum(true_len_B - 1, 0)
        last_BxD = jnp.take_along_axis(hidden_BxTxD, last_B[:, None, None], axis=1)[:, 0]
        draft = dict(
            hidden=jnp.zeros((B, k1, D), hidden_BxTxD.dtype).at[:, 0].set(last_BxD),
            ids=jnp.zeros((B, k1), jnp.int32),
            n=jnp.ones((B,), jnp.int32),
        )
        return self._with_mtp_kv(cache, kv).replace(draft=draft)

    def _prefill_fresh_impl(self, params, tokens_BxT, true_len_B, attend: int, mtp=None):
        """Prompts ``tokens_BxT[b, :true_len_B[b]]`` on empty caches; (cache at max length, last logits)."""
        B, T = tokens_BxT.shape
        self.trace_counts[f"prefill_{B}x{T}"] += 1
        model, periods = self._merge(params)
        segment_BxT = (jnp.arange(T)[None, :] < true_len_B[:, None]).astype(jnp.int32)
        cache = self._init_cache(model, B, attend)
        hidden_BxTxD, cache = self._hidden(
            model, periods, tokens_BxT, segment_ids=segment_BxT, cache=cache, fresh_cache=True
        )
        if mtp is not None:
            cache = self._draft_prefill(model, mtp, cache, hidden_BxTxD, tokens_BxT, true_len_B, None)
        if attend < self._max_len:
            cache = cache.widen_into(self._init_cache(model, B, self._max_len))
        return cache, self._last_logits(model, hidden_BxTxD, true_len_B)

    def _prefill_cont_impl(self, params, cache, tokens_1xT, true_length, attend: int, mtp=None):
        """One chunk of one request on top of its cache (``attend`` covers the cached tokens too)."""
        self.trace_counts[f"prefill_cont_{tokens_1xT.shape[1]}"] += 1
        model, periods = self._merge(params)
        t = tokens_1xT.shape[1]
        segment_1xT = (jnp.arange(t)[None, :] < true_length).astype(jnp.int32)
        narrow = self._narrow(cache, attend)
        hidden_1xTxD, small = self._hidden(model, periods, tokens_1xT, segment_ids=segment_1xT, cache=narrow)
        if mtp is not None:
            small = self._draft_prefill(
                model, mtp, small, hidden_1xTxD, tokens_1xT, true_length[None], narrow.lengths
            )
        return self._widen(small, cache), self._last_logits(model, hidden_1xTxD, true_length[None])

    def _row_impl(self, cache_B, logits_BxV, row):
        leaves, treedef = jax.tree.flatten(cache_B)
        rows = [jax.lax.dynamic_slice_in_dim(x, row, 1, axis=a) for x, a in zip(leaves, self._axes)]
        return jax.tree.unflatten(treedef, rows), jax.lax.dynamic_slice_in_dim(logits_BxV, row, 1, axis=0)

    def _first_tokens_impl(self, logits, seeds_N, temperature_N, top_k_N, top_p_N):
        """The first token of N requests in one call, each row's key ``request_key(seed)``: tokens,
        logprobs, key data."""
        self.trace_counts[f"first_tokens_{len(logits)}"] += 1
        key_N = jax.vmap(sampling.request_key)(seeds_N)
        token_N, logprob_N = self._sample_first_impl(
            jnp.concatenate(logits, axis=0), key_N, temperature_N, top_k_N, top_p_N
        )
        return token_N, logprob_N, jax.random.key_data(key_N)

    def _sample_first_impl(self, logits_NxV, key_N, temperature_N, top_k_N, top_p_N):
        """Each row's first token: its request key at step 0."""
        self.trace_counts["sample_first"] += 1
        keys_N = sampling.step_keys(key_N, jnp.zeros(key_N.shape[:1], jnp.int32))
        return sampling.sample(logits_NxV, keys_N, temperature_N, top_k_N, top_p_N)

    def bucket(self, n: int) -> int:
        """Padded length used for a prefill of ``n`` tokens."""
        return min(max(_next_pow2(n), self._min_bucket), self._max_prefill)

    def _stop_array(self, stop_token_ids: Sequence[int] | None) -> np.ndarray:
        ids = self.eos_token_ids if stop_token_ids is None else tuple(int(t) for t in stop_token_ids)
        if len(ids) > self._max_stop:
            raise ConfigError(
                f"{len(ids)} stop tokens given, the engine allows max_stop_tokens={self._max_stop}"
            )
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ConfigError(f"stop token ids {bad} are outside the vocabulary [0, {self.vocab_size})")
        out = np.full((1, self._max_stop), -1, np.int32)
        out[0, : len(ids)] = ids
        return out

    def _check_request(self, tokens: Any, true_length: int, base: int, max_tokens: int | None) -> np.ndarray:
        tokens = np.asarray(tokens)
        if tokens.ndim == 2 and tokens.shape[0] == 1:
            tokens = tokens[0]
        if tokens.ndim != 1:
            raise ConfigError(f"prefill: padded_tokens must be 1-D or [1, T], got shape {np.shape(tokens)}")
        if not 1 <= true_length <= tokens.shape[0]:
            raise ConfigError(f"prefill: true_length={true_length} outside [1, {tokens.shape[0]}]")
        tokens = tokens[:true_length]
        if np.any(tokens < 0) or np.any(tokens >= self.vocab_size):
            raise ConfigError(f"prefill: token ids must lie in [0, {self.vocab_size})")
        if base + true_length >= self._max_len:
            raise ConfigError(
                f"prefill: {base} cached + {true_length} new tokens leave no room to generate in "
                f"max_cache_length={self._max_len}"
            )
        if max_tokens is not None and (
            isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
        ):
            raise ConfigError(f"max_tokens must be a positive integer, got {max_tokens!r}")
        return tokens.astype(np.int32)

    def _make_prefixes(self, items: list[tuple[Any, jax.Array, PrefillRequest, int]]) -> list[Prefix]:
        """A Prefix for each (cache, logits [1, V], request, length): the first tokens are drawn in one
        call (the count padded to a power of two, so few shapes compile) and read back at once, so
        the prefixes' small fields are host arrays (the key as raw key data) and making them costs
        no device call per request (the caller reads the first tokens right away anyway)."""
        if not items:
            return []
        reqs = [req for _, _, req, _ in items]
        sps = [r.sampling_params or self.default_sampling for r in reqs]
        temperature = np.array([sp.temperature for sp in sps], np.float32)
        top_k = np.array([sp.top_k for sp in sps], np.int32)
        top_p = np.array([sp.top_p for sp in sps], np.float32)
        if all(-(2**31) <= sp.seed < 2**31 for sp in sps):
            pad = _next_pow2(len(items)) - len(items)

            def padded(a):
                return np.concatenate([a, np.repeat(a[-1:], pad, axis=0)])

            logits = tuple(lg for _, lg, _, _ in items) + (items[-1][1],) * pad
            seeds = np.array([sp.seed for sp in sps], np.int32)
            token, log_prob, key_data = jax.device_get(
                self._first_tokens_jit(logits, *map(padded, (seeds, temperature, top_k, top_p)))
            )
        else:  # a seed past int32: its key is jax.random.key of the Python int, one request at a time
            draws = []
            for i, (_, logits_1xV, _, _) in enumerate(items):
                key_1 = sampling.request_key(sps[i].seed)[None]
                row = slice(i, i + 1)
                draw = self._sample_first_jit(logits_1xV, key_1, temperature[row], top_k[row], top_p[row])
                draws.append((*draw, jax.random.key_data(key_1)))
            token, log_prob, key_data = (np.concatenate(f) for f in zip(*jax.device_get(draws)))
        max_tokens = np.array(
            [self._max_len if r.max_tokens is None else r.max_tokens for r in reqs], np.int32
        )
        stop_ids = np.concatenate([self._stop_array(r.stop_token_ids) for r in reqs])
        return [
            Prefix(
                cache=cache,
                token=token[i : i + 1],
                log_prob=log_prob[i : i + 1],
                key=key_data[i : i + 1],
                temperature=temperature[i : i + 1],
                top_k=top_k[i : i + 1],
                top_p=top_p[i : i + 1],
                max_tokens=max_tokens[i : i + 1],
                stop_ids=stop_ids[i : i + 1],
                length=length,
            )
            for i, (cache, _, _, length) in enumerate(items)
        ]

    def _prefill_chunked(self, params, tokens: np.ndarray, existing: Prefix | None):
        """One request, chunked by ``max_prefill_length``, on top of ``existing``; (cache, logits)."""
        base = 0 if existing is None else existing.length
        cache = None if existing is None else existing.cache
        start, logits = 0, None
        while start < len(tokens):
            n = min(len(tokens) - start, self._max_prefill)
            chunk = np.zeros((1, self.bucket(n)), np.int32)
            chunk[0, :n] = tokens[start : start + n]
            self.prefill_counts["calls"] += 1
            if cache is None:
                attend = self.attend_length(chunk.shape[1])
                cache, logits = self._prefill_fresh_jit(
                    params, jnp.asarray(chunk), jnp.full((1,), n, jnp.int32), attend, mtp=self._mtp_state
                )
            else:
                attend = self.attend_length(base + start + chunk.shape[1])
                cache, logits = self._prefill_cont_jit(
                    params, cache, jnp.asarray(chunk), jnp.int32(n), attend, mtp=self._mtp_state
                )
            start += n
        self.prefill_counts["rows"] += 1
        return cache, logits

    def prefill_many(self, params: Any, requests: Sequence[PrefillRequest]) -> list[Prefix]:
        """Prefill several requests, returning one Prefix each (in order).

        Prompts without an existing prefix that fit one prefill run batched (one call per length
        bucket, up to ``max_prefill_batch`` rows); requests with the same prompt share one row whose
        cache each forks, and a prompt prefilled recently with these weights is not prefilled again.
        Every request samples its first token from the shared logits with its own key, so the result
        is what it would be alone.
        """
        checked = []
        for r in requests:
            base = 0 if r.existing_prefix is None else r.existing_prefix.length
            tokens = self._check_request(r.tokens, len(r.tokens), base, r.max_tokens)
            checked.append(tokens)
        # (request index, cache, last logits [1, V], tokens cached): first tokens drawn at the end.
        made: list[tuple[int, Any, jax.Array, int]] = []
        shared: dict[tuple[int, ...], list[int]] = {}
        for i, (r, tokens) in enumerate(zip(requests, checked)):
            if r.existing_prefix is None and len(tokens) <= self._max_prefill:
                shared.setdefault(tuple(tokens.tolist()), []).append(i)
            else:
                cache, logits = self._prefill_chunked(params, tokens, r.existing_prefix)
                base = 0 if r.existing_prefix is None else r.existing_prefix.length
                made.append((i, cache, logits, base + len(tokens)))
        rows: dict[tuple[int, ...], tuple[Any, jax.Array]] = {}
        cacheable = self._prompt_cache_entries > 0 and params is self._params
        with self._lock:
            for prompt in shared:
                hit = self._prompt_cache.get(prompt) if cacheable and params is self._params else None
                if hit is not None:
                    self._prompt_cache.move_to_end(prompt)
                    rows[prompt] = hit
        todo = [p for p in shared if p not in rows]
        by_bucket: dict[int, list[tuple[int, ...]]] = {}
        for p in todo:
            by_bucket.setdefault(self.bucket(len(p)), []).append(p)
        for width, prompts in sorted(by_bucket.items()):
            for c in range(0, len(prompts), self._max_prefill_batch):
                chunk = prompts[c : c + self._max_prefill_batch]
                b = _next_pow2(len(chunk))
                tokens_BxT = np.zeros((b, width), np.int32)
                true_len_B = np.zeros((b,), np.int32)
                for j, p in enumerate(chunk):
                    tokens_BxT[j, : len(p)] = p
                    true_len_B[j] = len(p)
                self.prefill_counts["calls"] += 1
                self.prefill_counts["rows"] += len(chunk)
                cache_B, logits_BxV = self._prefill_fresh_jit(
                    params,
                    jnp.asarray(tokens_BxT),
                    jnp.asarray(true_len_B),
                    self.attend_length(width),
                    mtp=self._mtp_state,
                )
                for j, p in enumerate(chunk):
                    rows[p] = (
                        (cache_B, logits_BxV) if b == 1 else self._row_jit(cache_B, logits_BxV, jnp.int32(j))
                    )
                if cacheable:
                    with self._lock:
                        if params is self._params:  # not swapped meanwhile (that clears the cache)
                            for p in chunk:
                                self._prompt_cache[p] = rows[p]
                            while len(self._prompt_cache) > self._prompt_cache_entries:
                                self._prompt_cache.popitem(last=False)
        for prompt, members in shared.items():
            cache, logits = rows[prompt]
            self.prefill_counts["forked"] += len(members) - (prompt in todo)
            made += [(i, cache, logits, len(prompt)) for i in members]
        prefixes = self._make_prefixes([(c, lg, requests[i], n) for i, c, lg, n in made])
        out: list[Prefix | None] = [None] * len(requests)
        for (i, *_), prefix in zip(made, prefixes):
            out[i] = prefix
        return out  # type: ignore[return-value]

    def prefill(
        self,
        *,
        params: Any,
        existing_prefix: Prefix | None = None,
        padded_tokens: jax.Array,
        true_length: int,
        sampler: Any | None = None,
        sampling_params: SamplingParams | None = None,
        max_tokens: int | None = None,
        stop_token_ids: Sequence[int] | None = None,
    ) -> tuple[Prefix, ResultTokens]:
        """Prefill ``padded_tokens[:true_length]`` (1-D or [1, T]) on top of ``existing_prefix``.

        ``sampling_params``/``max_tokens``/``stop_token_ids`` are tmax-jax extensions (JetStream's
        orchestrator leaves them out and gets the engine defaults). The first token is sampled here
        with the request's key at step 0.
        """
        if sampler is not None:
            raise ConfigError("Engine.prefill: custom samplers are not supported; pass sampling_params")
        base = 0 if existing_prefix is None else existing_prefix.length
        tokens = self._check_request(padded_tokens, int(true_length), base, max_tokens)
        req = PrefillRequest(tokens.tolist(), sampling_params, max_tokens, stop_token_ids, existing_prefix)
        (prefix,) = self.prefill_many(params, [req])
        return prefix, self.first_result(prefix)

    @staticmethod
    def first_result(prefix: Prefix) -> ResultTokens:
        """A prefix's first token as JetStream's ResultTokens (one slot, one token)."""
        data = jnp.stack([prefix.token, jnp.ones((1,), jnp.int32), jnp.ones((1,), jnp.int32)], axis=-1)
        return ResultTokens(data, _TOKENS, _VALID, _LENGTHS, 1, log_prob=prefix.log_prob[:, None])

    # ----------------------------------------------------------------- insert / extract
    def _set_row(self, big, small, slot):
        leaves, treedef = jax.tree.flatten(big)
        rows = jax.tree.leaves(small)
        out = [
            jax.lax.dynamic_update_slice_in_dim(x, r.astype(x.dtype), slot, axis=a)
            for x, r, a in zip(leaves, rows, self._axes)
        ]
        return jax.tree.unflatten(treedef, out)

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot):
        self.trace_counts["insert"] += 1
        cache = self._set_row(state.cache, prefix.cache, slot)
        if self._draft_k:  # the last pending draft input's next token is the one the slot feeds next
            dr = cache.draft
            last = jnp.maximum(dr["n"][slot] - 1, 0)
            cache = cache.replace(draft=dict(dr, ids=dr["ids"].at[slot, last].set(prefix.token[0])))
        lengths = jax.tree.leaves(prefix.cache.lengths)[0] if hasattr(prefix.cache, "lengths") else None
        token = prefix.token[0]
        stop = jnp.any(prefix.stop_ids[0] == token)
        room = True if lengths is None else lengths[0] < self._max_len
        active = (~stop) & (prefix.max_tokens[0] > 1) & room

        def put(arr, value):
            return jax.lax.dynamic_update_index_in_dim(arr, jnp.asarray(value, arr.dtype), slot, axis=0)

        return DecodeState(
            cache=cache,
            tokens=put(state.tokens, token),
            generated=put(state.generated, 1),
            active=put(state.active, active),
            key=put(state.key, _typed_key(prefix.key, state.key)[0]),
            temperature=put(state.temperature, prefix.temperature[0]),
            top_k=put(state.top_k, prefix.top_k[0]),
            top_p=put(state.top_p, prefix.top_p[0]),
            max_tokens=put(state.max_tokens, prefix.max_tokens[0]),
            stop_ids=put(state.stop_ids, prefix.stop_ids[0]),
        )

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self._slots:
            raise ConfigError(f"slot must be an integer in [0, {self._slots}), got {slot!r}")

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
        self._check_slot(slot)
        return self._insert_jit(prefix.replace(length=0), decode_state, jnp.int32(slot))

    def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots: list[int]) -> DecodeState:
        for slot in slots:
            decode_state = self.insert(prefix, decode_state, slot)
        return decode_state

    def _extract_impl(self, state: DecodeState, slot):
        self.trace_counts["extract"] += 1
        leaves, treedef = jax.tree.flatten(state.cache)
        rows = [jax.lax.dynamic_slice_in_dim(x, slot, 1, axis=a) for x, a in zip(leaves, self._axes)]

        def row(arr):
            return jax.lax.dynamic_slice_in_dim(arr, slot, 1, axis=0)

        return Prefix(
            cache=jax.tree.unflatten(treedef, rows),
            token=row(state.tokens),
            log_prob=jnp.zeros((1,), jnp.float32),
            key=row(state.key),
            temperature=row(state.temperature),
            top_k=row(state.top_k),
            top_p=row(state.top_p),
            max_tokens=row(state.max_tokens),
            stop_ids=row(state.stop_ids),
        )

    def extract_prefix(self, decode_state: DecodeState, slot: int, length: int) -> Prefix:
        """The state of ``slot`` as a Prefix (for the next turn of a session): ``length`` tokens cached.

        The slot's last sampled token is *not* in the cache; the next turn feeds it with its new tokens.
        """
        self._check_slot(slot)
        return self._extract_jit(decode_state, jnp.int32(slot)).replace(length=int(length))

    def _deactivate_impl(self, state: DecodeState, slot):
        return state.replace(
            active=jax.lax.dynamic_update_index_in_dim(state.active, jnp.asarray(False), slot, axis=0)
        )

    def free_resource(self, slot: int) -> Any:
        return None

    def deactivate(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """Stop decoding ``slot`` (cancelled, or ended by a stop string found on the host)."""
        self._check_slot(slot)
        return self._deactivate_jit(decode_state, jnp.int32(slot))

    # ----------------------------------------------------------------- ahead of time
    # An engine built from an ``nnx.eval_shape`` model (shapes with shardings) lowers its programs
    # without allocating anything; ``.compile()`` of the result compiles them for the params' devices.
    def abstract_decode_state(self) -> DecodeState:
        """Shapes of ``init_decode_state()``, without shardings: its program reads no input, so its
        outputs are uncommitted arrays on one device, placed by the first program that reads them."""
        return jax.eval_shape(self._init_decode_state_impl, self._params)

    def lower_prefill(self, rows: int | None = None, width: int | None = None) -> Any:
        """``prefill_many``'s batched program for ``rows`` prompts (default ``max_prefill_batch``) of
        ``width`` tokens (default ``max_prefill_length``), as its calls run it."""
        rows = self._max_prefill_batch if rows is None else _next_pow2(rows)
        width = self.bucket(self._max_prefill if width is None else width)
        tokens_BxT = jax.ShapeDtypeStruct((rows, width), jnp.int32)
        true_len_B = jax.ShapeDtypeStruct((rows,), jnp.int32)
        attend = self.attend_length(width)
        return self._prefill_fresh_jit.lower(
            self._params, tokens_BxT, true_len_B, attend, mtp=self._mtp_state
        )

    def lower_generate_block(self, max_length: int | None = None) -> Any:
        """``generate_block``'s program with attention over ``max_length`` tokens (default the whole
        cache, its largest bucket), as its calls run it."""
        attend = self.attend_length(self._max_len if max_length is None else max_length)
        steps = jax.ShapeDtypeStruct((), jnp.int32)
        return self._block_jit.lower(
            self._params,
            self.abstract_decode_state(),
            steps,
            attend,
            mtp=self._mtp_state,
            speculate=jax.ShapeDtypeStruct((), jnp.bool_),
        )

    # ----------------------------------------------------------------- generate
    def _decode_step(self, model, periods, state: DecodeState):
        active_S = state.active
        res = self._hidden(
            model,
            periods,
            state.tokens[:, None],
            segment_ids=active_S[:, None].astype(jnp.int32),
            cache=state.cache,
            return_routing=self.record_routing,
        )
        hidden_Sx1xD, cache = res[:2]
        logits_SxV = self._logits(model, hidden_Sx1xD[:, 0])
        keys_S = sampling.step_keys(state.key, state.generated)
        tokens_S, logprobs_S = sampling.sample(
            logits_SxV, keys_S, state.temperature, state.top_k, state.top_p
        )
        generated_S = state.generated + active_S.astype(jnp.int32)
        stopped_S = jnp.any(state.stop_ids == tokens_S[:, None], axis=-1)
        # The new token must be fed next step; a full cache has nowhere to put it.
        full_S = cache.lengths >= self._max_len
        done_S = stopped_S | (generated_S >= state.max_tokens) | full_S
        new_state = state.replace(
            cache=cache,
            tokens=jnp.where(active_S, tokens_S, state.tokens),
            generated=generated_S,
            active=active_S & ~done_S,
        )
        out = (jnp.where(active_S, tokens_S, 0), active_S, jnp.where(active_S, logprobs_S, 0.0), generated_S)
        if self.record_routing:  # [layers, S, 1, K] -> [S, layers, K]; -1 for inactive slots
            experts_SxLxK = jnp.moveaxis(res[2][:, :, 0], 0, 1)
            out = (*out, jnp.where(active_S[:, None, None], experts_SxLxK, -1))
        return new_state, out

    def _generate_impl(self, params, state: DecodeState):
        self.trace_counts["generate"] += 1
        model, periods = self._merge(params)
        new_state, (tokens_S, active_S, logprobs_S, generated_S, *_) = self._decode_step(
            model, periods, state
        )
        data_Sx3 = jnp.stack([tokens_S, active_S.astype(jnp.int32), generated_S], axis=-1)
        result = ResultTokens(data_Sx3, _TOKENS, _VALID, _LENGTHS, 1, log_prob=logprobs_S[:, None])
        return new_state, result

    def generate(
        self, params: Any, decode_state: DecodeState, sampler: Any | None = None
    ) -> tuple[DecodeState, ResultTokens]:
        """One decode step over every slot (JetStream's call); ``generate_block`` runs several."""
        if sampler is not None:
            raise ConfigError("Engine.generate: custom samplers are not supported")
        if self._draft_k:
            raise ConfigError("Engine.generate: a speculative engine decodes in blocks (generate_block)")
        return self._generate_jit(params, decode_state)

    def _generate_block_impl(self, params, state: DecodeState, steps, attend: int, mtp=None, speculate=True):
        """Up to ``steps`` (traced, at most ``decode_steps``: one compile per ``attend``) decode steps;
        the loop ends early once no slot is decoding."""
        self.trace_counts[f"generate_block_{attend}"] += 1
        model, periods = self._merge(params)
        full = state.cache
        K, S, R = self.decode_steps, self._slots, self.tokens_per_step
        bufs = (
            jnp.zeros((K, R, S), jnp.int32),
            jnp.zeros((K, R, S), bool),
            jnp.zeros((K, R, S), jnp.float32),
            jnp.zeros((K, R, S), jnp.int32),
        )
        if self.record_routing:
            cfg = model.config
            bufs += (jnp.full((K, R, S, cfg.num_hidden_layers, cfg.num_experts_per_tok), -1, jnp.int32),)

        def cond(carry):
            j, st, _ = carry
            return (j < steps) & jnp.any(st.active)

        def body(carry):
            j, st, bufs = carry
            if self._draft_k:
                st, outs = self._speculative_step(model, periods, mtp, st, speculate)
            else:
                st, outs = self._decode_step(model, periods, st)
                outs = tuple(o[None] for o in outs)
            bufs = tuple(jax.lax.dynamic_update_index_in_dim(b, o, j, axis=0) for b, o in zip(bufs, outs))
            return j + 1, st, bufs

        init = (jnp.int32(0), state.replace(cache=self._narrow(full, attend)), bufs)
        _, small, bufs = jax.lax.while_loop(cond, body, init)
        new_state = small.replace(cache=self._widen(small.cache, full))
        # [steps, tokens per step, ...] -> one row per token a step may emit
        return new_state, DecodeBlock(*(b.reshape(K * R, *b.shape[2:]) for b in bufs))

    def _speculative_step(self, model, periods, mtp, st: DecodeState, speculate=True):
        """One speculative decode step over every slot: draft ``k`` tokens, verify them with the model
        in one pass over ``k + 1`` tokens, keep the longest agreeing run plus the model's next token
        (cut at a stop token, ``max_tokens`` or a full cache). Outputs ``[k + 1, S]`` each.
        ``speculate`` False: no draft is kept (one token per step)."""
        k, S = self._draft_k, self._slots
        k1 = k + 1
        cache, active = st.cache, st.active
        dr = cache.draft
        L = cache.lengths
        embed = model.embed_tokens[...]
        mtp_model = nnx.merge(self._mtp_graphdef, mtp)
        # 1. The draft reads its pending inputs (positions L - n .. L - 1), then drafts ahead.
        n = jnp.where(active, dr["n"], 0)
        j1 = jnp.arange(k1)
        seg = (j1[None] < n[:, None]).astype(jnp.int32)
        m_SxK1xD, kv = mtp_model(
            embed, dr["hidden"], dr["ids"], (L - n)[:, None] + j1[None], seg, self._mtp_kv(cache), L - n
        )
        h_SxD = jnp.take_along_axis(m_SxK1xD, jnp.maximum(n - 1, 0)[:, None, None], axis=1)[:, 0]
        # The keys of the step's k + 1 tokens, made once: verify row j samples with key j, and draft
        # i with the key of the token it guesses (key i).
        gen_SxK1 = st.generated[:, None] + j1[None]
        keys = sampling.step_keys(jnp.repeat(st.key, k1, axis=0), gen_SxK1.reshape(-1))
        keys_SxK1 = keys.reshape(S, k1, *keys.shape[1:])
        drafts = []
        for i in range(k):
            d_S, _ = sampling.sample(
                self._logits(model, h_SxD), keys_SxK1[:, i], st.temperature, st.top_k, st.top_p
            )
            drafts.append(d_S)
            if i + 1 < k:  # provisional positions: the next step's pending inputs overwrite them
                pos = (L + i)[:, None]
                m, kv = mtp_model(
                    embed, h_SxD[:, None], d_S[:, None], pos, active[:, None].astype(jnp.int32), kv, L + i
                )
                h_SxD = m[:, 0]
        drafts_SxK = jnp.stack(drafts, axis=1)
        # 2. The model over [fed token, drafts]: every DeltaNet state kept, to keep the accepted one.
        inputs_SxK1 = jnp.concatenate([st.tokens[:, None], drafts_SxK], axis=1)
        seg_SxK1 = jnp.broadcast_to(active[:, None], (S, k1)).astype(jnp.int32)
        hidden_SxK1xD, vc = self._hidden(
            model,
            periods,
            inputs_SxK1,
            segment_ids=seg_SxK1,
            cache=self._with_mtp_kv(cache, kv),
            keep_states=True,
        )
        logits = self._logits(model, hidden_SxK1xD.reshape(S * k1, -1))

        def per_token(a):
            return jnp.repeat(a, k1, axis=0)

        y, lp = sampling.sample(
            logits, keys, per_token(st.temperature), per_token(st.top_k), per_token(st.top_p)
        )
        y_SxK1, lp_SxK1 = y.reshape(S, k1), lp.reshape(S, k1)
        # 3. How many tokens each slot emits.
        agree = jnp.cumprod((drafts_SxK == y_SxK1[:, :k]).astype(jnp.int32), axis=1).sum(axis=1)
        agree = jnp.where(speculate, agree, 0)
        stop_SxK1 = jnp.any(st.stop_ids[:, None, :] == y_SxK1[..., None], axis=-1)
        first_stop = jnp.where(jnp.any(stop_SxK1, axis=1), jnp.argmax(stop_SxK1, axis=1), k1)
        emit = jnp.minimum(agree + 1, first_stop + 1)
        emit = jnp.minimum(emit, st.max_tokens - st.generated)
        emit = jnp.minimum(emit, self._max_len - L)
        emit = jnp.where(active, jnp.maximum(emit, 1), 0)
        last = jnp.maximum(emit - 1, 0)

        # 4. The cache holds the emitted tokens' inputs: the state after input ``emit - 1``.
        def pick(all_BxT, old):
            kept = jnp.take_along_axis(all_BxT, last.reshape((S, 1) + (1,) * (all_BxT.ndim - 2)), axis=1)[
                :, 0
            ]
            return jnp.where(active.reshape((S,) + (1,) * (old.ndim - 1)), kept.astype(old.dtype), old)

        hidden_keep = jnp.where(active[:, None, None], hidden_SxK1xD.astype(dr["hidden"].dtype), dr["hidden"])
        new_cache = vc.replace(
            lengths=L + emit,
            conv=tuple(pick(a, o) for a, o in zip(vc.conv, cache.conv)),
            recurrent=tuple(pick(a, o) for a, o in zip(vc.recurrent, cache.recurrent)),
            draft=dict(
                hidden=hidden_keep,
                ids=jnp.where(active[:, None], y_SxK1, dr["ids"]),
                n=jnp.where(active, emit, dr["n"]),
            ),
        )
        valid_SxK1 = j1[None] < emit[:, None]
        generated = st.generated + emit
        stopped = jnp.any(stop_SxK1 & valid_SxK1, axis=1)
        done = stopped | (generated >= st.max_tokens) | (new_cache.lengths >= self._max_len)
        last_token = jnp.take_along_axis(y_SxK1, last[:, None], axis=1)[:, 0]
        new_state = st.replace(
            cache=new_cache,
            tokens=jnp.where(active, last_token, st.tokens),
            generated=generated,
            active=active & ~done,
        )
        outs = (
            jnp.where(valid_SxK1, y_SxK1, 0).T,
            valid_SxK1.T,
            jnp.where(valid_SxK1, lp_SxK1, 0.0).T,
            (st.generated[:, None] + j1[None] + 1).T,
        )
        return new_state, outs

    def _live_length_impl(self, state: DecodeState):
        return jnp.max(jnp.where(state.active, state.cache.lengths, 0))

    def generate_block(
        self,
        params: Any,
        decode_state: DecodeState,
        steps: int | None = None,
        max_length: int | None = None,
        speculate: bool = True,
    ) -> tuple[DecodeState, DecodeBlock]:
        """``steps`` (default and at most ``decode_steps``) decode steps in one call, the same tokens
        and logprobs as as many ``generate`` calls; the weights are ``params`` for the whole block.
        The block's arrays always have ``decode_steps`` rows; rows past ``steps`` are not valid.

        ``max_length``: the most tokens a decoding slot holds now (the caller's bookkeeping); read
        from the device when not given. Attention reads a power-of-two bucket of it plus ``steps``.
        ``speculate`` False (a speculative engine): keep no draft, one token per slot and step (the
        caller stops on stop strings after each token and keeps the cache).
        """
        steps = self.decode_steps if steps is None else steps
        if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= self.decode_steps:
            raise ConfigError(
                f"generate_block: steps must be an integer in [1, decode_steps={self.decode_steps}], got {steps!r}"
            )
        if max_length is None:
            max_length = int(jax.device_get(self._live_length_jit(decode_state)))
        attend = self.attend_length(int(max_length) + steps * self.tokens_per_step)
        return self._block_jit(
            params,
            decode_state,
            jnp.int32(steps),
            attend,
            mtp=self._mtp_state,
            speculate=jnp.bool_(speculate),
        )
