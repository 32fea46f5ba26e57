"""The jitted, sharded RL train step: policy loss on packed rows, gradient accumulation, AdamW.

``TrainStep`` owns the optimizer, the shardings of params / optimizer state / batches on a mesh, and
one ``jax.jit`` of the step with ``in_shardings`` / ``out_shardings`` and the state donated. The batch
contract is documented in ``tmax_jax.rl.packing`` (all fields ``[B, T]``).
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from tmax_jax import launch
from tmax_jax import sharding as shd
from tmax_jax.errors import ConfigError
from tmax_jax.rl.config import LossConfig, RLConfig
from tmax_jax.rl.logprobs import token_logprobs
from tmax_jax.rl.losses import combine_stats, finalize_stats, loss_normalizer, loss_terms
from tmax_jax.rl.optim import learning_rate_schedule, make_optimizer
from tmax_jax.rl.packing import BATCH_FIELDS, ROUTING_FIELD, empty_batch, validate_batch

# Optional batch field: int32 [B, T], the learner's version minus the oldest version that sampled each
# target or a generated token before it (policy_lag(); < 0 where unknown or not generated). It feeds
# the mismatch / staleness metrics only; a batch without it gets -1 everywhere.
LAG_FIELD = "policy_lag"
# Optional batch field of MoE runs with train_step.routing_replay (ROUTING_FIELD, packing.py): int16
# [B, T, layers, top_k], the expert ids the engine routed each input token to in each MoE layer (-1
# where not recorded).
# Per-expert router sums carried through micro-batches as stats (summed), reported as router/*.
_ROUTER_STATS = ("router_tokens", "router_probs", "router_count")


@struct.dataclass
class TrainState:
    """Everything a resumed run needs on device. ``rng`` is a raw uint32[2] key (checkpoint-friendly)."""

    step: jax.Array  # int32 []
    params: nnx.State
    opt_state: optax.OptState
    rng: jax.Array


def make_model(model_cfg, *, remat: str = "full", dtype=jnp.float32, param_dtype=jnp.float32, seed: int = 0):
    """A fresh Qwen 3.5 policy with random weights (params are placed on the mesh by ``TrainStep``)."""
    from tmax_jax.models.qwen35 import Qwen35ForCausalLM

    # Params are created unsharded on the host and placed afterwards, with shapes checked per mesh.
    with nnx.use_eager_sharding(False):
        return Qwen35ForCausalLM(
            model_cfg, dtype=dtype, param_dtype=param_dtype, rngs=nnx.Rngs(seed), remat=remat
        )


def _copy_tree(tree):
    return jax.tree.map(jnp.copy, tree)


class TrainStep:
    """One optimizer step per call: ``state, metrics = train_step(state, batch)``.

    ``model`` supplies the graph (and the initial params for ``init_state``); its ``remat`` and
    ``dtype`` are whatever it was built with (``make_model``).
    """

    def __init__(self, model, cfg: RLConfig, mesh: Mesh, mesh_cfg: shd.MeshConfig = shd.MeshConfig()):
        self.cfg = cfg
        self.mesh = mesh
        self.mesh_cfg = mesh_cfg
        self.graphdef, params, self.rest = nnx.split(model, nnx.Param, ...)
        self.optimizer = make_optimizer(cfg.optimizer)
        self.schedule = learning_rate_schedule(cfg.optimizer)
        self._params = params  # the model's own initial params, until init_state() consumes them
        self._abstract_params = jax.eval_shape(lambda: params)
        self.micro_batches = cfg.train_step.micro_batches
        self.rows_multiple = mesh.shape["data"] * mesh.shape["fsdp"] * self.micro_batches

        replicated = NamedSharding(mesh, PartitionSpec())
        self.param_shardings = shd.param_shardings(params, mesh, mesh_cfg)
        abstract_opt = jax.eval_shape(self.optimizer.init, params)
        self.opt_shardings = shd.optimizer_shardings(self.optimizer, abstract_opt, self.param_shardings, mesh)
        self.state_shardings = TrainState(
            step=replicated, params=self.param_shardings, opt_state=self.opt_shardings, rng=replicated
        )
        self.batch_shardings = {k: shd.batch_sharding(mesh, 2) for k in (*BATCH_FIELDS, LAG_FIELD)}
        model_cfg = model.config
        self.is_moe = bool(getattr(model_cfg, "is_moe", False))
        self.routing_replay = bool(cfg.train_step.routing_replay)
        if (self.routing_replay or cfg.train_step.router_aux_loss_coef) and not self.is_moe:
            raise ConfigError(
                "train_step.routing_replay / router_aux_loss_coef need a MoE model (num_experts > 0)"
            )
        if self.routing_replay:
            self.routing_shape = (model_cfg.num_hidden_layers, model_cfg.num_experts_per_tok)
            self.batch_shardings[ROUTING_FIELD] = shd.batch_sharding(mesh, 4)
        # The step and the optimizer's init launch through the process's one launch queue.
        self._jitted = launch.jit(
            self._step,
            in_shardings=(self.state_shardings, self.batch_shardings),
            out_shardings=(self.state_shardings, replicated),
            donate_argnums=(0,),
        )
        self._init_opt = launch.jit(self.optimizer.init, out_shardings=self.opt_shardings)
        # The engine's copy of the params (the step donates the state's own), made by one program.
        self._copy_params = launch.jit(_copy_tree, out_shardings=self.param_shardings)

    # -- state --------------------------------------------------------------------------------------
    def init_state(self, params: nnx.State | None = None, *, seed: int = 0) -> TrainState:
        """Place params on the mesh (resharding if needed) and create the AdamW state there."""
        if params is None:
            if self._params is None:
                raise RuntimeError("init_state() without params works once (the model's initial params)")
            params, self._params = self._params, None
        with jax.set_mesh(self.mesh):
            params = shd.shard_tree(params, self.param_shardings)
            opt_state = self._init_opt(params)
            replicated = NamedSharding(self.mesh, PartitionSpec())
            step, rng = shd.shard_tree((jnp.zeros((), jnp.int32), jax.random.PRNGKey(seed)), replicated)
        return TrainState(step=step, params=params, opt_state=opt_state, rng=rng)

    def abstract_state(self) -> TrainState:
        """Shapes, dtypes and shardings of the train state (a restore target; allocates nothing)."""
        return abstract_train_state(self.optimizer, self._abstract_params, self.state_shardings)

    def copy_params(self, params: nnx.State) -> nnx.State:
        """A copy of ``params`` in new buffers with the same shardings, launched through the queue:
        the weights the engine samples with stay valid after the next step donates the state."""
        with jax.set_mesh(self.mesh):
            return self._copy_params(params)

    def model(self, state: TrainState):
        """The nnx model with ``state``'s params (weight sync to the engine, HF export)."""
        return nnx.merge(self.graphdef, state.params, self.rest)

    # -- batches ------------------------------------------------------------------------------------
    def put_batch(self, local_batch: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
        """Validate this process's rows and assemble the global, row-sharded batch."""
        local_batch = self._with_routing_field(with_lag_field(local_batch))
        validate_batch(
            {k: v for k, v in local_batch.items() if k not in (LAG_FIELD, ROUTING_FIELD)},
            rows_multiple=max(self.rows_multiple // jax.process_count(), 1),
        )
        return shd.global_batch(local_batch, self.mesh)

    def _with_routing_field(self, batch: Mapping) -> dict:
        """The routed_experts field present (-1: none recorded) with replay on, dropped with it off."""
        batch = dict(batch)
        if not self.routing_replay:
            batch.pop(ROUTING_FIELD, None)
            return batch
        B, T = np.shape(batch["input_ids"])
        want = (B, T, *self.routing_shape)
        if ROUTING_FIELD not in batch:
            batch[ROUTING_FIELD] = np.full(want, -1, np.int16)
        got = batch[ROUTING_FIELD]
        if tuple(np.shape(got)) != want or not np.issubdtype(np.dtype(got.dtype), np.integer):
            raise ConfigError(
                f"train batch field {ROUTING_FIELD!r} must be integer [B, T, layers, top_k] = {list(want)}, "
                f"got {np.dtype(got.dtype).name}{list(np.shape(got))}"
            )
        return batch

    def __call__(self, state: TrainState, batch: Mapping) -> tuple[TrainState, dict]:
        if not all(isinstance(v, jax.Array) for v in batch.values()):
            batch = self.put_batch(batch)
        else:
            batch = with_lag_field(batch)
            if self.routing_replay and ROUTING_FIELD not in batch:
                raise ConfigError(f"train_step.routing_replay: the device batch has no {ROUTING_FIELD!r}")
            batch = self._with_routing_field(batch)
            validate_batch(
                {k: v for k, v in batch.items() if k not in (LAG_FIELD, ROUTING_FIELD)},
                rows_multiple=self.rows_multiple,
            )
        # The model reads the logical-axis rules (the ``sequence`` split, attention's and the kernels'
        # shard_map specs) when the step is traced: a mesh.rules override must be in force then.
        with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.mesh_cfg.rules):
            return self._jitted(state, dict(batch))

    # -- ahead of time -------------------------------------------------------------------------------
    def abstract_batch(self, rows: int, seq_len: int) -> dict[str, jax.ShapeDtypeStruct]:
        """Shapes, dtypes and shardings of a device batch of ``rows`` x ``seq_len`` (what ``put_batch``
        makes; ``rows`` a multiple of ``rows_multiple``)."""
        if rows % self.rows_multiple:
            raise ConfigError(f"abstract_batch: {rows} rows, not a multiple of {self.rows_multiple}")
        shapes = {k: (v.shape, v.dtype) for k, v in empty_batch(1, 1).items()}
        shapes[LAG_FIELD] = ((1, 1), np.dtype(np.int32))
        if self.routing_replay:
            shapes[ROUTING_FIELD] = ((1, 1, *self.routing_shape), np.dtype(np.int16))
        return {
            k: jax.ShapeDtypeStruct((rows, seq_len, *shape[2:]), dtype, sharding=self.batch_shardings[k])
            for k, (shape, dtype) in shapes.items()
        }

    def lower(self, state: TrainState, batch: Mapping):
        """The step's program lowered for ``state`` and ``batch`` (arrays or ``ShapeDtypeStruct``s with
        the step's shardings: ``abstract_state``, ``abstract_batch``) as ``__call__`` traces it: same
        function, shardings, donation, mesh and rules. Nothing runs; ``.compile()`` compiles it."""
        with jax.set_mesh(self.mesh), nnx.logical_axis_rules(self.mesh_cfg.rules):
            return self._jitted.lower(state, dict(batch))

    # -- the step -----------------------------------------------------------------------------------
    def _micro_loss(self, params, mb, normalizer):
        model = nnx.merge(self.graphdef, params, self.rest)
        hidden_sharding = NamedSharding(self.mesh, PartitionSpec(shd.BATCH_AXES, None, None))
        ts = self.cfg.train_step
        return batch_loss(
            model,
            mb,
            self.cfg.loss,
            normalizer,
            hidden_sharding=hidden_sharding,
            router_aux_loss_coef=ts.router_aux_loss_coef / self.micro_batches,
            routing_replay=self.routing_replay,
        )

    def _step(self, state: TrainState, batch):
        M = self.micro_batches
        normalizer = loss_normalizer(self.cfg.loss, batch["response_mask"], batch["segment_ids"])

        def loss_and_grads(mb):
            (loss, stats), grads = jax.value_and_grad(self._micro_loss, has_aux=True)(
                state.params, mb, normalizer
            )
            return loss, stats, grads

        if M == 1:
            loss, stats, grads = loss_and_grads(batch)
        else:
            B = batch["input_ids"].shape[0]
            # [B, T] -> [M, B/M, T] taking every M-th row, so each micro-batch keeps rows on every shard.
            micro = {k: v.reshape(B // M, M, *v.shape[1:]).swapaxes(0, 1) for k, v in batch.items()}

            def body(carry, mb):
                loss, stats, grads = loss_and_grads(mb)
                loss_acc, stats_acc, grads_acc = carry
                carry = (
                    loss_acc + loss,
                    combine_stats(stats_acc, stats),
                    jax.tree.map(jnp.add, grads_acc, grads),
                )
                return carry, None

            # One traced copy of forward + backward (the scan body), whatever M is.
            shapes = jax.eval_shape(loss_and_grads, {k: v[0] for k, v in micro.items()})
            zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
            (loss, stats, grads), _ = jax.lax.scan(body, zeros, micro)

        updates, opt_state = self.optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        rng, _ = jax.random.split(state.rng)
        router = {k: stats.pop(k) for k in _ROUTER_STATS if k in stats}
        metrics = {
            "loss": loss,
            "grad_norm": optax.tree.norm(grads),
            "learning_rate": jnp.asarray(self.schedule(state.step), jnp.float32),
            **finalize_stats(stats),
        }
        if router:
            from tmax_jax.models.qwen35.moe import RouterStats

            metrics |= RouterStats(*(router[k] for k in _ROUTER_STATS)).metrics()
        new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, rng=rng)
        return new_state, metrics


def batch_loss(
    model,
    mb: Mapping,
    loss_cfg: LossConfig,
    normalizer,
    *,
    hidden_sharding=None,
    router_aux_loss_coef: float = 0.0,
    routing_replay: bool = False,
):
    """(loss, stat sums) of one (micro-)batch: the model's float32 token logprobs fed to the policy loss.

    MoE models also sum their router statistics into the stats (router/* metrics), add
    ``router_aux_loss_coef`` times the load-balancing loss, and with ``routing_replay`` route by the
    batch's ``routed_experts``."""
    moe = bool(getattr(model.config, "is_moe", False))
    kw = dict(positions=mb["positions"], segment_ids=mb["segment_ids"])
    router = None
    if moe:
        routing = None
        if routing_replay:
            routing = jnp.moveaxis(mb[ROUTING_FIELD].astype(jnp.int32), 2, 0)  # [L, B, T, K]
        hidden_BxTxD, router = model.hidden_states(mb["input_ids"], router_stats=True, routing=routing, **kw)
    else:
        hidden_BxTxD = model.hidden_states(mb["input_ids"], **kw)
    if hidden_sharding is not None:
        hidden_BxTxD = jax.lax.with_sharding_constraint(hidden_BxTxD, hidden_sharding)
    head, head_vd = model.lm_head_stored()
    logprobs_BxT = token_logprobs(
        hidden_BxTxD,
        head,
        mb["targets"],
        temperature=loss_cfg.temperature,
        top_k=loss_cfg.top_k,
        top_p=loss_cfg.top_p,
        chunk_size=loss_cfg.logprob_chunk,
        mask_BxT=mb["response_mask"],
        head_vd=head_vd,
    )
    # The head ran on response tokens only; elsewhere the loss reads the rollout's own logprob
    # (ratio 1), never a placeholder that could overflow exp() in masked-out sums.
    logprobs_BxT = jnp.where(mb["response_mask"] > 0, logprobs_BxT, mb["rollout_logprobs"])
    loss_sum, stats = loss_terms(
        loss_cfg,
        logprobs_BxT,
        mb["rollout_logprobs"],
        mb["advantages"],
        mb["response_mask"],
        mb["segment_ids"],
        mb.get(LAG_FIELD),
    )
    loss = loss_sum / normalizer
    if router is not None:
        if router_aux_loss_coef:
            loss = loss + router_aux_loss_coef * router.aux_loss()
        sums = (router.tokens, jax.lax.stop_gradient(router.probs), router.count)
        stats = {**stats, **dict(zip(_ROUTER_STATS, sums))}
    return loss, stats


def with_lag_field(batch: Mapping) -> dict:
    """``batch`` with the optional ``policy_lag`` field present (-1, unknown, when absent)."""
    batch = dict(batch)
    if LAG_FIELD not in batch:
        ids = batch["input_ids"]
        if isinstance(ids, jax.Array):
            # Filled from the host shard by shard: a transfer, no program to launch.
            batch[LAG_FIELD] = jax.make_array_from_callback(
                ids.shape,
                ids.sharding,
                lambda idx: np.full(np.empty(ids.shape, np.int8)[idx].shape, -1, np.int32),
            )
        else:
            batch[LAG_FIELD] = np.full(np.shape(ids), -1, np.int32)
    lag = batch[LAG_FIELD]
    if tuple(np.shape(lag)) != tuple(np.shape(batch["input_ids"])) or np.dtype(lag.dtype) != np.int32:
        raise ConfigError(
            f"train batch field {LAG_FIELD!r} must be int32 {tuple(np.shape(batch['input_ids']))}, "
            f"got {np.dtype(lag.dtype).name}{tuple(np.shape(lag))}"
        )
    return batch


def policy_lag(trajectories, placement, shape, learner_version: int) -> np.ndarray:
    """The ``policy_lag`` field for a batch packed by ``pack_trajectories``: per target, the learner's
    version minus the oldest version that sampled it or any generated token before it in its
    trajectory (``policy_versions``), -1 where not generated.

    The oldest, not the target's own: after an in-flight weight update the engine keeps decoding on
    the cache the older policy built, so a token stamped with the new version was not drawn from the
    new policy's distribution over its context (tests/test_rl_learner_metrics.py measures the gap).
    Only tokens of a context the learner's version computed throughout are same-version (lag 0)."""
    lag = np.full(shape, -1, np.int32)
    for tr, (row, start, n) in zip(trajectories, placement):
        versions = np.asarray(getattr(tr, "policy_versions", None) or [-1] * len(tr.tokens), np.int64)
        gen = np.asarray(tr.response_mask, bool) & (versions >= 0)
        oldest = np.minimum.accumulate(np.where(gen, versions, np.iinfo(np.int64).max))
        lag[row, start : start + n] = np.where(gen, learner_version - oldest, -1)[1:]
    return lag


def abstract_train_state(optimizer, params, state_shardings: TrainState) -> TrainState:
    """``jax.ShapeDtypeStruct`` tree of a TrainState, with shardings, for orbax restores."""

    def build(p):
        return TrainState(
            step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p), rng=jax.random.PRNGKey(0)
        )

    shapes = jax.eval_shape(build, params)
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, state_shardings
    )
