"""`tmax-jax train` end to end on the tiny model with real sandboxes and real tasks: a run is killed
mid-way (SIGKILL), resumed from its last checkpoint, and finishes with metrics, trajectories,
a summary and a learning-curve PNG. It decodes speculatively with a draft fitted after every step
(the checkpoint has no MTP module: a new one), which is checkpointed, resumed and exported too."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
from train_helpers import ROOT, train_cmd, train_env
from transformers import AutoTokenizer

# Speculative decoding with 2 drafted tokens, the draft refitted (2 AdamW steps) after every step.
DRAFT = ("engine.speculative_tokens=2", "engine.draft_fit_steps=2", "engine.draft_fit_batch_size=2")


def test_train_killed_and_resumed(tmp_path):
    root = ROOT
    run_dir = tmp_path / "run"
    log1 = open(tmp_path / "first.log", "w")
    proc = subprocess.Popen(
        train_cmd(run_dir, *DRAFT),
        cwd=root,
        env=train_env(),
        stdout=log1,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 600
    try:
        while not (run_dir / "checkpoints" / "1").is_dir():
            assert proc.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 10 minutes"
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (run_dir / "summary.json").exists()
    # Trajectory files are appended to: what the killed run wrote is not the resumed run's.
    lines_before_resume = {
        p.name: len(p.read_text().splitlines()) for p in (run_dir / "trajectories").glob("*.jsonl")
    }

    done = subprocess.run(
        train_cmd(run_dir, *DRAFT), cwd=root, env=train_env(), capture_output=True, text=True, timeout=900
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]
    assert "resumed from checkpoint step" in out
    resumed_at = int(out.split("resumed from checkpoint step ")[1].split()[0])
    assert resumed_at >= 1
    # The fitted draft went on from the one checkpointed with that step, not from a new module.
    assert f"restored the draft fitted up to step {resumed_at}" in out, out[-4000:]
    # Resume at the right policy version: the resumed run's first batch was sampled by an engine that
    # carries the restored version (not 0), so every one of its policy tokens records exactly it.
    first_file = f"step_{resumed_at + 1:06d}.jsonl"
    first_batch = (run_dir / "trajectories" / first_file).read_text().splitlines()
    first_batch = first_batch[lines_before_resume.get(first_file, 0) :]
    assert first_batch
    versions = {
        v
        for line in first_batch
        for v, m in zip(json.loads(line)["policy_versions"], json.loads(line)["response_mask"])
        if m
    }
    assert versions == {resumed_at}, versions

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # no step lost or repeated across the kill
    for key in ("reward_mean", "pass_rate", "episode_turns_mean", "staleness_max", "adv/groups_dropped"):
        assert key in rows[-1]
    for r in rows:  # every step decoded speculatively and refitted its draft
        assert 1.0 <= r["speculative/tokens_per_step"] <= 3.0 and np.isfinite(r["speculative/draft_loss"])

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3
    assert 0.0 <= summary["pass_rate_before"] <= 1.0 and 0.0 <= summary["pass_rate_after"] <= 1.0
    assert (run_dir / "learning_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run_dir / "sft" / "DONE").is_file() and (run_dir / "config.yaml").is_file()

    # Trajectories: the masked-in tokens are exactly the policy's replies, each ending the turn or
    # cut at the token limit; weights pushed after step 1 reached the engine before step 3's rollouts.
    tok = AutoTokenizer.from_pretrained(str(run_dir / "init"))
    end_id = tok.convert_tokens_to_ids("<|im_end|>")
    trajs = [
        json.loads(line) for line in (run_dir / "trajectories" / "step_000003.jsonl").read_text().splitlines()
    ]
    assert trajs
    for t in trajs:
        n = len(t["tokens"])
        assert len(t["response_mask"]) == n == len(t["rollout_logprobs"]) == len(t["policy_versions"])
        spans, cur = [], []
        for tok_id, m, v, lp in zip(
            t["tokens"], t["response_mask"], t["policy_versions"], t["rollout_logprobs"]
        ):
            if m:
                cur.append(tok_id)
                assert v >= 0 and lp <= 0.0
            else:
                assert v == -1 and lp == 0.0
                if cur:
                    spans.append(cur)
                    cur = []
        if cur:
            spans.append(cur)
        assert 1 <= len(spans) <= 2
        for s in spans[:-1]:
            assert s[-1] == end_id or len(s) == 24
        assert max(v for v, m in zip(t["policy_versions"], t["response_mask"]) if m) >= 1

    # Any checkpointed step exports to a directory transformers loads; training moved the weights.
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    out_dir = tmp_path / "export"
    exp = subprocess.run(
        [sys.executable, "-m", "tmax_jax", "export-hf", str(run_dir), "--step", "3", "--out", str(out_dir)],
        cwd=root,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert exp.returncode == 0, exp.stderr[-2000:]
    hf = AutoModelForCausalLM.from_pretrained(str(out_dir))
    ids = torch.tensor([tok.encode("echo hi")])
    assert torch.isfinite(hf(ids).logits).all()
    a, b = (
        load_file(str(out_dir / "model.safetensors")),
        load_file(str(run_dir / "sft" / "model.safetensors")),
    )
    # The export adds the fitted draft's mtp.* tensors to the policy's.
    assert {k for k in a if not k.startswith("mtp.")} == b.keys() and any(k.startswith("mtp.") for k in a)
    # The exported weights moved away from the warm start exactly when some step applied an update
    # (a step whose groups all had equal rewards is skipped: no learning signal).
    updated = any(r.get("skipped_update") == 0 for r in rows)
    assert any(not np.array_equal(a[k], b[k]) for k in b) == updated
    _exported_draft_is_step_3s(run_dir, out_dir)
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "tmax_jax",
            "export-hf",
            str(run_dir),
            "--step",
            "99",
            "--out",
            str(tmp_path / "x"),
        ],
        cwd=root,
        env=train_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "no checkpoint for step 99" in bad.stderr


def _exported_draft_is_step_3s(run_dir, out_dir):
    """The exported MTP module holds the draft checkpointed with step 3, which fitting moved away from
    the new module the run started from."""
    import jax
    from flax import nnx

    from tmax_jax.checkpoints import load_hf, load_mtp
    from tmax_jax.rl.state import TrainCheckpointer
    from tmax_jax.train.config import load_train_config
    from tmax_jax.train.mtp_fit import DraftFitter, new_draft

    exported = load_mtp(out_dir)
    fitter = DraftFitter(load_hf(out_dir), exported, learning_rate=1e-3, batch_size=1, seq_len=8)
    ck = TrainCheckpointer(run_dir / "checkpoints", async_save=False)
    try:
        saved = ck.restore_draft(3, fitter.abstract_state())["params"]
    finally:
        ck.close()
    got = jax.tree.leaves(nnx.state(exported, nnx.Param))
    for x, y in zip(got, jax.tree.leaves(saved), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    cfg = load_train_config(run_dir / "config.yaml", {})
    start = jax.tree.leaves(nnx.state(new_draft(cfg, run_dir / "init"), nnx.Param))
    assert any(not np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(got, start))
