"""`tmax-jax train` as a pod on one machine: two JAX processes (4 fake CPU devices each, gloo over
localhost), each with its own rollout engine, prompt shard and sandboxes, train one policy.

The tasks' verifiers pass a reference solution and otherwise flip a coin, so the warm start has
demonstrations and a random policy gets mixed groups: every step updates. Checked against
independent references:
- the SFT warm start (demonstrations replayed by both processes, trained on both) equals one
  8-device process fine-tuning on the same examples;
- step 1's parameters equal one 8-device process training on the rows the two processes logged
  (advantages, packing and the global batch rebuilt here from their trajectory files);
- after each update both engines sample with the new weights: the trainer's log-probabilities of
  step 2's sampled tokens match the ones the engines recorded (max gap ~1e-6, not ~1);
- a SIGINT to one process stops both at the same step with a checkpoint, and the pair resumes;
- both engines decode speculatively with one draft the pair fits after every step: the draft step 1
  saved equals one process fitting a new module on the rows both logged; the pair resumes it.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from harbor_helpers import write_harbor_task
from train_helpers import ROOT
from xla_flags import xla_flags

pytestmark = pytest.mark.slow

ARGS = [
    "steps=3",
    "prompts_per_step=4",
    "group_size=4",
    "async_steps=0",
    "rollout_workers=8",
    "save_every=1",
    "keep_checkpoints=5",
    "seq_len=256",
    "temperature=1.0",
    "rl.loss.temperature=1.0",
    "rl.optimizer.schedule=constant",
    "tasks.num_heldout=2",
    "eval.samples_per_task=2",
    "sft.steps=2",
    "sft.batch_size=6",
    "sft.seq_len=256",
    "agent.max_turns=1",
    "agent.max_tokens_per_turn=12",
    "agent.max_context_tokens=256",
    "engine.slots=8",
    "engine.max_cache_length=256",
    "engine.max_prefill_length=128",
    "mesh.data=2",
    "mesh.fsdp=-1",
    # The coin-flip verifier scores one reply, submitted or not; prompts come in the loader's order.
    "reward_requires_submit=false",
    "curriculum.enabled=false",
    # Speculative decoding, the draft (a new module: the checkpoint has none) fitted after each step.
    "engine.speculative_tokens=2",
    "engine.draft_fit_steps=2",
    "engine.draft_fit_batch_size=4",
]


def _coin_tasks(root: Path, n: int) -> Path:
    for i in range(n):
        write_harbor_task(
            root,
            f"coin-{i:02d}",
            "coin",
            f"Task {i}: list the files in /app.",
            "FROM ubuntu:24.04\nWORKDIR /app\n",
            "[ -f /app/solved ] || [ $((RANDOM % 2)) -eq 0 ]",
            {"solve.sh": "touch /app/solved\n"},
        )
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run_dir: Path, tasks: Path, logs: Path) -> list[subprocess.Popen]:
    addr = f"127.0.0.1:{_free_port()}"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=xla_flags(4))
    procs = []
    for pid in range(2):
        cmd = [sys.executable, "-m", "tmax_jax", "train", "configs/tiny-cpu.yaml", "--run-dir", str(run_dir)]
        cmd.append("--no-progress")
        sets = ARGS + [
            f"tasks.dir={tasks}",
            "distributed.mode=explicit",
            f"distributed.coordinator_address={addr}",
            "distributed.num_processes=2",
            f"distributed.process_id={pid}",
            "distributed.initialization_timeout_s=120",
        ]
        for a in sets:
            cmd += ["--set", a]
        log = open(logs / f"p{pid}.log", "a")
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _wait(procs, logs: Path, timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs]


def _tail(logs: Path) -> str:
    return "\n".join(f"--- p{i}\n" + (logs / f"p{i}.log").read_text()[-3000:] for i in range(2))


@pytest.fixture(scope="module")
def pod_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pod")
    tasks = _coin_tasks(tmp / "tasks", 10)
    run_dir, logs = tmp / "run", tmp / "logs"
    logs.mkdir()
    procs = _launch(run_dir, tasks, logs)
    # Interrupt process 1 alone once step 1 is checkpointed: both must stop at one step boundary.
    deadline = time.monotonic() + 600
    while not (run_dir / "checkpoints" / "1").is_dir():
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            _wait(procs, logs, 5)
            pytest.fail("no checkpoint 1 from the two-process run\n" + _tail(logs))
        time.sleep(0.5)
    procs[1].send_signal(signal.SIGINT)
    first = _wait(procs, logs, 300)
    interrupted = [(logs / f"p{i}.log").read_text() for i in range(2)]
    second = _wait(_launch(run_dir, tasks, logs), logs, 600)
    return {"run_dir": run_dir, "logs": logs, "first": first, "second": second, "interrupted": interrupted}


def test_sigint_to_one_process_stops_both_and_the_pair_resumes(pod_run):
    logs = pod_run["logs"]
    assert pod_run["first"] == [130, 130], _tail(logs)
    stopped = []
    for text in pod_run["interrupted"]:
        line = [ln for ln in text.splitlines() if ln.startswith("{") and '"interrupted"' in ln][-1]
        stopped.append(json.loads(line)["step"])
    assert stopped[0] == stopped[1] and stopped[0] >= 1
    assert pod_run["second"] == [0, 0], _tail(logs)
    for pid in (0, 1):  # each process went on from the draft the pair checkpointed
        text = (logs / f"p{pid}.log").read_text()
        assert f"resumed from checkpoint step {stopped[0]}" in text
        assert f"restored the draft fitted up to step {stopped[0]}" in text
    rows = [json.loads(ln) for ln in (pod_run["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # one writer, no step lost or repeated
    for r in rows:
        assert 1.0 <= r["speculative/tokens_per_step"] <= 3.0 and np.isfinite(r["speculative/draft_loss"])
    summary = json.loads((pod_run["run_dir"] / "summary.json").read_text())
    assert summary["steps"] == 3


def _assert_same_update(init: list, got: list, ref: list) -> None:
    """``got`` moved the parameters ``init`` as ``ref`` did, to within 1% of the reference update.

    The pod and the reference sum the same gradients in another order (rows packed per process vs
    at once); Adam's first steps divide by |g|, which turns float rounding on near-zero gradients
    into differences of a good part of lr on single elements (and on small tensors such as a layer's
    dt_bias). Elementwise tolerances flake on those; the update of the whole model must agree
    (dropping one process's rows would change it by tens of percent).
    """
    assert len(init) == len(got) == len(ref)
    update = np.concatenate([(np.asarray(r, np.float64) - i).ravel() for i, r in zip(init, ref)])
    gap = np.concatenate([(np.asarray(g, np.float64) - r).ravel() for g, r in zip(got, ref)])
    assert np.linalg.norm(update) > 0  # the step did train
    assert np.linalg.norm(gap) < 0.01 * np.linalg.norm(update), (
        f"updates differ by {np.linalg.norm(gap) / np.linalg.norm(update):.2%}"
    )


def _trajectories(run_dir: Path, step: int, pid: int) -> list[dict]:
    path = run_dir / "trajectories" / f"step_{step:06d}.p{pid}.jsonl"
    return [json.loads(ln) for ln in path.read_text().splitlines()]


def test_processes_sample_disjoint_prompt_shards(pod_run):
    run_dir = pod_run["run_dir"]
    for step in (1, 2, 3):
        tasks = [{t["task_id"] for t in _trajectories(run_dir, step, pid)} for pid in (0, 1)]
        groups = [{t["group_id"] for t in _trajectories(run_dir, step, pid)} for pid in (0, 1)]
        assert not tasks[0] & tasks[1] and not groups[0] & groups[1]
        assert len(groups[0]) == len(groups[1]) == 2  # prompts_per_step 4 over 2 processes


def test_both_engines_sample_with_the_updated_weights(pod_run):
    run_dir = pod_run["run_dir"]
    rows = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}
    for step in (2, 3):
        for pid in (0, 1):  # synchronous mode: everything of step N was sampled by policy N - 1
            versions = {v for t in _trajectories(run_dir, step, pid) for v in t["policy_versions"] if v >= 0}
            assert versions == {step - 1}
        if rows[step]["skipped_update"] == 0:
            # Trainer log-probs (params after step N - 1) vs what both engines recorded while sampling.
            assert rows[step]["max_abs_logprob_diff"] < 1e-3, rows[step]
            assert rows[step]["masked_fraction"] == 0.0


def test_step_one_equals_one_process_on_the_logged_rows(pod_run):
    import jax

    from tmax_jax.checkpoints import load_hf
    from tmax_jax.config import load_yaml, override
    from tmax_jax.rl.advantages import group_advantages
    from tmax_jax.rl.packing import pack_trajectories, pad_rows_pow2
    from tmax_jax.rl.state import TrainCheckpointer
    from tmax_jax.rl.train_step import TrainStep
    from tmax_jax.sharding import make_mesh
    from tmax_jax.train.config import TrainConfig

    assert jax.device_count() == 8
    run_dir = pod_run["run_dir"]
    cfg = override(TrainConfig(), load_yaml(run_dir / "config.yaml"))
    shares = [_trajectories(run_dir, 1, pid) for pid in (0, 1)]
    everyone = shares[0] + shares[1]
    adv = group_advantages(
        [t["reward"] for t in everyone], [t["group_id"] for t in everyone], cfg.rl.advantage
    )
    row = {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}[1]
    if not any(adv.keep):
        assert row["skipped_update"] == 1
        pytest.skip("every group of step 1 was flat (probability < 1e-4 with coin-flip verifiers)")

    def packable(d):  # the packer's view of a logged trajectory
        return SimpleNamespace(
            tokens=d["tokens"], response_mask=d["response_mask"], rollout_logprobs=d["rollout_logprobs"]
        )

    step_fn = TrainStep(
        load_hf(run_dir / "sft", dtype=cfg.model.dtype), cfg.rl, make_mesh(cfg.mesh), cfg.mesh
    )
    local, start = [], 0
    for share in shares:  # each process packs its kept episodes; all pad to one row count
        kept = [i for i in range(start, start + len(share)) if adv.keep[i]]
        batch, _ = pack_trajectories(
            [packable(everyone[i]) for i in kept],
            [float(adv.advantages[i]) for i in kept],
            seq_len=cfg.seq_len,
        )
        local.append(pad_rows_pow2(batch, step_fn.rows_multiple // 2))
        start += len(share)
    rows = max(b["input_ids"].shape[0] for b in local)
    batch = {
        k: np.concatenate([np.pad(b[k], ((0, rows - len(b[k])), (0, 0))) for b in local]) for k in local[0]
    }

    state0 = step_fn.init_state(seed=cfg.seed)
    before = [np.asarray(x) for x in jax.tree.leaves(state0.params)]
    state, metrics = step_fn(state0, batch)  # donates state0
    ckpt = TrainCheckpointer(run_dir / "checkpoints", async_save=False)
    try:
        saved, _ = ckpt.restore(1, step_fn.abstract_state())
    finally:
        ckpt.close()
    np.testing.assert_allclose(row["loss"], float(metrics["loss"]), rtol=1e-4, atol=1e-6)
    assert row["response_tokens"] == float(metrics["response_tokens"])
    _assert_same_update(before, jax.tree.leaves(saved.params), jax.tree.leaves(state.params))


def test_pair_fits_the_draft_one_process_would(pod_run):
    """The draft checkpointed with step 1 is what one process makes of the new module the run started
    from, fitted to step 1's policy on the rows both processes logged for step 1 (in process order,
    the step's row draws): the pair fitted one draft on everyone's rollouts, not each its own."""
    import jax
    from flax import nnx

    from tmax_jax.checkpoints import load_hf
    from tmax_jax.config import load_yaml, override
    from tmax_jax.rl.state import TrainCheckpointer
    from tmax_jax.rl.train_step import TrainStep
    from tmax_jax.sharding import make_mesh
    from tmax_jax.train.config import TrainConfig
    from tmax_jax.train.mtp_fit import DraftFitter, new_draft

    run_dir = pod_run["run_dir"]
    cfg = override(TrainConfig(), load_yaml(run_dir / "config.yaml"))
    step_fn = TrainStep(
        load_hf(run_dir / "sft", dtype=cfg.model.dtype), cfg.rl, make_mesh(cfg.mesh), cfg.mesh
    )
    e = cfg.engine
    start = new_draft(cfg, run_dir / "init")
    before = [np.asarray(x) for x in jax.tree.leaves(nnx.state(start, nnx.Param))]
    ckpt = TrainCheckpointer(run_dir / "checkpoints", async_save=False)
    try:
        policy = step_fn.model(ckpt.restore(1, step_fn.abstract_state())[0])
        ref = DraftFitter(
            policy, start, learning_rate=e.draft_fit_learning_rate, batch_size=e.draft_fit_batch_size,
            seq_len=cfg.seq_len,
        )  # fmt: skip
        saved = ckpt.restore_draft(1, ref.abstract_state())
    finally:
        ckpt.close()
    logged = _trajectories(run_dir, 1, 0) + _trajectories(run_dir, 1, 1)
    rows, masks = [t["tokens"] for t in logged], [t["response_mask"] for t in logged]
    ref.fit(policy, rows, e.draft_fit_steps, masks=masks, seed=(cfg.seed, 1))
    _assert_same_update(before, jax.tree.leaves(saved["params"]), jax.tree.leaves(ref.state()["params"]))


def test_warm_start_equals_one_process_sft(pod_run, tmp_path):
    from tmax_jax.agent.trajectory import read_jsonl
    from tmax_jax.config import load_yaml, override
    from tmax_jax.train.config import TrainConfig
    from tmax_jax.train.sft import EXAMPLES_FILE, run_sft

    run_dir = pod_run["run_dir"]
    cfg = override(TrainConfig(), load_yaml(run_dir / "config.yaml"))
    examples = list(read_jsonl(run_dir / "sft" / EXAMPLES_FILE))
    assert len(examples) == 8  # every train task's solution, replayed half by each process
    assert len({t.task_id for t in examples}) == 8
    summary = run_sft(run_dir / "init", examples, tmp_path / "sft", cfg, progress=False, log=lambda m: None)
    pod = json.loads((run_dir / "sft" / "sft_summary.json").read_text())
    np.testing.assert_allclose(pod["final_nll"], summary["final_nll"], rtol=1e-5)
    from safetensors.numpy import load_file

    ref, got = (
        load_file(tmp_path / "sft" / "model.safetensors"),
        load_file(run_dir / "sft" / "model.safetensors"),
    )
    init = load_file(run_dir / "init" / "model.safetensors")
    assert ref.keys() == got.keys() == init.keys()
    _assert_same_update([init[k] for k in ref], [got[k] for k in ref], [ref[k] for k in ref])
