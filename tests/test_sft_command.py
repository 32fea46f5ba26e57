"""`tmax-jax sft` on a real tiny checkpoint: reference solutions of real demo tasks replayed in
bubblewrap sandboxes (--tasks), or trainer-written trajectory JSONL (--trajectories). The NLL of the
training data is recomputed independently with transformers (PyTorch) on the input and output
checkpoints."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers_hf import hf_logits, load_hf_torch
from xla_flags import xla_flags

from tmax_jax.agent.trajectory import Trajectory, read_jsonl, write_jsonl
from tmax_jax.checkpoints import load_hf
from tmax_jax.checkpoints.tiny import write_tiny_checkpoint
from tmax_jax.cli import main
from tmax_jax.tokenizer import load_tokenizer
from tmax_jax.train.demo_tasks import write_tasks

pytest.importorskip("torch")

SEQ_LEN = 384


def policy_nll(model, trajs: list[Trajectory]) -> float:
    """Mean NLL per policy token under a transformers model (or checkpoint dir): log-softmax in
    float64 NumPy over its logits, at the positions whose next token the policy produced. Rows are
    right-padded into one batch; a causal model's logits before the padding do not see it."""
    model = load_hf_torch(model) if isinstance(model, Path) else model
    width = max(len(t.tokens) for t in trajs) - 1
    ids = np.zeros((len(trajs), width), np.int64)
    for i, t in enumerate(trajs):
        ids[i, : len(t.tokens) - 1] = t.tokens[:-1]
    logits = hf_logits(model, ids).astype(np.float64)
    logp = logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True)
    total, count = 0.0, 0
    for i, t in enumerate(trajs):
        n = len(t.tokens) - 1
        mask = np.asarray(t.response_mask[1:], bool)
        total -= logp[i, np.arange(n), t.tokens[1:]][mask].sum()
        count += int(mask.sum())
    return total / count


def sft(root: Path, *args: str) -> dict:
    """``tmax-jax sft`` in a subprocess on one CPU device (a laptop's setup, and a cheaper compile than
    the test process's 8 fake devices); the runs share a compilation cache of their own, so only the
    first one compiles the SFT step (all use the same config, row shapes and learning rate)."""
    env = dict(os.environ, XLA_FLAGS=xla_flags())
    env["JAX_COMPILATION_CACHE_DIR"] = str(root / "xla_cache")
    cmd = [sys.executable, "-m", "tmax_jax", "sft", "--checkpoint", str(root / "init"), *args]
    cmd += ["--config", str(root / "cfg.yaml"), "--lr", "3e-3", "--seq-len", str(SEQ_LEN), "--no-progress"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return {"stderr": done.stderr, "summary": json.loads(done.stdout.splitlines()[-1])}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    write_tiny_checkpoint(root / "init", seed=0)
    tasks = write_tasks(root / "tasks", range(4), num_words=4)
    # A short system turn without the tool schema: rows stay small, as in the CPU demo config.
    cfg = {
        "rollout_workers": 2,
        "agent": {"tool_schema_in_prompt": False, "system_prompt": "Use the bash tool."},
        "rl": {"train_step": {"remat": "none"}},
    }
    (root / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    out = root / "out"
    run = sft(root, "--out", str(out), "--tasks", str(root / "tasks"), "--steps", "6", "--batch-size", "4")
    assert run["summary"] == json.loads((out / "sft_summary.json").read_text())
    return root, tasks, out


def test_sft_on_task_demonstrations_lowers_their_nll(setup):
    root, tasks, out = setup
    summary = json.loads((out / "sft_summary.json").read_text())
    assert summary["steps"] == 6 and summary["examples"] == 4

    # The examples are the tasks' reference solutions, sent as the policy's tool call.
    demos = list(read_jsonl(out / "sft_examples.jsonl"))
    tok = load_tokenizer(out)
    assert sorted(d.task_id for d in demos) == sorted(t.name for t in tasks)
    for d in demos:
        said = tok.decode([x for x, m in zip(d.tokens, d.response_mask) if m])
        solution = (root / "tasks" / d.task_id / "solution" / "solve.sh").read_text().splitlines()[1]
        assert solution in said and d.reward == 1.0

    trained = load_hf_torch(out)
    before, after = policy_nll(root / "init", demos), policy_nll(trained, demos)
    # Step 1 trained on all four examples: its loss is exactly their NLL under the input checkpoint.
    assert summary["first_nll"] == pytest.approx(before, rel=1e-4)
    assert after < 0.8 * before, (before, after)
    assert summary["final_nll"] < summary["first_nll"]
    # Our loader reads the output too, the same weights transformers reads.
    ours = np.asarray(load_hf(out).embed_tokens[...])
    np.testing.assert_array_equal(ours, trained.get_input_embeddings().weight.detach().numpy())


def test_sft_on_trajectories_keeps_only_successful_ones(setup, tmp_path, capsys):
    root, _, out = setup
    demos = list(read_jsonl(out / "sft_examples.jsonl"))
    failed = Trajectory(**{**demos[0].to_json(), "reward": 0.0, "task_id": "failed"})
    failed.tokens = list(reversed(failed.tokens))  # a different token sequence, so its NLL differs
    path = tmp_path / "step_000001.jsonl"
    write_jsonl(path, [demos[0], failed, demos[1], demos[2]])
    run = sft(
        root, "--out", str(tmp_path / "o"), "--trajectories", str(path), "--steps", "1", "--batch-size", "8"
    )
    summary = run["summary"]
    assert summary["examples"] == 3 and f"{path}: 3 of 4 trajectories with reward >= 1.0" in run["stderr"]
    # The one step saw exactly the three passing trajectories (batch 8 >= 3 takes them all).
    assert summary["first_nll"] == pytest.approx(policy_nll(root / "init", demos[:3]), rel=1e-4)

    # Bad input is named: nothing passing, a token the checkpoint cannot embed, no checkpoint.
    only_failed = tmp_path / "failed.jsonl"
    write_jsonl(only_failed, [failed])
    argv = ["sft", "--checkpoint", str(root / "init"), "--out", str(tmp_path / "x"), "--trajectories"]
    assert main([*argv, str(only_failed)]) == 2
    assert f"no trajectory with reward >= 1.0 in {only_failed}" in capsys.readouterr().err
    vocab = json.loads((root / "init" / "config.json").read_text())["vocab_size"]
    alien = Trajectory(**{**demos[1].to_json(), "tokens": [*demos[1].tokens[:-1], vocab + 7]})
    bad = tmp_path / "alien.jsonl"
    write_jsonl(bad, [demos[0], alien])
    assert main([*argv, str(bad)]) == 2
    assert f"{bad}:2: token id {vocab + 7} is outside the checkpoint's vocabulary" in capsys.readouterr().err
    argv[2] = str(root / "nope")
    assert main([*argv, str(path)]) == 2
    assert f"checkpoint directory {root / 'nope'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
