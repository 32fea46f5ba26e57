"""Harbor / Terminal-Bench 2.0 task directories.

    instruction.md  task.toml  environment/Dockerfile  tests/test.sh (+ tests/*)  solution/solve.sh

task.toml: ``[metadata]``, ``[verifier] timeout_sec``, ``[agent] timeout_sec``, ``[environment]``
cpus / memory / storage / allow_internet / build_timeout_sec / docker_image; ``[verifier.env]``,
``[solution.env]``, ``[agent.env]``: environment variables (literal strings; a number or boolean is
written as TOML would print it) for the verifier, the reference solution and the agent. Older spellings are
read too: ``memory_mb``, ``storage_mb``, ``max_agent_timeout_sec``/``max_test_timeout_sec`` (top level),
``timeout`` for ``timeout_sec``, ``network``/``internet`` for ``allow_internet``.
"""

from __future__ import annotations

import re
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


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _env_table(sec: dict, name: str, where: Path) -> dict[str, str]:
    """``[<name>.env]``: NAME = value, each checked (a bad one names the key)."""
    table = sec.get("env", {})
    if not isinstance(table, dict):
        raise TaskFormatError(
            f"{where}: [{name}.env] must be a table of NAME = value, got {type(table).__name__}"
        )
    out: dict[str, str] = {}
    for k, v in table.items():
        if not _ENV_NAME.match(k):
            raise TaskFormatError(f"{where}: {name}.env: {k!r} is not an environment variable name")
        if isinstance(v, bool):
            v = "true" if v else "false"
        elif isinstance(v, (int, float)):
            v = str(v)
        elif not isinstance(v, str):
            raise TaskFormatError(
                f"{where}: {name}.env.{k} must be a string, number or boolean, got {type(v).__name__}"
            )
        if "\0" in v:
            raise TaskFormatError(f"{where}: {name}.env.{k} contains a NUL byte")
        out[k] = v
    return out


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
    envs = {
        f"{name}_env": _env_table(sec, name, toml_path)
        for name, sec in (
            ("verifier", ver),
            ("solution", _section(data, "solution", toml_path)),
            ("agent", agent),
        )
    }
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
        (ver, "verifier", ("agent_services",), "agent_services", boolean),
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
        # docker_image kept beside the Dockerfile: podman runs that prebuilt image when it is
        # local or can be pulled (tasks/environment.py), else builds the Dockerfile.
        spec = EnvironmentSpec(kind="dockerfile", path=dockerfile, image=image or None)
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
        **envs,
    )
