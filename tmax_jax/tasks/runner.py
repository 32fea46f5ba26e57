"""Run one task end to end: environment, initial-state test, agent (or oracle), verifier -> reward.

Harbor order: the agent works first; then ``tests/test.sh`` runs through ``Sandbox.run_verifier``
over the agent's files, with ``/tests``, ``/logs/verifier`` and its scratch dirs in the verifier's
own mount namespace and its processes out of the agent's sight, so nothing the agent runs can read
the tests or write the reward. ``SandboxConfig.verifier_mode``: ``strict`` (the default) stops the
agent's processes first and gives the verifier a network of its own; ``harbor`` (and a task that
declares ``agent_services``) keeps them running on the agent's network, as under Harbor. The reward is
``/logs/verifier/reward.txt`` or ``reward.json`` under the contract of ``tasks/reward.py``. TMAX: the
initial-state test runs before the agent (a failure means a broken task: reward 0), and the verifier
is ``pytest test_final_state.py`` (reward 1 when it passes, or the graded reward it writes).

``run_task`` never raises for what an agent or a task does: every failure is a reward of 0 with its
reason, so one bad episode cannot stop a training run.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from tmax_jax.errors import SandboxError, TaskFormatError, TmaxError
from tmax_jax.sandbox import make_sandbox
from tmax_jax.sandbox.base import EpisodeTimeout, Sandbox
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.shell import ShellSession
from tmax_jax.tasks.environment import environment_notes, prepare_image, sandbox_config_for
from tmax_jax.tasks.model import Task
from tmax_jax.tasks.reward import parse_reward

AgentFn = Callable[[Task, ShellSession], Any]
PYTEST = ("python3", "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider")
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
    # Everything the verifier wrote under /logs/verifier (name -> bytes): evidence for the attempt
    # dir, listed by name only in to_json.
    verifier_files: dict[str, bytes] = field(default_factory=dict)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("agent_output")
        d["verifier_files"] = sorted(self.verifier_files)
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
    files: dict[str, bytes] = {}  # filled by the verifier (issue 16: keep the evidence)
    notes = environment_notes(task)  # e.g. the base image's Python differs from the sandbox's
    if task.limits.allow_internet and not cfg.network:
        notes.append("task.toml allows the internet; this run is offline")

    def result(reward: float, reason: str, log: str = "", out=None) -> TaskResult:
        if notes:
            reason = f"{reason} [note: {'; '.join(notes)}]"
        return TaskResult(
            task.name,
            reward,
            reward >= 1.0,
            reason,
            time.monotonic() - t0,
            log[-LOG_CAP:],
            phases,
            out,
            files,
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
            return _episode(task, sb, agent, phases, result, files)
    except EpisodeTimeout as e:
        return result(0.0, f"episode timeout: {e}")
    except TmaxError as e:
        return result(0.0, f"sandbox error: {e}")
    except _AgentRaised as e:
        raise e.original from None
    except Exception as e:  # noqa: BLE001 - whatever an episode does, the run goes on with a 0
        return result(0.0, f"episode failed: {type(e).__name__}: {e}", traceback.format_exc())


class _AgentRaised(Exception):
    """An exception of the caller's own agent code (the policy, the engine): it is the caller's to
    handle, never turned into a reward of 0 that would hide a trainer bug."""

    def __init__(self, original: BaseException):
        super().__init__(str(original))
        self.original = original


def initial_state(task: Task, sb: Sandbox) -> tuple[bool, str, str]:
    """Run the TMAX initial-state test (if any): (ok, reason, log). The test file is removed after."""
    if task.initial_test is None:
        return True, "no initial-state test", ""
    with _tests_dir(task.initial_test, "test_initial_state.py") as d:
        vr = sb.run_verifier(
            d, [*PYTEST, "/tests/test_initial_state.py"], timeout=task.limits.verifier_timeout_s, private=True
        )
    res = vr.result
    if res.ok:
        return True, "ok", res.output
    return False, "initial-state test timeout" if res.timed_out else "initial-state test failed", res.output


class _tests_dir:
    """A temporary host dir holding one test file under ``name`` (the TMAX layout's tests)."""

    def __init__(self, src, name: str):
        self.src, self.name = src, name

    def __enter__(self):
        self.dir = tempfile.mkdtemp(prefix="tmax-tests-")
        shutil.copy(self.src, f"{self.dir}/{self.name}")
        return self.dir

    def __exit__(self, *exc):
        shutil.rmtree(self.dir, ignore_errors=True)


def run_oracle(task: Task, sb: Sandbox):
    """Upload the reference solution to /solution and run it in a shell; returns its ExecResult."""
    if task.solution is None:
        raise TaskFormatError(f"{task.path}: no reference solution (solution/solve.sh or solutions/solve.sh)")
    sb.upload(task.solution.parent, "/solution")
    with sb.shell(env=task.solution_env) as sh:
        return sh.run(f"bash /solution/{task.solution.name}", timeout=task.limits.agent_timeout_s)


def verify(task: Task, sb: Sandbox, files: dict[str, bytes] | None = None) -> tuple[float, str, str]:
    """Copy the tests in fresh and run the verifier: (reward, reason, log); a verifier that hangs or
    cannot run gives reward 0 with the reason. ``files`` receives what it wrote under /logs/verifier."""
    try:
        return _verify(task, sb, files)
    except EpisodeTimeout:
        return 0.0, "verifier timeout", ""
    except SandboxError as e:
        return 0.0, f"verifier could not run: {e}", ""


def _episode(task: Task, sb: Sandbox, agent, phases, result, files=None) -> TaskResult:
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
            sh = sb.shell(env=task.agent_env)
            try:
                agent_out = agent(task, sh)
            except EpisodeTimeout:
                agent_note = "agent timeout"
            except TmaxError:
                raise
            except Exception as e:
                raise _AgentRaised(e) from e
        elif agent is not None:
            raise TaskFormatError(f"agent must be 'oracle', a callable or None, got {agent!r}")
    except EpisodeTimeout:
        agent_note = "agent timeout"
    phases["agent"] = time.monotonic() - t

    # The verifier gets its own time budget, whatever the agent used.
    sb.deadline = time.monotonic() + lim.verifier_timeout_s + 60.0
    t = time.monotonic()
    reward, reason, log = verify(task, sb, files)
    phases["verifier"] = time.monotonic() - t
    if agent_note and reason == "ok":
        reason = f"ok ({agent_note})"
    elif agent_note:
        reason = f"{reason}; {agent_note}"
    return result(reward, reason, log, agent_out)


def _verify(task: Task, sb: Sandbox, files: dict[str, bytes] | None = None) -> tuple[float, str, str]:
    lim = task.limits
    if task.format == "harbor":
        vr = sb.run_verifier(
            task.tests_dir,
            ["/bin/bash", "/tests/test.sh"],
            timeout=lim.verifier_timeout_s,
            env=task.verifier_env,
        )
    else:
        with _tests_dir(task.final_test, "test_final_state.py") as d:
            # TMAX graders run the agent's code as an unprivileged user: /tests is not theirs to read.
            vr = sb.run_verifier(
                d, [*PYTEST, "/tests/test_final_state.py"], timeout=lim.verifier_timeout_s, private=True
            )
    if files is not None:
        files.update(vr.logs)
    res = vr.result
    log = res.output
    if vr.tampered:
        return 0.0, f"verifier tampered with: {vr.tampered}", log
    if res.timed_out:
        return 0.0, "verifier timeout", log
    reading = parse_reward(vr.logs)
    if reading.error:
        return 0.0, f"invalid reward: {reading.error}", log
    if reading.value is None:
        if task.format == "harbor":
            return 0.0, f"verifier wrote no reward (test.sh exit {res.exit_code})", log
        reward = 1.0 if res.exit_code == 0 else 0.0
    else:
        reward = reading.value
    if reward > 0.0 and (vr.suspect or 128 < res.exit_code <= 128 + 64):
        # The session the reward rests on was ended from inside, or the shell that would have
        # written 0 was killed (by code the tests ran: ``sandbox/verifier_guard.py``).
        why = vr.suspect or f"the verifier was killed by signal {res.exit_code - 128} (exit {res.exit_code})"
        return 0.0, f"reward not trusted: {why}", log
    reason = "ok" if reward >= 1.0 else "verifier failed"
    return reward, f"{reason} ({reading.note})" if reading.note else reason, log
