"""Routing replay end to end: an MoE rollout engine's recorded experts flow through the orchestrator,
the episode policy and the trajectory into the packed ``routed_experts`` batch field, and the train
step replays them. References: the trainer model's own routing of the whole trajectory (same
weights, float32) and the engine's sampling logprobs."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tmax_jax.agent.trajectory import Trajectory
from tmax_jax.engine import Engine, Orchestrator, SamplingParams
from tmax_jax.engine.session import EnginePolicy
from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.rl import OptimizerConfig, RLConfig
from tmax_jax.rl.config import TrainStepConfig
from tmax_jax.rl.packing import ROUTING_FIELD, pack_trajectories, pad_rows_pow2, routing_field
from tmax_jax.rl.train_step import LAG_FIELD, TrainStep, make_model, policy_lag
from tmax_jax.sharding import MeshConfig, make_mesh

CFG = Qwen35Config.preset("tiny-moe", initializer_range=0.1)
L, K = CFG.num_hidden_layers, CFG.num_experts_per_tok
TURNS = ((9, 6), (5, 5))  # (new context tokens, max new tokens) per turn
SEQ = 40


def episode(orch, seed):
    """Two turns through EnginePolicy, appended to a Trajectory exactly as run_episode does."""
    rng = np.random.default_rng(100 + seed)
    policy = EnginePolicy(orch, sampling=SamplingParams(temperature=1.0, seed=seed), stop_token_ids=[])
    traj = Trajectory(task_id=f"t{seed}", group_id=0)
    spans = []
    for new, max_new in TURNS:
        ids = rng.integers(0, CFG.vocab_size, new).tolist()
        traj.append(ids, generated=False)
        gen = policy(ids, max_new_tokens=max_new)
        assert len(gen.tokens) == max_new and gen.experts.shape == (max_new, L, K)
        spans.append((len(traj.tokens), len(traj.tokens) + max_new))
        traj.append(
            gen.tokens, generated=True, logprobs=gen.logprobs, versions=gen.versions, experts=gen.experts
        )
    policy.close()
    traj.validate()
    return traj, spans


@pytest.fixture(scope="module")
def rollouts():
    engine = Engine(
        make_model(CFG, remat="none", seed=3), max_concurrent_decodes=2, max_cache_length=64,
        max_prefill_length=32, decode_steps=4, min_attend_bucket=64, record_routing=True,
    )  # fmt: skip
    out = [None, None]
    with Orchestrator(engine) as orch:

        def run(i):
            out[i] = episode(orch, i)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert all(o is not None for o in out)
    return out


def own_routing(model, tokens):
    """The trainer's routing of a whole trajectory, [T, L, K] (one forward, no cache)."""
    _, used = nnx.jit(lambda m, i: m.hidden_states(i, return_routing=True))(model, jnp.asarray([tokens]))
    return np.asarray(used)[:, 0].transpose(1, 0, 2)


def test_recorded_experts_reach_the_trajectory_and_the_packed_batch(rollouts):
    """Each generated token but a turn's last (fed back by the engine's decode steps) carries the
    experts the trainer's own forward routes it to; prompt tokens and each turn's last token (fed
    by the next turn's prefill) are -1. Packing puts a trajectory's row i at its input i, and row
    padding is -1."""
    model = make_model(CFG, remat="none", seed=3)
    for traj, spans in rollouts:
        rec = traj.routed_experts
        assert rec.dtype == np.int16 and rec.shape == (len(traj.tokens), L, K)
        want = np.zeros(len(traj.tokens), bool)
        for a, b in spans:
            want[a : b - 1] = True
        np.testing.assert_array_equal(rec[:, 0, 0] >= 0, want)
        assert (rec[~want] == -1).all()
        np.testing.assert_array_equal(rec[want], own_routing(model, traj.tokens)[want])
        assert "routed_experts" not in traj.to_json()

    trajs = [t for t, _ in rollouts]
    batch, placement = pack_trajectories(trajs, [1.0, -1.0], seq_len=SEQ)
    field = routing_field(trajs, placement, batch["input_ids"].shape, (L, K))
    assert field.shape == (*batch["input_ids"].shape, L, K) and field.dtype == np.int16
    covered = np.zeros(batch["input_ids"].shape, bool)
    for traj, (row, start, n) in zip(trajs, placement):
        np.testing.assert_array_equal(batch["input_ids"][row, start : start + n], traj.tokens[:-1])
        np.testing.assert_array_equal(field[row, start : start + n], traj.routed_experts[:-1])
        covered[row, start : start + n] = True
    assert (field[~covered] == -1).all()
    batch[ROUTING_FIELD] = field
    padded = pad_rows_pow2(batch, 4)
    assert padded[ROUTING_FIELD].shape == (4, SEQ, L, K) and padded["input_ids"].shape == (4, SEQ)
    assert (padded[ROUTING_FIELD][len(field) :] == -1).all() and (
        padded["segment_ids"][len(field) :] == 0
    ).all()


def packed_batch(rollouts, rows=2):
    trajs = [t for t, _ in rollouts]
    batch, placement = pack_trajectories(trajs, [1.0, -1.0], seq_len=SEQ, num_rows=rows)
    batch[ROUTING_FIELD] = routing_field(trajs, placement, batch["input_ids"].shape, (L, K))
    # Sampled by version 0, trained at version 0: the mismatch metrics cover every sampled token.
    batch[LAG_FIELD] = policy_lag(trajs, placement, batch["input_ids"].shape, 0)
    return batch


def train_step(replay):
    rl = RLConfig(
        optimizer=OptimizerConfig(learning_rate=1e-3), train_step=TrainStepConfig(routing_replay=replay)
    )
    mesh_cfg = MeshConfig(data=1, fsdp=1, tensor=1)
    return TrainStep(make_model(CFG, seed=3), rl, make_mesh(mesh_cfg, jax.devices()[:1]), mesh_cfg)


def step_metrics(step, batch, params):
    """The metrics of one step from ``params`` (a fresh copy: the step donates its state)."""
    _, metrics = step(step.init_state(jax.tree.map(jnp.copy, params)), dict(batch))
    return {k: float(v) for k, v in metrics.items()}


def test_train_step_replays_the_packed_experts(rollouts):
    """With the engine's weights the replayed step reproduces the engine's logprobs of every
    sampled token, and the same field shifted by one token (a misaligned link) does not. After a
    router change that re-routes recorded tokens, replay keeps the engine's experts and the
    logprob mismatch to the rollout is smaller than re-routing's."""
    batch = packed_batch(rollouts)
    replay, reroute = train_step(True), train_step(False)
    model = make_model(CFG, seed=3)
    engine_params = nnx.state(model, nnx.Param)
    m = step_metrics(replay, batch, engine_params)
    assert m["mismatch/tokens"] == sum(b - a for _, spans in rollouts for a, b in spans)
    assert m["mismatch/max_abs_logprob_diff"] < 5e-5
    shifted = dict(batch, **{ROUTING_FIELD: np.roll(batch[ROUTING_FIELD], 1, axis=1)})
    m_shifted = step_metrics(replay, shifted, engine_params)
    assert m_shifted["mismatch/max_abs_logprob_diff"] > 1e-3

    # A learner update of the routers: some recorded tokens now route elsewhere.
    router = engine_params["blocks"]["layers"][0]["mlp"]["router"]
    w = np.asarray(router[...])
    moved_params = jax.tree.map(jnp.copy, engine_params)
    noise = 0.3 * w.std() * np.random.default_rng(8).normal(size=w.shape)
    moved_params["blocks"]["layers"][0]["mlp"]["router"].set_value(jnp.asarray(w + noise, w.dtype))
    nnx.update(model, moved_params)
    ids, seg, pos = (jnp.asarray(batch[k]) for k in ("input_ids", "segment_ids", "positions"))
    routing = jnp.moveaxis(jnp.asarray(batch[ROUTING_FIELD], jnp.int32), 2, 0)  # [L, B, T, K]

    @nnx.jit
    def used(m, routing):
        return m.hidden_states(ids, positions=pos, segment_ids=seg, routing=routing, return_routing=True)[1]

    rec = np.asarray(routing)
    recorded = np.broadcast_to(rec[..., :1] >= 0, rec.shape)
    assert (np.asarray(used(model, None))[recorded] != rec[recorded]).any(), "no recorded token re-routed"
    np.testing.assert_array_equal(np.asarray(used(model, routing))[recorded], rec[recorded])

    with_replay = step_metrics(replay, batch, moved_params)
    without = step_metrics(reroute, batch, moved_params)
    mean = "mismatch/mean_abs_logprob_diff"
    print(
        f"max |logprob diff| engine weights: replay {m['mismatch/max_abs_logprob_diff']:.2e}, "
        f"shifted field {m_shifted['mismatch/max_abs_logprob_diff']:.3f}; router changed, mean: "
        f"replay {with_replay[mean]:.4f}, re-routed {without[mean]:.4f}"
    )
    assert with_replay[mean] < without[mean]
