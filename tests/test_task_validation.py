"""Task limits (task.toml, task.json, TaskLimits), SandboxConfig values and the CFS quota: a bad value
is an error naming the file and field, never a crash or a timeout that cannot fire."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import uuid
from pathlib import Path

import pytest

from tmax_jax.errors import ConfigError, TaskFormatError
from tmax_jax.sandbox import SandboxConfig, cgroup
from tmax_jax.sandbox.config import MAX_TIMEOUT_S as MAX_SANDBOX_TIMEOUT_S
from tmax_jax.tasks import load_task
from tmax_jax.tasks.environment import sandbox_config_for
from tmax_jax.tasks.model import MAX_TIMEOUT_S, TaskLimits

TASKS = Path(__file__).parent / "tasks"
HARBOR = TASKS / "harbor_csv_sum"
TMAX = TASKS / "tmax_log_errors"


def _harbor(tmp_path: Path, toml: str | bytes) -> Path:
    d = tmp_path / "task"
    shutil.copytree(HARBOR, d)
    p = d / "task.toml"
    p.write_bytes(toml if isinstance(toml, bytes) else toml.encode())
    return d


def _tmax(tmp_path: Path, text: str | bytes) -> Path:
    d = tmp_path / "task"
    shutil.copytree(TMAX, d)
    (d / "task.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    return d


HARBOR_BAD = [
    ("[agent]\ntimeout_sec = inf\n", "task.toml: agent.timeout_sec must be a finite number > 0, got inf"),
    ("[agent]\ntimeout_sec = nan\n", "task.toml: agent.timeout_sec must be a finite number > 0, got nan"),
    ("[agent]\ntimeout_sec = -inf\n", "agent.timeout_sec must be a finite number > 0, got -inf"),
    ("[agent]\ntimeout_sec = 1e400\n", "agent.timeout_sec must be a finite number > 0, got inf"),
    ("[agent]\ntimeout_sec = 'inf'\n", "agent.timeout_sec must be a finite number > 0, got inf"),
    ("[agent]\ntimeout_sec = 0\n", "agent.timeout_sec must be a finite number > 0, got 0"),
    ("[agent]\ntimeout = -5\n", "agent.timeout must be a finite number > 0, got -5"),
    ("[agent]\ntimeout_sec = 1e9\n", f"agent.timeout_sec must be at most {MAX_TIMEOUT_S:g}, got 1e+09"),
    ("[agent]\ntimeout_sec = true\n", "agent.timeout_sec: expected a number, got True"),
    (
        "[verifier]\ntimeout_sec = inf\n",
        "task.toml: verifier.timeout_sec must be a finite number > 0, got inf",
    ),
    ("[verifier]\ntimeout_sec = nan\n", "verifier.timeout_sec must be a finite number > 0, got nan"),
    ("max_test_timeout_sec = nan\n", "task.toml: max_test_timeout_sec must be a finite number > 0, got nan"),
    ("max_agent_timeout_sec = inf\n", "task.toml: max_agent_timeout_sec must be a finite number > 0"),
    (
        "[environment]\nbuild_timeout_sec = inf\n",
        "task.toml: environment.build_timeout_sec must be a finite number > 0, got inf",
    ),
    ("[environment]\ncpus = 0.001\n", "task.toml: environment.cpus must be at least 0.01"),
    ("[environment]\ncpus = 0\n", "environment.cpus must be a finite number > 0, got 0"),
    ("[environment]\ncpus = -1\n", "environment.cpus must be a finite number > 0, got -1"),
    ("[environment]\ncpus = nan\n", "environment.cpus must be a finite number > 0, got nan"),
    ("[environment]\ncpus = 1000\n", "environment.cpus must be at most 256, got 1000"),
    ("[environment]\ncpu = inf\n", "environment.cpu must be a finite number > 0, got inf"),
    ("[environment]\nmemory = inf\n", "environment.memory must be a finite size > 0, got inf"),
    ("[environment]\nmemory = nan\n", "environment.memory must be a finite size > 0, got nan"),
    ("[environment]\nmemory = 0\n", "environment.memory must be a finite size > 0, got 0"),
    ("[environment]\nmemory = -2048\n", "environment.memory must be a finite size > 0, got -2048"),
    ("[environment]\nmemory = 0.5\n", "environment.memory: size 0.5 is below 16 MB"),
    ("[environment]\nmemory = '8M'\n", "environment.memory: size '8M' is below 16 MB"),
    ("[environment]\nmemory = '2T'\n", "environment.memory: size '2T' is above the maximum of 1048576 MB"),
    ("[environment]\nmemory_mb = 1e300\n", "environment.memory_mb: size 1e+300 is above the maximum"),
    ("[environment]\nmemory = '" + "9" * 400 + "G'\n", "environment.memory: size"),
    ("[environment]\nstorage = '0.5K'\n", "environment.storage: size '0.5K' is below 1 MB"),
    ("[environment]\nstorage = '99999T'\n", "environment.storage: size '99999T' is above the maximum"),
    ("[environment]\nstorage_mb = inf\n", "environment.storage_mb must be a finite size > 0, got inf"),
    ("[environment]\nallow_internet = 1\n", "environment.allow_internet: expected true/false"),
    (b"[agent]\ntimeout_sec = 1 # \xff\n", "task.toml: not UTF-8 text"),
]


@pytest.mark.parametrize("toml, match", HARBOR_BAD)
def test_harbor_limits_refused_with_file_and_field(tmp_path, toml, match):
    d = _harbor(tmp_path, toml)
    with pytest.raises(TaskFormatError) as e:
        load_task(d)
    assert match in str(e.value)
    assert str(d / "task.toml") in str(e.value)


def test_harbor_instruction_not_utf8(tmp_path):
    d = _harbor(tmp_path, "")
    (d / "instruction.md").write_bytes(b"sum the \xff column")
    with pytest.raises(TaskFormatError, match="instruction.md: not UTF-8 text"):
        load_task(d)


def test_harbor_limits_at_the_bounds_load_and_become_a_sandbox_config(tmp_path):
    d = _harbor(
        tmp_path,
        f"[agent]\ntimeout_sec = {MAX_TIMEOUT_S}\n[verifier]\ntimeout_sec = '{MAX_TIMEOUT_S}'\n"
        "[environment]\ncpus = 0.01\nmemory = '1T'\nstorage = '16T'\nbuild_timeout_sec = 0.5\n",
    )
    lim = load_task(d).limits
    assert (lim.agent_timeout_s, lim.verifier_timeout_s, lim.build_timeout_s) == (
        MAX_TIMEOUT_S,
        MAX_TIMEOUT_S,
        0.5,
    )
    assert (lim.cpus, lim.memory_mb, lim.storage_mb) == (0.01, 1 << 20, 1 << 24)
    # Every limit a task may ask for is one the sandbox accepts (the runner converts them outside
    # its error handling): the episode budget agent + verifier + 120 s included.
    scfg = sandbox_config_for(load_task(d), SandboxConfig())
    assert scfg.episode_timeout_s == 2 * MAX_TIMEOUT_S + 120.0 <= MAX_SANDBOX_TIMEOUT_S
    assert (scfg.cpus, scfg.memory_mb, scfg.disk_mb) == (0.01, 1 << 20, 1 << 24)


TMAX_BAD = [
    (
        '{"limits": {"agent_timeout_sec": NaN}}',
        "task.json: limits.agent_timeout_sec must be a finite number > 0, got nan",
    ),
    (
        '{"limits": {"verifier_timeout_sec": Infinity}}',
        "limits.verifier_timeout_sec must be a finite number > 0, got inf",
    ),
    (
        '{"limits": {"build_timeout_sec": 1e400}}',
        "limits.build_timeout_sec must be a finite number > 0, got inf",
    ),
    (
        '{"limits": {"agent_timeout_sec": "nan"}}',
        "limits.agent_timeout_sec must be a finite number > 0, got nan",
    ),
    (
        '{"limits": {"agent_timeout_sec": 1' + "0" * 400 + "}}",
        "limits.agent_timeout_sec must be a finite number",
    ),
    ('{"limits": {"cpus": 0.001}}', "task.json: limits.cpus must be at least 0.01"),
    ('{"limits": {"cpus": 512}}', "limits.cpus must be at most 256, got 512"),
    ('{"limits": {"cpus": false}}', "limits.cpus: expected a number, got False"),
    ('{"limits": {"memory": Infinity}}', "limits.memory must be a finite size > 0, got inf"),
    ('{"limits": {"memory": 1e400}}', "limits.memory must be a finite size > 0, got inf"),
    ('{"limits": {"memory": "4M"}}', "limits.memory: size '4M' is below 16 MB"),
    ('{"limits": {"storage": -1}}', "limits.storage must be a finite size > 0, got -1"),
    (
        '{"limits": {"storage": 1' + "0" * 400 + "}}",
        "limits.storage: size 1000000000000000000000000000000000000000... is above",
    ),
    ('{"limits": {"storage": null}}', "limits.storage: expected a size like '2G', got NoneType"),
    ("[" * 100_000, "task.json: not valid JSON"),
    (b'{"prompt": "\xff"}', "task.json: not UTF-8 text"),
]


@pytest.mark.parametrize("text, match", TMAX_BAD)
def test_tmax_limits_refused_with_file_and_field(tmp_path, text, match):
    if isinstance(text, str) and text.startswith("{"):
        text = '{"prompt": "p", ' + text[1:]
    d = _tmax(tmp_path, text)
    with pytest.raises(TaskFormatError) as e:
        load_task(d)
    assert match in str(e.value)
    assert str(d / "task.json") in str(e.value)


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"agent_timeout_s": math.inf}, "task limits: agent_timeout_s must be a finite number > 0, got inf"),
        (
            {"verifier_timeout_s": math.nan},
            "task limits: verifier_timeout_s must be a finite number > 0, got nan",
        ),
        ({"build_timeout_s": -1.0}, "task limits: build_timeout_s must be a finite number > 0"),
        ({"cpus": 0.001}, "task limits: cpus must be at least 0.01"),
        ({"memory_mb": 0}, "task limits: memory_mb must be a finite size > 0"),
        ({"storage_mb": math.inf}, "task limits: storage_mb must be a finite size > 0, got inf"),
        ({"allow_internet": "yes"}, "task limits: allow_internet must be true/false"),
    ],
)
def test_task_limits_built_in_code_are_validated_too(kw, match):
    with pytest.raises(TaskFormatError) as e:
        TaskLimits(**kw)
    assert match in str(e.value)


def test_default_task_limits_and_numeric_strings():
    assert TaskLimits() == TaskLimits(900.0, 600.0, 600.0, 1.0, 2048, 4096, False)
    lim = TaskLimits(agent_timeout_s="30", memory_mb=64.9)  # a task file's "30"; MB as a float
    assert (lim.agent_timeout_s, lim.memory_mb) == (30.0, 64)


@pytest.mark.parametrize(
    "field, value, match",
    [
        (
            "episode_timeout_s",
            math.inf,
            "sandbox.episode_timeout_s must be a finite number > 0 and <= 2592000, got inf",
        ),
        ("episode_timeout_s", math.nan, "sandbox.episode_timeout_s must be a finite number > 0"),
        ("episode_timeout_s", 0.0, "sandbox.episode_timeout_s must be a finite number > 0"),
        (
            "episode_timeout_s",
            1e12,
            "sandbox.episode_timeout_s must be a finite number > 0 and <= 2592000, got 1000000000000",
        ),
        ("exec_timeout_s", math.nan, "sandbox.exec_timeout_s must be a finite number > 0"),
        ("exec_timeout_s", -1, "sandbox.exec_timeout_s must be a finite number > 0"),
        ("exec_timeout_s", "60", "sandbox.exec_timeout_s must be a number, got '60'"),
        ("cpus", 0.001, "sandbox.cpus must be a finite number >= 0.01 and <= 256, got 0.001"),
        ("cpus", math.nan, "sandbox.cpus must be a finite number >= 0.01"),
        ("cpus", 1e6, "sandbox.cpus must be a finite number >= 0.01 and <= 256"),
        ("cpus", True, "sandbox.cpus must be a number, got True"),
        ("memory_mb", 0, "sandbox.memory_mb must be in [1, 1048576], got 0"),
        ("memory_mb", 512.0, "sandbox.memory_mb must be an integer, got 512.0"),
        ("memory_mb", 1 << 40, "sandbox.memory_mb must be in [1, 1048576]"),
        ("disk_mb", -1, "sandbox.disk_mb must be in [1, "),
        ("pids_max", True, "sandbox.pids_max must be an integer, got True"),
        ("nofile", 1 << 30, "sandbox.nofile must be in [1, 1048576]"),
        ("max_output_bytes", 0, "sandbox.max_output_bytes must be in [1, "),
    ],
)
def test_sandbox_config_values_refused_naming_the_field(field, value, match):
    with pytest.raises(ConfigError) as e:
        SandboxConfig(**{field: value})
    assert match in str(e.value)
    # dataclasses.replace (how task limits are applied) goes through the same check.
    with pytest.raises(ConfigError):
        dataclasses.replace(SandboxConfig(), **{field: value})


def test_sandbox_config_from_yaml_override_refuses_inf():
    from tmax_jax.config import override

    with pytest.raises(ConfigError, match="episode_timeout_s must be a finite number"):
        override(SandboxConfig(), {"episode_timeout_s": float("inf")})


def test_cfs_quota_is_floored_to_the_kernel_minimum():
    assert cgroup.cfs_quota_us(1.0) == 100_000
    assert cgroup.cfs_quota_us(2.5) == 250_000
    assert cgroup.cfs_quota_us(0.01) == 1000
    assert cgroup.cfs_quota_us(0.001) == 1000
    assert cgroup.cfs_quota_us(1e-12) == 1000
    for bad in (0, -1.0, math.nan, math.inf, True):
        with pytest.raises(ConfigError, match="sandbox.cpus must be a finite number > 0"):
            cgroup.cfs_quota_us(bad)


@pytest.mark.skipif(not cgroup.available(), reason="no writable cgroup hierarchy (pids/memory/cpu) here")
def test_tiny_cpu_share_makes_a_real_cgroup_instead_of_an_oserror():
    cg = cgroup.Cgroup(f"test-cpus-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        cg.create(pids_max=16, memory_mb=64, cpus=0.001)  # the kernel says EINVAL to a 100 us quota
        if cg.mode == "v1":
            quota = (cg.dirs[2] / "cpu.cfs_quota_us").read_text().split()
            period = (cg.dirs[2] / "cpu.cfs_period_us").read_text().split()
            assert (quota, period) == (["1000"], ["100000"])
        else:
            assert (cg.dirs[0] / "cpu.max").read_text().split() == ["1000", "100000"]
    finally:
        cg.kill_all()
        cg.remove()
    assert not any(d.exists() for d in cg.dirs)


def test_sandbox_config_accepts_numpy_numbers():
    import numpy as np

    c = SandboxConfig(pids_max=np.int64(64), cpus=np.float32(0.5), episode_timeout_s=np.float64(10))
    assert (c.pids_max, c.cpus, c.episode_timeout_s) == (64, 0.5, 10.0)
    lim = TaskLimits(cpus=np.float32(2.0), memory_mb=np.int64(64))
    assert (lim.cpus, lim.memory_mb) == (2.0, 64)
