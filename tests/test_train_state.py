"""Orbax train-state checkpoints: kill a training process, resume, and get the same next step bit-for-bit."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from tmax_jax.errors import CheckpointError
from tmax_jax.rl.state import TrainCheckpointer

# Shared by this test process and the child it kills, so both build the identical step and batch.
SETUP = """
import jax, numpy as np
from flax import nnx
from tmax_jax.models.qwen35 import Qwen35Config
from tmax_jax.rl import OptimizerConfig, RLConfig
from tmax_jax.rl.packing import empty_batch
from tmax_jax.rl.train_step import TrainStep, make_model
from tmax_jax.sharding import MeshConfig, make_mesh

def make_step():
    cfg = MeshConfig(data=1, fsdp=1, tensor=1)
    model = make_model(Qwen35Config.preset("tiny"), remat="none", seed=0)
    rl = RLConfig(optimizer=OptimizerConfig(learning_rate=1e-3, schedule="linear", decay_steps=20))
    return TrainStep(model, rl, make_mesh(cfg, jax.devices()[:1]), cfg)

def make_batch():
    rng = np.random.default_rng(0)
    b = empty_batch(4, 24)
    b["input_ids"][:] = rng.integers(0, 512, (4, 24))
    b["targets"][:] = rng.integers(0, 512, (4, 24))
    b["segment_ids"][:] = 1
    b["positions"][:] = np.arange(24)
    b["response_mask"][:, 8:] = 1
    b["rollout_logprobs"][:, 8:] = -6.3
    b["advantages"][:] = np.array([1.0, -1.0, 0.5, -0.5], np.float32)[:, None]
    return b
"""

CHILD = (
    SETUP
    + """
import sys
from tmax_jax.rl.state import TrainCheckpointer
step = make_step()
state = step.init_state()
batch = make_batch()
ckpt = TrainCheckpointer(sys.argv[1], save_every=1, keep=3)
for i in range(5):
    state, _ = step(state, batch)
    ckpt.save(int(state.step), state, {"next_index": int(state.step)})
    if int(state.step) == 3:
        ckpt.wait()
        print("SAVED 3", flush=True)
import time
time.sleep(600)  # killed here at the latest (or earlier, inside step 4 / 5 or their async saves)
"""
)


def leaves(state):
    return [np.asarray(x) for x in jax.tree.leaves(state)]


@pytest.fixture(scope="module")
def setup():
    ns: dict = {}
    exec(SETUP, ns)
    step = ns["make_step"]()
    batch = ns["make_batch"]()
    # Uninterrupted reference run: states after 0..6 steps.
    state = step.init_state()
    ref = [leaves(state)]
    for _ in range(6):
        state, _ = step(state, batch)
        ref.append(leaves(state))
    return step, batch, ref


def test_kill_and_resume_reproduces_the_next_step_bit_for_bit(setup, tmp_path, capfd):
    step, batch, ref = setup
    ckdir = tmp_path / "ckpt"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(ckdir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        deadline = time.time() + 300
        line = ""
        while time.time() < deadline and "SAVED 3" not in line:
            line = child.stdout.readline()
            if not line and child.poll() is not None:
                break
        assert "SAVED 3" in line, "child never reported its step-3 checkpoint"
        time.sleep(0.5)  # let it get into the next steps and saves before the kill
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()

    with TrainCheckpointer(ckdir, save_every=1, keep=3) as ckpt:
        got = ckpt.restore_latest(step.abstract_state())
        steps = ckpt.steps()
    assert got is not None
    k, state, data = got
    assert 3 <= k <= 5 and data == {"next_index": k} and int(state.step) == k
    for a, b in zip(leaves(state), ref[k]):
        np.testing.assert_array_equal(a, b)
    # Sharding of the restored state is the train step's, so it can be stepped (and donated) directly.
    assert jax.tree.leaves(state.params)[0].sharding == jax.tree.leaves(step.param_shardings)[0]
    state, _ = step(state, batch)
    for a, b in zip(leaves(state), ref[k + 1]):
        np.testing.assert_array_equal(a, b)

    # A damaged newest checkpoint is reported and the previous one is used.
    newest, previous = steps[-1], steps[-2]
    for f in (ckdir / str(newest) / "state").rglob("*"):
        if f.is_file() and f.parent.name == "d":
            f.write_bytes(f.read_bytes()[:7])
    capfd.readouterr()
    with TrainCheckpointer(ckdir, save_every=1, keep=3) as ckpt:
        k2, state2, _ = ckpt.restore_latest(step.abstract_state())
    assert k2 == previous
    assert f"checkpoint step {newest}" in capfd.readouterr().err
    for a, b in zip(leaves(state2), ref[previous]):
        np.testing.assert_array_equal(a, b)


def test_save_interval_keep_and_errors(setup, tmp_path):
    step, batch, _ = setup
    abstract = step.abstract_state()
    state = step.init_state(jax.tree.map(lambda x: x, _fresh(abstract)))
    with TrainCheckpointer(tmp_path / "c", save_every=2, keep=2) as ckpt:
        saved = [ckpt.save(i, state, {"i": i}) for i in range(1, 8)]
    assert saved == [False, True, False, True, False, True, False]
    with TrainCheckpointer(tmp_path / "c") as ckpt:
        assert ckpt.steps() == [4, 6]
        with pytest.raises(CheckpointError, match="step 3"):
            ckpt.restore(3, abstract)
    with pytest.raises(CheckpointError, match="keep must be"):
        TrainCheckpointer(tmp_path / "d", keep=0)
    with TrainCheckpointer(Path(tmp_path / "empty")) as ckpt:
        assert ckpt.restore_latest(abstract) is None


def _fresh(abstract):
    return jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), abstract.params)
