"""Harbor / Terminal-Bench 2.0 task directories.

    instruction.md  task.toml  environment/Dockerfile  tests/test.sh (+ tests/*)  solution/solve.sh

task.toml: ``[metadata]``, ``[verifier] timeout_sec``, ``[agent] timeout_sec``, ``[environment]``
cpus / memory / storage / allow_internet / build_timeout_sec / docker_image. Older spellings are
read too: ``memory_mb``, ``storage_mb``, ``max_agent_timeout_sec``/``max_test_timeout_sec`` (top level),
``timeout`` for ``timeout_sec``, ``network``/``internet`` for ``allow_internet``.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from tmax_jax.errors import TaskFormatError
from tmax_jax.tasks.model import (
    EnvironmentSpec,
    Task,
    TaskLimits,
    boolean,
    cpu_count,
    memory_mb,
    read_text,
    storage_mb,
    timeout_s,
)


def is_harbor(path: Path) -> bool:
    return (path / "task.toml").is_file() or (
        (path / "instruction.md").is_file() and (path / "tests").is_dir()
    )


def _section(data: dict, name: str, where: Path) -> dict:
    sec = data.get(name, {})
    if not isinstance(sec, dict):
        raise TaskFormatError(f"{where}: [{name}] must be a table, got {type(sec).__name__}")
    return sec


def _first(sec: dict, keys: tuple[str, ...]) -> tuple[str, Any] | None:
    for k in keys:
        if k in sec:
            return k, sec[k]
    return None


def load_harbor(path: Path) -> Task:
    path = Path(path)
    toml_path = path / "task.toml"
    if not toml_path.is_file():
        raise TaskFormatError(
            f"{path}: missing task.toml (Harbor layout needs instruction.md, task.toml, tests/test.sh)"
        )
    try:
        data = tomllib.loads(read_text(toml_path))
    except tomllib.TOMLDecodeError as e:
        raise TaskFormatError(f"{toml_path}: not valid TOML: {e}") from e
    instr_path = path / "instruction.md"
    if not instr_path.is_file():
        raise TaskFormatError(f"{path}: missing instruction.md")
    instruction = read_text(instr_path).strip()
    if not instruction:
        raise TaskFormatError(f"{instr_path}: instruction is empty")
    tests = path / "tests"
    if not (tests / "test.sh").is_file():
        raise TaskFormatError(f"{path}: missing tests/test.sh (the verifier)")

    meta = _section(data, "metadata", toml_path)
    ver = _section(data, "verifier", toml_path)
    agent = _section(data, "agent", toml_path)
    env = _section(data, "environment", toml_path)
    limits: dict[str, Any] = {}
    w = f"{toml_path}"
    # (section, its name in messages, keys in order of preference, TaskLimits field, validator)
    fields = (
        (ver, "verifier", ("timeout_sec", "timeout"), "verifier_timeout_s", timeout_s),
        (data, "", ("max_test_timeout_sec",), "verifier_timeout_s", timeout_s),
        (agent, "agent", ("timeout_sec", "timeout"), "agent_timeout_s", timeout_s),
        (data, "", ("max_agent_timeout_sec",), "agent_timeout_s", timeout_s),
        (env, "environment", ("build_timeout_sec", "build_timeout"), "build_timeout_s", timeout_s),
        (env, "environment", ("cpus", "cpu"), "cpus", cpu_count),
        (env, "environment", ("memory", "memory_mb", "memory_limit"), "memory_mb", memory_mb),
        (env, "environment", ("storage", "storage_mb", "disk"), "storage_mb", storage_mb),
        (env, "environment", ("allow_internet", "network", "internet"), "allow_internet", boolean),
    )
    for sec, sec_name, keys, dest, check in fields:
        if dest in limits or not (kv := _first(sec, keys)):
            continue
        limits[dest] = check(kv[1], f"{w}: {sec_name + '.' if sec_name else ''}{kv[0]}")

    dockerfile = path / "environment" / "Dockerfile"
    image = env.get("docker_image") or env.get("image")
    if image is not None and not isinstance(image, str):
        raise TaskFormatError(f"{w}: environment.docker_image must be a string")
    if dockerfile.is_file():
        spec = EnvironmentSpec(kind="dockerfile", path=dockerfile)
    elif image:
        spec = EnvironmentSpec(kind="image", image=image)
    elif (path / "environment" / "docker-compose.yaml").is_file():
        raise TaskFormatError(
            f"{path}: environment/docker-compose.yaml (multi-container) is not supported; give a Dockerfile"
        )
    else:
        raise TaskFormatError(
            f"{path}: no environment/Dockerfile and no [environment] docker_image in task.toml"
        )
    solution = path / "solution" / "solve.sh"
    return Task(
        name=str(meta.get("name") or path.name),
        path=path,
        format="harbor",
        instruction=instruction,
        limits=TaskLimits(**limits),
        environment=spec,
        tests_dir=tests,
        solution=solution if solution.is_file() else None,
        metadata=dict(meta),
    )
