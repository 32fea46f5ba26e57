"""Ctrl-C (SIGINT) on `tmax-jax train` with real sandboxes: during RL it saves the step reached (and the
loader position of that step) and exits 130; during the SFT warm start or the first eval it exits 130
at once, without waiting for the replays or episodes under way. Either way no process it started
(sandboxes, their shells) outlives it."""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from sandbox_helpers import DescendantWatcher
from train_helpers import ROOT, train_cmd, train_env

from tmax_jax.train.demo_tasks import write_tasks


def _start(tmp_path: Path, run_dir: Path, *overrides: str):
    out, err = open(tmp_path / "stdout.log", "w"), open(tmp_path / "stderr.log", "w")
    proc = subprocess.Popen(
        train_cmd(run_dir, *overrides),
        cwd=ROOT,
        env=train_env(),
        stdout=out,
        stderr=err,
        start_new_session=True,
    )
    watcher = DescendantWatcher(proc.pid)
    watcher.start()
    return proc, watcher


def _wait_for(proc, what: str, ready, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        assert proc.poll() is None, f"exited {proc.returncode} before {what}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s:.0f}s"
        time.sleep(0.1)


def _interrupt(proc, watcher: DescendantWatcher, timeout_s: float) -> float:
    """SIGINT as a terminal's Ctrl-C sends it (sandboxes run in their own sessions); returns the
    seconds the run took to exit."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise AssertionError(f"still running {timeout_s:.0f}s after SIGINT") from None
    finally:
        watcher.stop()
    took = time.monotonic() - t0
    print(f"exited {proc.returncode} {took:.1f}s after SIGINT")
    return took


def test_sigint_during_rl_saves_the_step_and_exits_130(tmp_path):
    run_dir, sandboxes = tmp_path / "run", tmp_path / "sandboxes"
    # save_every=10: the loop saves no checkpoint in this run, so the one found is the interrupt's.
    # steps=6: the run cannot finish between the first metrics row and the signal.
    # The curriculum off: the prompt loader's position is what this test checks (the curriculum's own
    # state survives the kill-and-resume test in test_train_loop.py).
    proc, watcher = _start(
        tmp_path,
        run_dir,
        "steps=6",
        "save_every=10",
        "curriculum.enabled=false",
        f"sandbox.run_dir={sandboxes}",
    )
    metrics = run_dir / "metrics.jsonl"
    try:
        _wait_for(
            proc,
            "first RL step",
            lambda: metrics.is_file() and metrics.read_text().strip(),
            tmp_path / "stderr.log",
            900,
        )
        _interrupt(proc, watcher, timeout_s=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "stderr.log").read_text()
    assert proc.returncode == 130, err[-3000:]

    reported = json.loads((tmp_path / "stdout.log").read_text().splitlines()[-1])
    assert reported["interrupted"] is True and 1 <= reported["step"] < 6
    step = reported["step"]
    assert f"interrupted: saving step {step} and exiting" in err
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [step]
    # The checkpoint resumes the prompt loader right after the batches of the steps it holds (the
    # rollouts had drawn more batches than the trainer had trained on).
    data = json.loads((run_dir / "checkpoints" / str(step) / "data" / "metadata").read_text())
    assert data["version"] == step and data["loaders"][0]["batches_done"] == step  # one per process
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, step + 1))
    assert not (run_dir / "summary.json").exists()

    # Episodes ran in sandboxes, and none of them (nor anything else the run started) is left.
    assert watcher.sandboxes(), "no sandbox was seen: the check below would be vacuous"
    assert watcher.still_running() == []
    assert [p.name for p in sandboxes.iterdir()] == []


def test_sigint_during_the_warm_start_exits_130_at_once(tmp_path):
    run_dir, sandboxes, tasks = tmp_path / "run", tmp_path / "sandboxes", tmp_path / "tasks"
    # Reference solutions that take a minute (as real ones that build or install things do): the
    # warm start replays them in sandboxes when the signal comes, and must not wait for them.
    for d in write_tasks(tasks, range(4)):
        solve = d / "solution" / "solve.sh"
        solve.write_text(solve.read_text().replace("#!/bin/bash\n", "#!/bin/bash\nsleep 60\n"))
    overrides = [f"tasks.dir={tasks}", "agent.command_timeout_s=120", f"sandbox.run_dir={sandboxes}"]
    proc, watcher = _start(tmp_path, run_dir, *overrides)
    try:
        _wait_for(proc, "a demonstration sandbox", watcher.sandboxes, tmp_path / "stderr.log", 300)
        time.sleep(1.0)  # the replays are under way (solve.sh sleeping)
        took = _interrupt(proc, watcher, timeout_s=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = (tmp_path / "stderr.log").read_text()
    assert proc.returncode == 130 and "interrupted" in err, err[-3000:]
    assert took < 20, f"{took:.0f}s from SIGINT to exit: the run waited for the replays"
    assert not (run_dir / "sft" / "DONE").exists() and not (run_dir / "checkpoints").exists()
    assert watcher.still_running() == []
    assert [p.name for p in sandboxes.iterdir()] == []


def test_sigint_during_the_first_eval_exits_130_at_once(tmp_path):
    run_dir, sandboxes = tmp_path / "run", tmp_path / "sandboxes"
    # Long episodes (4 turns of up to 512 tokens on 8 held-out tasks): the eval is far from over when
    # the signal comes, and must not be played out.
    overrides = ["tasks.num_heldout=8", "agent.max_turns=4", "agent.max_tokens_per_turn=512"]
    overrides += ["agent.max_context_tokens=2048", "engine.max_cache_length=2048"]
    proc, watcher = _start(tmp_path, run_dir, *overrides, f"sandbox.run_dir={sandboxes}")
    log = tmp_path / "stderr.log"
    try:
        _wait_for(proc, "the first eval", lambda: "pass rate before RL" in log.read_text(), log, 900)
        demos = len(watcher.sandboxes())
        _wait_for(proc, "an eval sandbox", lambda: len(watcher.sandboxes()) > demos, log, 300)
        time.sleep(2.0)  # episodes under way
        took = _interrupt(proc, watcher, timeout_s=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    err = log.read_text()
    assert proc.returncode == 130 and "interrupted" in err, err[-3000:]
    assert took < 30, f"{took:.0f}s from SIGINT to exit: the run played the eval out"
    assert not (run_dir / "eval_before.json").exists()
    assert not [p for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()]
    assert watcher.still_running() == []
    assert [p.name for p in sandboxes.iterdir()] == []


def test_an_interrupt_inside_a_deferred_block_is_raised_at_its_end():
    from tmax_jax.train.loop import _Interrupts

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    interrupts = _Interrupts()
    interrupts.install()
    try:
        finished = False
        with pytest.raises(KeyboardInterrupt):
            with interrupts.deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.2)  # the handler runs in here, and must not raise
                finished = True
        assert finished
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)
    finally:
        interrupts.restore()
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
