"""Harbor and TMAX tasks end to end on real bwrap sandboxes: rewards, bad inputs, no leaks."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from sandbox_helpers import sandbox_leftovers

from tmax_jax.errors import TaskFormatError
from tmax_jax.sandbox import SandboxConfig, SandboxPool
from tmax_jax.sandbox.cgroup import available as cgroup_available
from tmax_jax.tasks import find_tasks, load_task
from tmax_jax.tasks.model import parse_size_mb
from tmax_jax.tasks.runner import run_task

TASKS = Path(__file__).parent / "tasks"
HARBOR = TASKS / "harbor_csv_sum"
TMAX = TASKS / "tmax_log_errors"


@pytest.fixture
def cfg(tmp_path):
    return SandboxConfig(cache_dir=str(tmp_path / "cache"))


def _no_leaks(cfg: SandboxConfig) -> None:
    run = Path(cfg.cache_dir) / "run"
    assert not run.exists() or list(run.iterdir()) == []
    assert sandbox_leftovers(cfg.cache_dir) == []


def test_load_harbor_task():
    t = load_task(HARBOR)
    assert t.format == "harbor" and t.name == "harbor_csv_sum"
    assert "revenue" in t.instruction
    assert (t.limits.agent_timeout_s, t.limits.verifier_timeout_s) == (60.0, 60.0)
    assert (t.limits.memory_mb, t.limits.storage_mb, t.limits.allow_internet) == (1024, 512, False)
    assert t.environment.kind == "dockerfile" and t.solution.name == "solve.sh"
    assert t.metadata["category"] == "data_science"


def test_load_tmax_task():
    t = load_task(TMAX)
    assert t.format == "tmax" and t.signature["domain"] == "system_administration"
    assert t.environment.kind == "apptainer_def" and t.environment.setup_script.name == "setup.sh"
    assert t.initial_test.name == "test_initial_state.py" and t.final_test.name == "test_final_state.py"
    assert t.metadata["truth"].startswith("app.log: 2")
    assert t.limits.memory_mb == 1024


def test_find_tasks():
    assert [p.name for p in find_tasks(TASKS)] == ["harbor_csv_sum", "tmax_log_errors"]


@pytest.mark.parametrize("task_dir", [HARBOR, TMAX], ids=["harbor", "tmax"])
def test_oracle_scores_one_noop_scores_zero(task_dir, cfg):
    task = load_task(task_dir)
    good = run_task(task, "oracle", cfg)
    assert (good.reward, good.passed, good.reason) == (1.0, True, "ok"), good.verifier_log
    bad = run_task(task, None, cfg)
    assert (bad.reward, bad.passed, bad.reason) == (0.0, False, "verifier failed")
    assert "failed" in bad.verifier_log
    _no_leaks(cfg)


def test_agent_acts_through_the_persistent_shell(cfg):
    def agent(task, sh):
        sh.run("cd /app")
        r = sh.run(
            "awk -F, 'NR>1{s+=$2*$3} END{printf \"%.2f\\n\", s}' sales.csv > revenue.txt && cat revenue.txt"
        )
        return r.stdout

    res = run_task(load_task(HARBOR), agent, cfg)
    assert res.reward == 1.0 and res.agent_output.strip() == "141.69"


def test_tampering_with_tests_and_reward_does_not_help(cfg):
    def cheat(task, sh):
        sh.run(
            "mkdir -p /tests /logs/verifier && printf '#!/bin/bash\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh"
        )
        sh.run("echo 1 > /logs/verifier/reward.txt; echo 1 > /logs/verifier/reward.json")

    res = run_task(load_task(HARBOR), cheat, cfg)
    assert res.reward == 0.0 and res.reason == "verifier failed"


def test_hostile_agents_leave_the_host_unchanged(cfg, tmp_path):
    sentinel = tmp_path / "sentinel"
    sentinel.write_text("x")

    bounded = cgroup_available() or os.geteuid() != 0

    def hostile(task, sh):
        if bounded:  # root ignores RLIMIT_NPROC: without a pids cgroup a bomb would hit the host
            sh.run(":(){ :|:& };:", timeout=2)
        sh.run("head -c 1G /dev/zero", timeout=20)
        sh.run(
            f"echo pwned > {sentinel}; python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 80), timeout=2)'"
        )
        sh.run("rm -rf --no-preserve-root / 2>/dev/null", timeout=5)

    res = run_task(load_task(HARBOR), hostile, SandboxConfig(cache_dir=cfg.cache_dir, pids_max=64))
    assert res.reward == 0.0
    assert sentinel.read_text() == "x"
    _no_leaks(cfg)


def _harbor_copy(tmp_path: Path, test_sh: str) -> Path:
    d = tmp_path / "task"
    shutil.copytree(HARBOR, d)
    (d / "tests" / "test.sh").write_text(test_sh)
    return d


def test_verifier_timeout_gives_reward_zero(cfg, tmp_path):
    d = _harbor_copy(tmp_path, "#!/bin/bash\nsleep 600\n")
    toml = (
        (d / "task.toml").read_text().replace("[verifier]\ntimeout_sec = 60.0", "[verifier]\ntimeout_sec = 2")
    )
    (d / "task.toml").write_text(toml)
    res = run_task(load_task(d), "oracle", cfg)
    assert (res.reward, res.reason) == (0.0, "verifier timeout")
    assert res.phases_s["verifier"] < 10
    _no_leaks(cfg)


def test_verifier_without_reward(cfg, tmp_path):
    d = _harbor_copy(tmp_path, "#!/bin/bash\necho checked\n")
    res = run_task(load_task(d), "oracle", cfg)
    assert res.reward == 0.0 and res.reason.startswith("verifier wrote no reward")
    d2 = _harbor_copy(
        tmp_path / "b", "#!/bin/bash\nmkdir -p /logs/verifier; echo banana > /logs/verifier/reward.txt\n"
    )
    res = run_task(load_task(d2), "oracle", cfg)
    assert res.reward == 0.0 and "invalid reward: reward.txt is not a finite decimal number" in res.reason
    d3 = _harbor_copy(
        tmp_path / "c",
        "#!/bin/bash\nmkdir -p /logs/verifier; echo '{\"reward\": 0.25}' > /logs/verifier/reward.json\n",
    )
    res = run_task(load_task(d3), "oracle", cfg)
    assert res.reward == 0.25 and not res.passed


def test_broken_environment_and_initial_state(cfg, tmp_path):
    d = tmp_path / "h"
    shutil.copytree(HARBOR, d)
    (d / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nVOLUME /data\n")
    res = run_task(load_task(d), "oracle", cfg)
    assert res.reward == 0.0 and "VOLUME is not supported" in res.reason
    t = tmp_path / "t"
    shutil.copytree(TMAX, t)
    (t / "setup.sh").write_text("#!/bin/bash\ntrue\n")  # fixtures never installed
    res = run_task(load_task(t), "oracle", cfg)
    assert (res.reward, res.reason) == (0.0, "initial-state test failed")


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: (d / "task.toml").write_text("[verifier\ntimeout_sec = 1"), "not valid TOML"),
        (lambda d: (d / "task.toml").unlink(), "missing task.toml"),
        (
            lambda d: (d / "task.toml").write_text("[verifier]\ntimeout_sec = 'soon'\n"),
            "verifier.timeout_sec: expected a number",
        ),
        (
            lambda d: (d / "task.toml").write_text("[environment]\nmemory = 'lots'\n"),
            "cannot read size 'lots'",
        ),
        (lambda d: (d / "tests" / "test.sh").unlink(), "missing tests/test.sh"),
        (lambda d: (d / "instruction.md").write_text("  \n"), "instruction is empty"),
        (lambda d: shutil.rmtree(d / "environment"), "no environment/Dockerfile"),
    ],
)
def test_malformed_harbor_tasks(tmp_path, mutate, match):
    d = tmp_path / "task"
    shutil.copytree(HARBOR, d)
    mutate(d)
    with pytest.raises(TaskFormatError, match=match):
        load_task(d)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: (d / "task.json").write_text("{not json"), "not valid JSON"),
        (lambda d: (d / "task.json").write_text("[]"), "top level must be an object"),
        (lambda d: (d / "task.json").write_text('{"truth": "x"}'), "non-empty string 'prompt'"),
        (
            lambda d: (d / "task.json").write_text('{"prompt": "p", "limits": {"gpus": 1}}'),
            "unknown limit 'gpus'",
        ),
        (lambda d: (d / "test_final_state.py").unlink(), "missing test_final_state.py"),
    ],
)
def test_malformed_tmax_tasks(tmp_path, mutate, match):
    d = tmp_path / "task"
    shutil.copytree(TMAX, d)
    mutate(d)
    with pytest.raises(TaskFormatError, match=match):
        load_task(d)


def test_older_harbor_spellings(tmp_path):
    d = tmp_path / "task"
    shutil.copytree(HARBOR, d)
    (d / "task.toml").write_text(
        "max_agent_timeout_sec = 30\nmax_test_timeout_sec = 20\n[environment]\nmemory_mb = 4096\nstorage_mb = 2048\nnetwork = true\n"
    )
    lim = load_task(d).limits
    assert (
        lim.agent_timeout_s,
        lim.verifier_timeout_s,
        lim.memory_mb,
        lim.storage_mb,
        lim.allow_internet,
    ) == (30, 20, 4096, 2048, True)
    assert parse_size_mb("1.5GiB", "x") == 1536 and parse_size_mb(512, "x") == 512


def test_pool_runs_tasks_concurrently(cfg):
    with SandboxPool(cfg, size=2) as pool:
        futs = [
            pool.submit(run_task, load_task(d), a, cfg, pool=pool)
            for d in (HARBOR, TMAX)
            for a in ("oracle", None)
        ]
        rewards = [f.result().reward for f in futs]
        m = pool.metrics.summary()
    assert rewards == [1.0, 0.0, 1.0, 0.0]
    assert m["in_flight_max"] <= 2 and len(pool.metrics.start_latency_s) == 4 and not m["failures"]
    _no_leaks(cfg)


def _cli(*args, cache):
    env = {**os.environ, "TMAX_JAX_CACHE": cache}
    return subprocess.run(
        [sys.executable, "-m", "tmax_jax", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_run_task_json(cfg):
    r = _cli("run-task", str(HARBOR), "--oracle", "--json", cache=cfg.cache_dir)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["task"] == "harbor_csv_sum" and out["reward"] == 1.0 and out["passed"] is True
    assert {"duration_s", "verifier_log"} <= set(out)
    r = _cli("run-task", str(TMAX), "--json", cache=cfg.cache_dir)
    assert r.returncode == 1 and json.loads(r.stdout.strip().splitlines()[-1])["reward"] == 0.0
    r = _cli("run-task", "/nonexistent/task", cache=cfg.cache_dir)
    assert r.returncode == 2 and "task directory not found" in r.stderr


def test_cli_run_task_scores_a_malformed_task(cfg, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(HARBOR, d)
    toml = (d / "task.toml").read_text()
    (d / "task.toml").write_text(toml.replace("cpus = 1\n", "cpus = 0.001\n"))
    r = _cli("run-task", str(d), "--oracle", "--json", cache=cfg.cache_dir)
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 1 and out["reward"] == 0.0 and "cpus" in out["reason"], (r.stdout, r.stderr)


def test_agent_code_errors_propagate_sandbox_errors_score_zero(cfg):
    task = load_task(HARBOR)

    def buggy_policy(task, shell):
        raise RuntimeError("engine bug")

    with pytest.raises(RuntimeError, match="engine bug"):
        run_task(task, buggy_policy, cfg)

    def kills_the_sandbox(task, shell):
        shell.run("kill -9 1")  # pid 1 of the sandbox ignores it from inside; the shell goes on
        shell.sandbox.close()  # as a dead sandbox would: every later step fails
        return "done"

    res = run_task(task, kills_the_sandbox, cfg)
    assert res.reward == 0.0 and "not running" in res.reason, res.reason


def test_cli_run_tasks_summary(cfg):
    r = _cli("run-tasks", str(TASKS), "--oracle", "--concurrency", "2", cache=cfg.cache_dir)
    assert r.returncode == 0, r.stderr
    assert "2/2 passed" in r.stdout and "harbor_csv_sum" in r.stdout and "tmax_log_errors" in r.stdout
