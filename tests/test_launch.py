"""The launch lock (tmax_jax.launch): which modes turn it on, that every multi-device launch of the
engine, the train step and the weight copies waits for it, and that generation concurrent with
training under the lock gives the same tokens and the same update as running them one after another."""

import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx
from helpers_hf import make_tiny_hf_checkpoint
from test_train_step import RL, on_policy_batch, params_np, tiny_cfg

from tmax_jax import launch
from tmax_jax.checkpoints import load_hf
from tmax_jax.engine import Engine, Orchestrator, Request, SamplingParams
from tmax_jax.errors import ConfigError
from tmax_jax.rl.train_step import TrainStep, make_model
from tmax_jax.sharding import MeshConfig, ProcessReplicas, make_mesh, param_shardings, shard_tree
from tmax_jax.train.config import TrainConfig
from tmax_jax.train.learner import Learner

MESH = MeshConfig(data=1, fsdp=4, tensor=2)


@pytest.fixture
def serial_on():
    launch.set_mode("on")
    yield
    launch.set_mode("auto")


def test_modes_and_bad_values(monkeypatch):
    launch.set_mode("auto")
    assert jax.default_backend() == "cpu" and not launch.active()  # CPU: never needed, never on
    launch.set_mode("ON")
    assert launch.active()
    launch.set_mode("off")
    assert not launch.active()
    with pytest.raises(ConfigError, match="auto, on, off.*'always'"):
        launch.set_mode("always")
    monkeypatch.setattr(launch, "_mode", None)
    monkeypatch.setenv(launch.ENV_VAR, "yes")
    with pytest.raises(ConfigError, match="TMAX_SERIAL_LAUNCH"):
        launch.active()
    monkeypatch.setenv(launch.ENV_VAR, "on")
    assert launch.active()
    launch.set_mode("auto")


class LaunchGuard:
    """Instruments ``jax.jit`` and ``jax.device_put`` (the real functions still run): while
    ``checking``, each call of a function jitted under it and each ``device_put`` onto more than one
    device counts as a launch, and one made by a thread not holding the launch queue is a bypass."""

    def __init__(self):
        self.checking = False
        self.launches = 0
        self.bypasses: list[str] = []
        self._jit, self._put = jax.jit, jax.device_put

    def _note(self, what: str) -> None:
        if self.checking:
            self.launches += 1
            if not launch.held():
                self.bypasses.append(what)

    def jit(self, fn, *args, **kwargs):
        guard, jitted, name = self, self._jit(fn, *args, **kwargs), getattr(fn, "__name__", repr(fn))

        class Guarded:
            def __call__(self, *a, **k):
                guard._note(name)
                return jitted(*a, **k)

            def __getattr__(self, attr):
                return getattr(jitted, attr)

        return Guarded()

    def device_put(self, x, device=None, *args, **kwargs):
        is_sharding = lambda s: isinstance(s, jax.sharding.Sharding)  # noqa: E731
        if any(
            is_sharding(s) and len(s.device_set) > 1 for s in jax.tree.leaves(device, is_leaf=is_sharding)
        ):
            self._note("device_put")
        return self._put(x, device, *args, **kwargs)


@pytest.fixture(scope="module")
def launch_guard():
    guard = LaunchGuard()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jax, "jit", guard.jit)
        mp.setattr(jax, "device_put", guard.device_put)
        yield guard


@pytest.fixture(scope="module")
def sharded_engine(tmp_path_factory, launch_guard):
    model = load_hf(make_tiny_hf_checkpoint(tmp_path_factory.mktemp("launch"), seed=11))
    state = nnx.state(model)
    nnx.update(model, shard_tree(state, param_shardings(state, make_mesh(MESH))))
    return Engine(model, max_concurrent_decodes=2, max_cache_length=64, max_prefill_length=16)


@pytest.fixture(scope="module")
def train_step(launch_guard):
    return TrainStep(make_model(tiny_cfg(), remat="none", seed=0), RL, make_mesh(MESH), MESH)


def _fresh_params():
    return nnx.state(make_model(tiny_cfg(), remat="none", seed=0), nnx.Param)


def test_every_launch_waits_for_the_lock(serial_on, sharded_engine, train_step):
    engine = sharded_engine
    params = engine.load_params()
    prompt = np.zeros((16,), np.int32)
    prompt[:5] = [3, 1, 4, 1, 5]
    batch = train_step.put_batch(on_policy_batch())
    replicas = ProcessReplicas(params, MESH)
    # Warm up (compile) every call once, so below only launches are timed.
    prefix, _ = engine.prefill(params=params, padded_tokens=prompt, true_length=5)
    decode = engine.insert(prefix, engine.init_decode_state(), 0)
    decode, _ = engine.generate(params, decode)
    state, _ = train_step(train_step.init_state(_fresh_params()), batch)
    jax.block_until_ready((replicas(params), decode, state))

    # Inputs are made before the lock is taken: each call below is a single launch.
    decode = jax.block_until_ready(engine.insert(prefix, engine.init_decode_state(), 1))
    state = jax.block_until_ready(train_step.init_state(_fresh_params()))
    fsdp8 = param_shardings(params, make_mesh(MeshConfig(fsdp=8)))
    results = {}
    calls = {
        "prefill": lambda: engine.prefill(params=params, padded_tokens=prompt, true_length=5),
        "generate": lambda: engine.generate(params, decode),
        "train_step": lambda: train_step(state, batch),
        "process_replicas": lambda: replicas(params),
        "shard_tree": lambda: shard_tree(params, fsdp8),
    }

    def run(name, fn):
        results[name] = jax.block_until_ready(fn())

    launch.stats(reset=True)
    with launch.serial_launch():  # this thread holds the lock
        threads = [threading.Thread(target=run, args=kv, daemon=True) for kv in calls.items()]
        for t in threads:
            t.start()
        time.sleep(1.0)
        assert sorted(results) == [], "these launched while another thread held the lock"
    for t in threads:
        t.join(timeout=120)
    assert sorted(results) == sorted(calls)
    stats = launch.stats()
    assert stats["launches"] >= len(calls) + 1 and stats["launch_wait_s"] > 0.5

    # Off: the same calls run while the lock is held elsewhere.
    launch.set_mode("off")
    results.clear()
    decode = engine.insert(prefix, engine.init_decode_state(), 1)
    with launch._lock:
        run("generate", lambda: engine.generate(params, decode))
    assert "generate" in results


def test_no_launch_bypasses_the_queue(serial_on, launch_guard, sharded_engine, train_step):
    """Every multi-device program the engine, the train step and the reshards launch goes through
    the one launch queue; a launch made around it is caught."""
    engine = sharded_engine
    params = engine.load_params()
    prompt = np.zeros((16,), np.int32)
    prompt[:4] = [2, 7, 1, 8]
    replicas = ProcessReplicas(params, MESH)
    fsdp8 = param_shardings(params, make_mesh(MeshConfig(fsdp=8)))
    fresh = _fresh_params()
    launch_guard.checking, launch_guard.launches, launch_guard.bypasses = True, 0, []
    try:
        state = train_step.init_state(fresh)  # the params' reshard, the optimizer's init, step and rng
        prefix, _ = engine.prefill(params=params, padded_tokens=prompt, true_length=4)
        decode = engine.insert(prefix, engine.init_decode_state(), 0)
        decode, _ = engine.generate(params, decode)
        decode, _ = engine.generate_block(params, decode)
        state, _ = train_step(state, train_step.put_batch(on_policy_batch(seed=1)))
        jax.block_until_ready((replicas(params), shard_tree(params, fsdp8), state, decode))
    finally:
        launch_guard.checking = False
    assert launch_guard.bypasses == [] and launch_guard.launches >= 9, launch_guard.__dict__
    # A program launched around the queue (the engine's generate, unwrapped) is a bypass.
    launch_guard.checking = True
    try:
        jax.block_until_ready(engine._generate_jit.__wrapped__(params, decode))
    finally:
        launch_guard.checking = False
    assert launch_guard.bypasses == ["_generate_impl"]


def test_learner_engine_copy_is_one_queued_program(serial_on, launch_guard, train_step, tmp_path):
    """The weights the learner pushes to the engine are copied by one program of the launch queue
    (not per-leaf eager copies under a lock the call site takes): same shardings, new buffers, and
    still the old weights after the next step donates the train state."""
    state = train_step.init_state(_fresh_params())
    learner = Learner(TrainConfig(), train_step, None, state, start_step=0, run_dir=tmp_path)
    learner.engine_params(as_state=False)  # compile outside the count
    before = params_np(learner.state)
    launch_guard.checking, launch_guard.launches, launch_guard.bypasses = True, 0, []
    try:
        copy = jax.block_until_ready(learner.engine_params(as_state=False))
    finally:
        launch_guard.checking = False
    assert launch_guard.launches == 1 and launch_guard.bypasses == [], launch_guard.__dict__
    src_leaves, copy_leaves = jax.tree.leaves(learner.state.params), jax.tree.leaves(copy)
    assert len(src_leaves) == len(copy_leaves) > 0
    for a, b in zip(src_leaves, copy_leaves):
        assert b.sharding == a.sharding and len(b.sharding.device_set) == 8
        mine = {s.data.unsafe_buffer_pointer() for s in a.addressable_shards}
        assert mine.isdisjoint(s.data.unsafe_buffer_pointer() for s in b.addressable_shards)
    learner.state, _ = train_step(learner.state, train_step.put_batch(on_policy_batch(seed=2)))
    after = params_np(learner.state)
    got = {"/".join(map(str, p)): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(copy)}
    assert sorted(got) == sorted(before)
    assert any(not np.array_equal(after[k], before[k]) for k in before)  # the step moved the params
    for k in before:
        np.testing.assert_array_equal(got[k], before[k], err_msg=k)


def test_learner_push_is_the_engines_one_copy(serial_on, launch_guard, train_step, tmp_path):
    """The learner hands the train state's weights to the engine, which copies them itself in one
    queued program (split into periods): no buffer shared with the state, and still the pushed
    weights after the next step donates the state."""
    state = train_step.init_state(_fresh_params())
    learner = Learner(TrainConfig(), train_step, None, state, start_step=0, run_dir=tmp_path)
    engine = Engine(
        learner.engine_model(), max_concurrent_decodes=2, max_cache_length=64, max_prefill_length=16
    )
    learner.connect(engine)
    learner.push(1)  # compile outside the count
    before = params_np(learner.state)
    launch_guard.checking, launch_guard.launches, launch_guard.bypasses = True, 0, []
    try:
        learner.push(2)
    finally:
        launch_guard.checking = False
    assert launch_guard.launches == 1 and launch_guard.bypasses == [], launch_guard.__dict__
    assert engine.version == 2
    mine = {
        s.data.unsafe_buffer_pointer()
        for a in jax.tree.leaves(learner.state.params)
        for s in a.addressable_shards
    }
    theirs = {
        s.data.unsafe_buffer_pointer() for a in jax.tree.leaves(engine.params) for s in a.addressable_shards
    }
    assert mine.isdisjoint(theirs)
    learner.state, _ = train_step(learner.state, train_step.put_batch(on_policy_batch(seed=2)))
    after = params_np(learner.state)
    assert any(not np.array_equal(after[k], before[k]) for k in before)  # the step moved the params
    # The engine's weights, stacked back over periods, are the pushed ones.
    p = engine.params
    rest = {"/".join(map(str, k)): np.asarray(x) for k, x in jax.tree_util.tree_leaves_with_path(p.rest)}
    blocks = jax.tree.map(lambda *a: np.stack([np.asarray(x) for x in a]), *p.periods)
    got = rest | {
        "['blocks']/" + "/".join(map(str, k)): x for k, x in jax.tree_util.tree_leaves_with_path(blocks)
    }
    assert sorted(got) == sorted(before)
    for k in before:
        np.testing.assert_array_equal(got[k], before[k], err_msg=k)


def test_generation_during_training_matches_sequential(serial_on, sharded_engine, train_step):
    batch = on_policy_batch(seed=3)
    reqs = [
        Request(prompt=[7, 2 + i, 9, 4, 4], max_tokens=12, sampling=SamplingParams(temperature=0.8, seed=i))
        for i in range(6)
    ]

    def train(n):
        state = train_step.init_state(_fresh_params())
        for _ in range(n):
            state, metrics = train_step(state, batch)
        return params_np(state), float(metrics["loss"])

    with Orchestrator(sharded_engine) as orch:
        ref_out = orch.generate(reqs)
    ref_params, ref_loss = train(3)

    with Orchestrator(sharded_engine) as orch:
        futures = [orch.submit(r) for r in reqs]  # prefill + generate threads run while we train
        params, loss = train(3)
        out = [f.result(timeout=300) for f in futures]
    for a, b in zip(ref_out, out):
        assert a.tokens == b.tokens
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-6)
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for k in ref_params:
        np.testing.assert_array_equal(params[k], ref_params[k], err_msg=k)
