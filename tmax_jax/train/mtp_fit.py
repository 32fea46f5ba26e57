"""Fit a multi-token-prediction (MTP) module to a policy, so that speculative decoding drafts well.

The MTP module drafts for ``Engine(speculative_tokens=k)``; what it drafts never changes what the
engine samples, only how many drafts survive. A policy trained by RL drifts away from the module
its checkpoint shipped with (or has none), and acceptance falls. ``fit_mtp`` distils the policy into
the module: at position ``i`` the module reads the policy's final-norm hidden state ``h_i`` and the
token ``t_{i+1}`` and is trained towards the policy's own distribution of ``t_{i+2}`` (its logits at
``i + 1``),

    loss = mean over positions of KL(p_policy(. | t_<=i+1) || q_mtp(. | h_i, t_{i+1}))

in float32, at temperature 1. That is the quantity speculative sampling's acceptance depends on:
a draft is kept when it equals the policy's sample under a shared key, so the closer the two
distributions, the more drafts survive. The policy is frozen (no gradient reaches it); only the
module's weights move. Sequences are any token rows the policy will continue, typically its own
samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tmax_jax import launch
from tmax_jax.distributed import allgather_json
from tmax_jax.errors import ConfigError
from tmax_jax.rl.logprobs import head_logits
from tmax_jax.train.console import log
from tmax_jax.trees import check_like

if TYPE_CHECKING:
    from tmax_jax.train.config import TrainConfig
    from tmax_jax.train.learner import Learner
    from tmax_jax.train.run import Run


def pad_rows(
    rows: Sequence[Sequence[int]], seq_len: int, masks: Sequence[Sequence[int]] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(ids, segment ids, sampled) ``[len(rows), seq_len]``: each row left-aligned and cut to
    ``seq_len``, segment id 1 on its tokens and 0 on the padding; ``sampled`` 1 on the tokens the
    policy sampled (``masks``, a response mask per row; default: every token)."""
    ids = np.zeros((len(rows), seq_len), np.int32)
    seg = np.zeros((len(rows), seq_len), np.int32)
    sampled = np.zeros((len(rows), seq_len), np.int32)
    for r, row in enumerate(rows):
        row = list(row)[:seq_len]
        ids[r, : len(row)] = row
        seg[r, : len(row)] = 1
        sampled[r, : len(row)] = 1 if masks is None else list(masks[r])[: len(row)]
    return ids, seg, sampled


def policy_hidden(model: Any, ids_BxT: jax.Array, seg_BxT: jax.Array) -> jax.Array:
    """The frozen policy's final-norm hidden states ``[B, T, D]`` (no gradient reaches the policy):
    what the module reads, and what the teacher's logits come from."""
    return jax.lax.stop_gradient(model.hidden_states(ids_BxT, segment_ids=seg_BxT.astype(jnp.int32)))


def distill_loss_from_hidden(
    mtp: Any,
    embed_VxD: jax.Array,
    head_weight: jax.Array,
    h_BxTxD: jax.Array,
    ids_BxT: jax.Array,
    seg_BxT: jax.Array,
    sampled_BxT: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``mtp_distill_loss`` given the policy's hidden states ``h_BxTxD`` (``policy_hidden``), its
    token embedding and its LM head weight: the teacher's logits are the head applied to them."""
    B, T = ids_BxT.shape
    seg = seg_BxT.astype(jnp.int32)
    teacher_BxTxV = jax.lax.stop_gradient(head_logits(h_BxTxD, head_weight))
    # Position i predicts t_{i+2}: it needs t_{i+1} in its own sequence; the teacher is the policy's
    # logits at i + 1.
    next_seg = jnp.concatenate([seg[:, 1:], jnp.zeros((B, 1), jnp.int32)], axis=1)
    valid_BxT = (seg > 0) & (next_seg == seg)
    next_ids = jnp.concatenate([ids_BxT[:, 1:], jnp.zeros((B, 1), ids_BxT.dtype)], axis=1)
    teacher_BxTxV = jnp.concatenate([teacher_BxTxV[:, 1:], teacher_BxTxV[:, -1:]], axis=1)
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))  # one sequence per row from position 0
    out_BxTxD, _ = mtp(embed_VxD, h_BxTxD, jnp.where(valid_BxT, next_ids, 0), positions, seg)
    student_BxTxV = head_logits(out_BxTxD, head_weight)
    log_p = jax.nn.log_softmax(teacher_BxTxV.astype(jnp.float32), axis=-1)
    log_q = jax.nn.log_softmax(student_BxTxV.astype(jnp.float32), axis=-1)
    kl_BxT = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
    counted_BxT = valid_BxT
    if sampled_BxT is not None:  # t_{i+2} sampled by the policy (in the same sequence)
        seg2 = jnp.concatenate([seg[:, 2:], jnp.zeros((B, 2), jnp.int32)], axis=1)
        sampled2 = jnp.concatenate([sampled_BxT[:, 2:], jnp.zeros((B, 2), sampled_BxT.dtype)], axis=1)
        counted_BxT = valid_BxT & (seg2 == seg) & (sampled2 > 0)
    count = jnp.sum(counted_BxT)
    return jnp.sum(jnp.where(counted_BxT, kl_BxT, 0.0)) / jnp.maximum(count, 1), count


def mtp_distill_loss(
    mtp: Any, model: Any, ids_BxT: jax.Array, seg_BxT: jax.Array, sampled_BxT: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(mean KL over the positions that have a next token, their count); see the module docstring.
    ``seg_BxT``: segment ids as in the model's forward (0: padding), sequences packed or one per row.
    ``sampled_BxT`` (1 on the tokens the policy sampled): only positions whose target ``t_{i+2}``
    the policy sampled count, the ones a draft is ever asked for (prompts and tool outputs are
    prefilled, never drafted)."""
    h_BxTxD = policy_hidden(model, ids_BxT, seg_BxT)
    return distill_loss_from_hidden(
        mtp, model.embed_tokens[...], model.lm_head_weight(), h_BxTxD, ids_BxT, seg_BxT, sampled_BxT
    )


def _check_settings(who: str, **ints) -> None:
    for name, v in ints.items():
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigError(f"{who}: {name} must be a positive integer, got {v!r}")


def _pow2_at_least(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def _cached_rows(n: int, batch: int) -> int:
    """Rows of a cached policy forward over ``n`` rows: whole batches, a power of two of them (few
    distinct shapes to compile)."""
    return batch * _pow2_at_least(-(-n // batch))


class DraftFitter:
    """Keeps an MTP module fitted to a policy that changes: compiled AdamW steps on ``batch_size``
    rows of at most ``seq_len`` tokens, the optimiser state carried from call to call.
    ``fit(model, rows, steps)`` trains towards the policy ``model`` given then (its weights are
    arguments of the programs, not constants); ``module()`` is the fitted module.

    The policy is frozen during a fit, so its forward over a row is the same at every step that
    draws the row: ``fit`` draws every step's rows first, runs the policy once over the rows a run
    of steps shares (its hidden states kept on device, at most ``cache_bytes`` of them beyond one
    step's batch) and then only the module at each step. Rows are padded to a power of two of the
    longest one of such a run of steps (at least 16, at most ``seq_len``), not to ``seq_len``: a
    fit compiles one program per length bucket and count of cached batches, each once."""

    def __init__(
        self,
        model: Any,
        mtp: Any,
        *,
        learning_rate: float,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        cache_bytes: int = 256 << 20,
    ):
        _check_settings("DraftFitter", batch_size=batch_size, seq_len=seq_len)
        if not learning_rate > 0:
            raise ConfigError(f"DraftFitter: learning_rate must be > 0, got {learning_rate!r}")
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ConfigError(f"DraftFitter: cache_bytes must be an integer >= 0, got {cache_bytes!r}")
        if mtp.config.hidden_size != model.config.hidden_size:
            raise ConfigError(
                f"DraftFitter: the MTP module's hidden size {mtp.config.hidden_size} != the model's "
                f"{model.config.hidden_size}"
            )
        self.batch_size, self.seq_len, self.cache_bytes = batch_size, seq_len, cache_bytes
        # Bytes of one token's hidden state (the policy's compute dtype).
        self._token_bytes = (
            model.config.hidden_size * jnp.dtype(getattr(model, "dtype", jnp.float32)).itemsize
        )
        self._model_def = nnx.graphdef(model)
        self._mtp_def, self.params, self._rest = nnx.split(mtp, nnx.Param, ...)
        opt = optax.adamw(learning_rate, weight_decay=0.0)
        self._opt_state = _on_devices_of(opt.init(self.params), self.params)
        self._rng = np.random.default_rng(seed)
        self.replicas = None  # set by a multi-process train run: gives each engine its own copy
        # Policy forwards and module steps run by the last fit (what the cache saved).
        self.counts = {"policy_rows": 0, "steps": 0}
        mtp_def, rest, model_def = self._mtp_def, self._rest, self._model_def

        def teach(model_state, ids_NxBxT, seg_NxBxT):
            model = nnx.merge(model_def, model_state)
            h = jax.lax.map(lambda a: policy_hidden(model, *a), (ids_NxBxT, seg_NxBxT))
            return h.reshape(-1, *h.shape[2:])  # [N * B, T, D], one batch's activations at a time

        def step(params, opt_state, model_state, h_RxTxD, ids_RxT, seg_RxT, sampled_RxT, pick_B):
            model = nnx.merge(model_def, model_state)
            embed, head = model.embed_tokens[...], model.lm_head_weight()
            rows = [jnp.take(a, pick_B, axis=0) for a in (h_RxTxD, ids_RxT, seg_RxT, sampled_RxT)]

            def loss_fn(p):
                return distill_loss_from_hidden(nnx.merge(mtp_def, p, rest), embed, head, *rows)[0]

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        # Beside the engine's threads: through the launch queue.
        self._teach = launch.jit(teach)
        self._step = launch.jit(step)

    def _bucket(self, n: int) -> int:
        return min(self.seq_len, max(16, _pow2_at_least(n)))

    def _runs(self, picks: list[np.ndarray], lengths: list[int]) -> list[tuple[int, int, list[int], int]]:
        """Consecutive steps that share one policy forward: (first step, end step, the rows they
        draw in order of first use, their length bucket). A run grows while its cached hidden
        states stay within one step's batch plus ``cache_bytes``."""
        budget = self.batch_size * self.seq_len * self._token_bytes + self.cache_bytes
        runs, start, rows, longest = [], 0, {}, 0  # rows: an ordered set, in order of first use
        for s, pick in enumerate(picks):
            drawn = dict.fromkeys(int(r) for r in pick)
            grown = max(longest, *(lengths[r] for r in drawn))
            size = _cached_rows(len(rows | drawn), self.batch_size) * self._bucket(grown) * self._token_bytes
            if s > start and size > budget:
                runs.append((start, s, list(rows), self._bucket(longest)))
                start, rows, grown = s, {}, max(lengths[r] for r in drawn)
            rows, longest = rows | drawn, grown
        runs.append((start, len(picks), list(rows), self._bucket(longest)))
        return runs

    def fit(
        self,
        model: Any,
        rows: Sequence[Sequence[int]],
        steps: int,
        log: Callable[[str], None] | None = None,
        masks: Sequence[Sequence[int]] | None = None,
        seed: Any = None,
    ) -> list[float]:
        """``steps`` steps on rows drawn at random from ``rows`` (those of at least 3 tokens), with
        ``masks`` (1 on the tokens the policy sampled) the loss on those only; the loss of each
        step, before its update. ``seed``: draw the rows from ``np.random.default_rng(seed)`` (a
        resumed run draws what the interrupted one would have), not from the fitter's own stream."""
        _check_settings("DraftFitter.fit", steps=steps)
        if masks is not None and len(masks) != len(rows):
            raise ConfigError(f"DraftFitter.fit: {len(masks)} masks for {len(rows)} rows")
        keep = [i for i, r in enumerate(rows) if min(len(r), self.seq_len) >= 3]
        if not keep:
            raise ConfigError("DraftFitter.fit: no row of at least 3 tokens")
        rng = self._rng if seed is None else np.random.default_rng(seed)
        picks = [
            rng.choice(len(keep), size=self.batch_size, replace=len(keep) < self.batch_size)
            for _ in range(steps)
        ]
        lengths = [min(len(rows[i]), self.seq_len) for i in keep]
        model_state = nnx.state(model)
        put = _replicated_like(model_state)
        losses, B = [], self.batch_size
        self.counts = {"policy_rows": 0, "steps": 0}
        for start, end, used, T in self._runs(picks, lengths):
            n = _cached_rows(len(used), B)
            order = used + [used[0]] * (n - len(used))  # filler rows, never drawn
            ids, seg, sampled = pad_rows(
                [rows[keep[r]] for r in order], T, None if masks is None else [masks[keep[r]] for r in order]
            )
            h = self._teach(model_state, put(ids.reshape(n // B, B, T)), put(seg.reshape(n // B, B, T)))
            ids, seg, sampled = put(ids), put(seg), put(sampled)
            where = {r: j for j, r in enumerate(used)}
            self.counts["policy_rows"] += n
            for i in range(start, end):
                pick = np.asarray([where[int(r)] for r in picks[i]], np.int32)
                self.params, self._opt_state, loss = self._step(
                    self.params, self._opt_state, model_state, h, ids, seg, sampled, put(pick)
                )
                losses.append(float(loss))
                self.counts["steps"] += 1
                if log is not None and (i == 0 or (i + 1) % max(1, steps // 10) == 0):
                    log(f"fit_mtp: step {i + 1}/{steps} loss {losses[-1]:.4f}")
        return losses

    def module(self) -> Any:
        return nnx.merge(self._mtp_def, self.params, self._rest)

    def state(self) -> dict:
        """What fitting needs to go on where it stopped: the module's params and the optimiser's
        state (device arrays; a train checkpoint's ``draft`` item)."""
        return {"params": self.params, "opt_state": self._opt_state}

    def abstract_state(self) -> dict:
        """``state()``'s structure, shapes, dtypes and shardings (a restore target)."""
        return jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), self.state()
        )

    def load_state(self, state: dict) -> None:
        """Go on from ``state`` (``state()`` of a fitter of the same module and optimiser)."""
        check_like(self.state(), state, "DraftFitter.load_state: the state differs from the fitter's")
        self.params, self._opt_state = state["params"], state["opt_state"]


def _replicated_sharding(tree: Any) -> jax.sharding.NamedSharding | None:
    """Replication over the mesh ``tree``'s arrays are laid out on (None: they are not on a mesh)."""
    sharding = jax.tree.leaves(tree)[0].sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return None
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())


def _on_devices_of(tree: Any, like: Any) -> Any:
    """``tree`` with every array that is not on ``like``'s devices (the optimiser's step count, made
    on the default device) replicated over ``like``'s mesh: a state restored from a checkpoint
    then lands where the params are."""
    replicated = _replicated_sharding(like)
    if replicated is None:
        return tree
    devices = replicated.device_set
    return jax.tree.map(
        lambda x: x if x.sharding.device_set == devices else jax.device_put(x, replicated), tree
    )


def _replicated_like(tree: Any) -> Callable[[np.ndarray], Any]:
    """How to feed a host batch to a program over ``tree``'s arrays: as it is when they are all this
    process's, else as an array replicated over their mesh (several processes, each with the same
    rows)."""
    if jax.tree.leaves(tree)[0].is_fully_addressable:
        return lambda x: x
    replicated = _replicated_sharding(tree)
    return lambda x: jax.device_put(x, replicated)


def fit_mtp(
    model: Any,
    mtp: Any,
    rows: Sequence[Sequence[int]],
    *,
    steps: int,
    learning_rate: float = 1e-3,
    batch_size: int = 8,
    seq_len: int | None = None,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    masks: Sequence[Sequence[int]] | None = None,
) -> list[float]:
    """Train ``mtp`` in place on ``rows`` (token lists of at least 3 tokens) for ``steps`` AdamW
    steps of ``batch_size`` rows drawn at random (``seed``), each cut to ``seq_len`` (default: the
    longest row); ``masks``: the loss on the tokens the policy sampled only (``mtp_distill_loss``).
    Returns the loss of every step (before its update)."""
    # The settings are checked by DraftFitter (learning rate, batch size) and its fit (steps).
    rows = [list(r) for r in rows]
    if not rows or any(len(r) < 3 for r in rows):
        raise ConfigError("fit_mtp: rows must be a non-empty list of token lists of at least 3 tokens")
    fitter = DraftFitter(
        model, mtp, learning_rate=learning_rate, batch_size=batch_size,
        seq_len=seq_len or max(len(r) for r in rows), seed=seed,
    )  # fmt: skip
    losses = fitter.fit(model, rows, steps, log, masks)
    nnx.update(mtp, fitter.params)
    return losses


def _engine_kw(prompts: Sequence[Sequence[int]], max_new_tokens: int, slots: int, k: int) -> dict:
    longest = max(len(p) for p in prompts)
    return dict(
        max_concurrent_decodes=slots,
        max_cache_length=longest + max_new_tokens + 8 * (k + 1),
        max_prefill_length=longest,
    )


def sample_completions(
    model: Any,
    prompts: Sequence[Sequence[int]],
    *,
    samples: int,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    slots: int = 16,
    eos_token_ids: Sequence[int] = (),
) -> tuple[list[list[int]], list[list[int]]]:
    """``samples`` completions of every prompt by the policy (prompt ``i``'s ``j``-th sample
    seeded ``(seed, i, j)``): (rows, masks), each row prompt + completion and its mask 1 on the
    completion: what ``fit_mtp`` trains on."""
    from tmax_jax.engine import Engine, Orchestrator, Request, SamplingParams

    engine = Engine(model, eos_token_ids=eos_token_ids, **_engine_kw(prompts, max_new_tokens, slots, 0))
    reqs = [
        Request(
            prompt=list(p),
            max_tokens=max_new_tokens,
            sampling=SamplingParams(temperature=temperature, seed=(seed * 1_000_003 + i) * 1_009 + j),
        )
        for i, p in enumerate(prompts)
        for j in range(samples)
    ]
    with Orchestrator(engine) as orch:
        outs = orch.generate(reqs)
    rows = [list(r.prompt) + list(o.tokens) for r, o in zip(reqs, outs)]
    return rows, [[0] * len(r.prompt) + [1] * len(o.tokens) for r, o in zip(reqs, outs)]


def draft_tokens_per_step(
    model: Any,
    mtp: Any,
    prompts: Sequence[Sequence[int]],
    *,
    k: int,
    max_new_tokens: int,
    temperature: float,
    seed: int = 0,
    slots: int = 16,
    eos_token_ids: Sequence[int] = (),
) -> float:
    """Tokens a speculative engine drafting ``k`` per step with ``mtp`` emits per slot and model
    step (1 to ``k + 1``) over ``prompts``: the measure fitting should raise."""
    from tmax_jax.engine import Engine, Orchestrator, Request, SamplingParams

    engine = Engine(
        model, mtp=mtp, speculative_tokens=k, eos_token_ids=eos_token_ids,
        **_engine_kw(prompts, max_new_tokens, slots, k),
    )  # fmt: skip
    reqs = [
        Request(
            prompt=list(p),
            max_tokens=max_new_tokens,
            sampling=SamplingParams(temperature=temperature, seed=seed + i),
        )
        for i, p in enumerate(prompts)
    ]
    with Orchestrator(engine) as orch:
        orch.generate(reqs)
        slot_steps, tokens = orch.take_decode_counts()
    return tokens / max(slot_steps, 1)


# ---- a train run's draft: settings, fitter, hand-over to the engine, resume ---------------------
def draft_fitter(cfg: TrainConfig, learner: Learner, mtp: Any, nproc: int) -> Any:
    """The ``DraftFitter`` of ``engine.draft_fit_steps`` (None when 0). Several processes fit one
    copy of the draft placed on the train mesh like the policy (every process runs the same steps on
    every process's rollouts); after each fit each engine gets its own full copy (``push_draft``)."""
    if not cfg.engine.draft_fit_steps:
        return None
    from flax import nnx

    from tmax_jax.sharding import ProcessReplicas, param_shardings, shard_tree

    replicas = None
    if nproc > 1:
        graphdef, params, rest = nnx.split(mtp, nnx.Param, ...)
        mesh = learner.train_step.mesh
        params = shard_tree(params, param_shardings(params, mesh, cfg.mesh))
        mtp = nnx.merge(graphdef, params, rest)
        replicas = ProcessReplicas(params, cfg.mesh)
    fitter = config_draft_fitter(cfg, learner.train_step.model(learner.state), mtp)
    fitter.replicas = replicas
    return fitter


def config_draft_fitter(cfg: TrainConfig, policy: Any, mtp: Any) -> Any:
    """A ``DraftFitter`` of ``mtp`` towards ``policy`` with the run's ``engine.draft_fit_*`` settings
    (a train run's, or export's restore target for the draft it saved)."""
    e = cfg.engine
    return DraftFitter(
        policy, mtp, learning_rate=e.draft_fit_learning_rate, batch_size=e.draft_fit_batch_size,
        seq_len=cfg.seq_len, seed=cfg.seed,
    )  # fmt: skip


def push_draft(fitter: Any, engine: Any) -> None:
    """Give ``engine`` the fitter's module: with several processes, this process's full copy of it (a
    collective: every process calls it at the same point)."""
    module = fitter.module()
    if fitter.replicas is not None:
        from flax import nnx

        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
        module = nnx.merge(graphdef, fitter.replicas(params), rest)
    engine.update_draft(module)


def resume_draft(fitter: Any, ckpt: Any, step: int, engine: Any) -> None:
    """Go on fitting from the draft checkpointed with ``step`` and give it to ``engine``; a
    checkpoint without one (fitting turned on after it was written) leaves the fitter as it is."""
    saved = ckpt.restore_draft(step, fitter.abstract_state())
    if saved is None:
        log(f"checkpoint step {step} holds no fitted draft: fitting goes on from the draft loaded at start")
        return
    fitter.load_state(saved)
    push_draft(fitter, engine)
    log(f"restored the draft fitted up to step {step}")


def refit_draft(run: Run, batch: Any, step: int) -> dict:
    """Fit the draft to the policy the learner just made (that of ``step``), on ``batch``'s rollouts,
    and give it to the engine (what the engine samples does not change; how many drafts survive
    does). Metrics."""
    t0 = time.monotonic()
    policy = run.learner.train_step.model(run.learner.state)
    trajs = [t for g in batch.groups for t in g.trajectories]
    # Every process's rollouts, in process order: each process runs the same fit on the same rows.
    shares = allgather_json([[list(t.tokens), list(t.response_mask)] for t in trajs])
    rows = [r for share in shares for r, _ in share]
    masks = [m for share in shares for _, m in share]
    # Rows drawn from a stream of the step's own, so a resumed run fits as the first would have.
    seed = (run.cfg.seed, step)
    losses = run.draft_fitter.fit(policy, rows, run.cfg.engine.draft_fit_steps, masks=masks, seed=seed)
    push_draft(run.draft_fitter, run.engine)
    return {"speculative/draft_loss": losses[-1], "speculative/draft_fit_s": time.monotonic() - t0}


def draft_settings(cfg: TrainConfig, init: Path, mesh: Any) -> dict:
    """The engine's speculative-decoding arguments for ``engine.speculative_tokens`` ({} when 0):
    the MTP module of the policy's checkpoint (frozen, or fitted after every step with
    ``engine.draft_fit_steps``, which also starts a new one when the checkpoint has none). One
    process: placed on the train mesh like the policy's weights; several: on the default device, and
    each engine replicates it over its own copy's devices."""
    from tmax_jax.checkpoints import load_mtp
    from tmax_jax.engine.api import speculative_settings

    k = cfg.engine.speculative_tokens
    if k and cfg.rl.train_step.routing_replay:
        raise ConfigError(
            f"engine.speculative_tokens={k} with rl.train_step.routing_replay: a speculative engine "
            "does not record the experts each token was routed to"
        )
    load = dict(dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, mesh=mesh, rules=cfg.mesh.rules)
    if k and cfg.engine.draft_fit_steps:
        mtp = load_mtp(init, **load)
        if mtp is None:
            log(f"{init} holds no MTP module: drafting with a new one, fitted after every step")
            mtp = new_draft(cfg, init)
        return {"mtp": mtp, "speculative_tokens": k}
    return speculative_settings(init, k, setting="engine.speculative_tokens", **load)


def new_draft(cfg: TrainConfig, init: Path) -> Any:
    """A new one-layer MTP module for the model of checkpoint ``init`` (seeded by ``cfg.seed``): the
    draft ``engine.draft_fit_steps`` starts from when the checkpoint has none."""
    from flax import nnx

    from tmax_jax.checkpoints import read_hf_config
    from tmax_jax.models.qwen35.mtp import MultiTokenPredictor

    dt, pdt = jnp.dtype(cfg.model.dtype), jnp.dtype(cfg.model.param_dtype)
    return MultiTokenPredictor(read_hf_config(init), 1, dtype=dt, param_dtype=pdt, rngs=nnx.Rngs(cfg.seed))
