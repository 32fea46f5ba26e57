"""Run one task end to end: environment, initial-state test, agent (or oracle), verifier -> reward.

Harbor order: the agent works first; only then are the task's tests copied to /tests (replacing
whatever the agent left there) and ``/logs/verifier`` emptied, and ``tests/test.sh`` runs; the reward
is read from ``/logs/verifier/reward.txt`` (a number) or ``reward.json``. TMAX: the initial-state test
runs before the agent (a failure means a broken task: reward 0), and the verifier is
``pytest test_final_state.py`` (reward 1 when it passes, or the graded reward it writes).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tmax_jax.errors import SandboxError, TaskFormatError, TmaxError
from tmax_jax.sandbox import make_sandbox
from tmax_jax.sandbox.base import EpisodeTimeout, Sandbox
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.shell import ShellSession
from tmax_jax.tasks.environment import prepare_image, sandbox_config_for
from tmax_jax.tasks.model import Task

AgentFn = Callable[[Task, ShellSession], Any]
PYTEST = "python3 -m pytest -q -rA -p no:cacheprovider"
LOG_CAP = 64 << 10


@dataclass
class TaskResult:
    task: str
    reward: float
    passed: bool
    reason: str
    duration_s: float
    verifier_log: str = ""
    phases_s: dict[str, float] = field(default_factory=dict)
    agent_output: Any = None

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("agent_output")
        return d


def run_task(
    task: Task,
    agent: AgentFn | str | None = None,
    cfg: SandboxConfig | None = None,
    *,
    image=None,
    pool=None,
) -> TaskResult:
    """Run ``task`` in a fresh sandbox and grade it.

    agent: ``"oracle"`` runs the task's reference solution; a callable ``agent(task, shell)`` acts
    through the persistent shell (its ``run`` calls stop at the task's agent timeout); None does
    nothing (the no-op baseline). Bad tasks and verifier failures give reward 0 with a reason;
    they never raise. ``pool``: a ``SandboxPool`` whose slot, metrics and cleanup to use.
    """
    t0 = time.monotonic()
    cfg = cfg or (pool.cfg if pool is not None else SandboxConfig())
    phases: dict[str, float] = {}

    def result(reward: float, reason: str, log: str = "", out=None) -> TaskResult:
        return TaskResult(
            task.name, reward, reward >= 1.0, reason, time.monotonic() - t0, log[-LOG_CAP:], phases, out
        )

    try:
        t = time.monotonic()
        if image is None:
            image = prepare_image(task, cfg)
        phases["build"] = time.monotonic() - t
    except TmaxError as e:
        return result(0.0, f"environment build failed: {e}")
    scfg = sandbox_config_for(task, cfg)
    try:
        if pool is not None:
            ctx = pool.sandbox(image=image, cfg=scfg)
        else:
            ctx = make_sandbox(scfg, image=image)
        with ctx as sb:
            return _episode(task, sb, agent, phases, result)
    except EpisodeTimeout as e:
        return result(0.0, f"episode timeout: {e}")
    except TmaxError as e:
        return result(0.0, f"sandbox error: {e}")


def initial_state(task: Task, sb: Sandbox) -> tuple[bool, str, str]:
    """Run the TMAX initial-state test (if any): (ok, reason, log). The test file is removed after."""
    if task.initial_test is None:
        return True, "no initial-state test", ""
    sb.upload(task.initial_test, "/tmp/tmax-initial/test_initial_state.py")
    res = sb.exec(f"{PYTEST} /tmp/tmax-initial/test_initial_state.py", timeout=task.limits.verifier_timeout_s)
    sb.exec("rm -rf /tmp/tmax-initial")
    if res.ok:
        return True, "ok", res.output
    return False, "initial-state test timeout" if res.timed_out else "initial-state test failed", res.output


def run_oracle(task: Task, sb: Sandbox):
    """Upload the reference solution to /solution and run it in a shell; returns its ExecResult."""
    if task.solution is None:
        raise TaskFormatError(f"{task.path}: no reference solution (solution/solve.sh or solutions/solve.sh)")
    sb.upload(task.solution.parent, "/solution")
    with sb.shell() as sh:
        return sh.run(f"bash /solution/{task.solution.name}", timeout=task.limits.agent_timeout_s)


def verify(task: Task, sb: Sandbox) -> tuple[float, str, str]:
    """Copy the tests in fresh and run the verifier: (reward, reason, log); a verifier that hangs or
    cannot run gives reward 0 with the reason."""
    try:
        return _verify(task, sb)
    except EpisodeTimeout:
        return 0.0, "verifier timeout", ""
    except SandboxError as e:
        return 0.0, f"verifier could not run: {e}", ""


def _episode(task: Task, sb: Sandbox, agent, phases, result) -> TaskResult:
    lim = task.limits
    if task.initial_test is not None:
        t = time.monotonic()
        ok, why, log = initial_state(task, sb)
        phases["initial_test"] = time.monotonic() - t
        if not ok:
            return result(0.0, why, log)

    t = time.monotonic()
    agent_out, agent_note = None, ""
    sb.deadline = time.monotonic() + lim.agent_timeout_s
    try:
        if agent == "oracle":
            res = run_oracle(task, sb)
            agent_out = res
            if res.timed_out:
                agent_note = "agent timeout"
        elif callable(agent):
            sh = sb.shell()
            try:
                agent_out = agent(task, sh)
            except EpisodeTimeout:
                agent_note = "agent timeout"
        elif agent is not None:
            raise TaskFormatError(f"agent must be 'oracle', a callable or None, got {agent!r}")
    except EpisodeTimeout:
        agent_note = "agent timeout"
    phases["agent"] = time.monotonic() - t

    # The verifier gets its own time budget, whatever the agent used.
    sb.deadline = time.monotonic() + lim.verifier_timeout_s + 60.0
    t = time.monotonic()
    reward, reason, log = verify(task, sb)
    phases["verifier"] = time.monotonic() - t
    if agent_note and reason == "ok":
        reason = f"ok ({agent_note})"
    elif agent_note:
        reason = f"{reason}; {agent_note}"
    return result(reward, reason, log, agent_out)


def _verify(task: Task, sb: Sandbox) -> tuple[float, str, str]:
    lim = task.limits
    # Replace anything the agent put in /tests or /logs/verifier (e.g. a fake reward file).
    sb.exec("rm -rf /tests /logs/verifier; mkdir -p /tests /logs/verifier", cwd="/")
    if task.format == "harbor":
        sb.upload(task.tests_dir, "/tests")
        res = sb.exec("bash /tests/test.sh", timeout=lim.verifier_timeout_s)
        log = res.output
        if res.timed_out:
            return 0.0, "verifier timeout", log
        reward = _read_reward(sb)
        if reward is None:
            return 0.0, f"verifier wrote no reward (test.sh exit {res.exit_code})", log
    else:
        sb.upload(task.final_test, "/tests/test_final_state.py")
        res = sb.exec(f"{PYTEST} /tests/test_final_state.py", timeout=lim.verifier_timeout_s)
        log = res.output
        if res.timed_out:
            return 0.0, "verifier timeout", log
        reward = _read_reward(sb)
        if reward is None:
            reward = 1.0 if res.exit_code == 0 else 0.0
    if isinstance(reward, str):
        return 0.0, reward, log
    return reward, "ok" if reward >= 1.0 else "verifier failed", log


def _read_reward(sb: Sandbox) -> float | str | None:
    """The verifier's reward, None when it wrote none, or a string saying why it is unreadable."""
    for name in ("reward.txt", "reward.json"):
        try:
            raw = sb.read_file(f"/logs/verifier/{name}", max_bytes=1 << 20).decode(errors="replace").strip()
        except SandboxError:
            continue
        try:
            if name == "reward.txt":
                value = float(raw.split()[0]) if raw else float("nan")
            else:
                data = json.loads(raw)
                value = float(data["reward"] if isinstance(data, dict) else data)
        except (ValueError, KeyError, TypeError, IndexError):
            return f"unreadable {name}: {raw[:200]!r}"
        if not math.isfinite(value):
            return f"unreadable {name}: {raw[:200]!r}"
        return value
    return None
