"""Agents the evaluation can run: the ``Agent`` protocol, the oracle and no-op baselines, a shell recorder.

An agent is called once per attempt with the task and the attempt's persistent shell inside the
task's sandbox, ``agent(task, shell)``, the same ``agent_fn`` shape the task runner accepts. It acts
only through ``shell.run(command, timeout=...)``; the verifier scores the sandbox afterwards. It may
return a trajectory (a ``tmax_jax.agent.Trajectory``, a dict, or None), which is saved per attempt.
"""

from __future__ import annotations

import json
import shlex
import threading
import time
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tmax_jax.errors import ConfigError, TaskFormatError


@runtime_checkable
class Agent(Protocol):
    name: str

    def __call__(self, task: Any, shell: Any) -> Any: ...


def task_path(task: Any) -> Path:
    """The task's directory, whether ``task`` is a loaded task object or an ``EvalTask``."""
    for attr in ("path", "root", "task_dir", "dir"):
        p = getattr(task, attr, None)
        if p is not None:
            return Path(p)
    raise TaskFormatError(f"cannot find the directory of task {task!r} (no .path attribute)")


class OracleAgent:
    """Runs the task's reference solution, ``solution/solve.sh``: a task set's ceiling (should be 1.0)."""

    name = "oracle"
    remote_dir = "/solution"

    def __init__(self, timeout_s: float = 600.0):
        self.timeout_s = timeout_s

    def __call__(self, task: Any, shell: Any) -> dict[str, Any]:
        script = getattr(task, "solution", None) or task_path(task) / "solution" / "solve.sh"
        script = Path(script)
        solution = script.parent
        if not script.is_file():
            raise TaskFormatError(f"{task_path(task)}: no solution/solve.sh for the oracle agent")
        sandbox = getattr(shell, "sandbox", None)
        if sandbox is not None and hasattr(sandbox, "upload"):
            # solve.sh may read files next to it (data, helper scripts): ship the whole directory.
            sandbox.upload(solution, self.remote_dir)
            command = f"bash {self.remote_dir}/{script.name}"
        else:
            body = script.read_text()
            command = f"bash <<'TMAX_ORACLE_EOF'\n{body}\nTMAX_ORACLE_EOF"
        # task.toml [solution.env]: set for the solution only (a prefix assignment, so nothing stays
        # exported in the shell).
        env = getattr(task, "solution_env", None) or {}
        if env:
            command = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()) + " " + command
        res = shell.run(command, timeout=self.timeout_s)
        return {
            "agent": self.name,
            "steps": [{"command": command, "exit_code": getattr(res, "exit_code", None)}],
        }


class NoopAgent:
    """Does nothing: the floor of a task set (should be 0.0; a task it passes has a broken verifier)."""

    name = "noop"

    def __call__(self, task: Any, shell: Any) -> None:
        return None


BUILTIN_AGENTS = {"oracle": OracleAgent, "noop": NoopAgent}


def builtin_agent(name: str) -> Agent:
    if name not in BUILTIN_AGENTS:
        raise ConfigError(f"unknown agent {name!r} (built in: {sorted(BUILTIN_AGENTS)})")
    return BUILTIN_AGENTS[name]()


class RecordingShell:
    """Wraps the attempt's shell and appends every command and its output to the attempt log."""

    def __init__(self, shell: Any, log_path: str | Path):
        self._shell = shell
        self.log_path = Path(log_path)
        self._lock = threading.Lock()
        self.commands = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._shell, name)

    def run(self, command: str, timeout: float | None = None, **kw: Any) -> Any:
        t0 = time.monotonic()
        res = self._shell.run(command, timeout=timeout, **kw)
        output = getattr(res, "output", None)
        if output is None:
            output = getattr(res, "stdout", str(res))
        entry = {
            "command": command,
            "exit_code": getattr(res, "exit_code", None),
            "timed_out": bool(getattr(res, "timed_out", False)),
            "duration_s": round(time.monotonic() - t0, 3),
            "output": output,
        }
        with self._lock:
            self.commands += 1
            with open(self.log_path, "a") as f:
                f.write(json.dumps(entry) + "\n")
        return res
