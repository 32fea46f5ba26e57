"""Rollout workers: episodes of the agent in sandboxes, driven by the engine's orchestrator.

Each episode is one thread (blocking on the sandbox and on its engine session); the orchestrator
batches the decode steps of all live episodes. ``RolloutWorkers`` turns prompts into groups of
``group_size`` trajectories with verifier rewards, and evaluates pass rates on held-out tasks.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import threading
from collections import Counter
from collections.abc import Sequence

import numpy as np

from tmax_jax.agent.chat import ChatFormatter
from tmax_jax.agent.episode import AgentConfig, run_episode
from tmax_jax.agent.scripted import ScriptedPolicy
from tmax_jax.agent.trajectory import Trajectory
from tmax_jax.engine.orchestrator import Orchestrator
from tmax_jax.engine.sampling import SamplingParams, derive_seed
from tmax_jax.engine.session import EnginePolicy
from tmax_jax.sandbox.config import SandboxConfig
from tmax_jax.sandbox.pool import SandboxPool
from tmax_jax.tasks.model import Task
from tmax_jax.tasks.runner import run_task
from tmax_jax.train.queue import Group


@dataclasses.dataclass
class RolloutStats:
    episodes: int = 0
    failures: Counter = dataclasses.field(default_factory=Counter)
    generated_tokens: int = 0

    def snapshot_and_reset(self) -> dict:
        out = {
            "episodes": self.episodes,
            "episode_failures": sum(self.failures.values()),
            "generated_tokens": self.generated_tokens,
        }
        # Why episodes failed, one metric per reason (metrics.jsonl keeps what a step saw).
        out.update({f"episode_failures/{reason}": n for reason, n in sorted(self.failures.items())})
        self.episodes, self.generated_tokens = 0, 0
        self.failures = Counter()
        return out


def score_episode(traj: Trajectory, result, *, require_submit: bool) -> Trajectory:
    """Set the trajectory's reward and info from the task run's verifier ``result``. With
    ``require_submit`` an episode that ended without the submit marker (turn limit, format errors,
    context) scores 0 whatever the files say: the episode ends where the recipe ends it, and what the
    policy says after solving the task but before submitting cannot share a passing advantage."""
    reward, passed, reason = float(result.reward), bool(result.passed), result.reason
    if require_submit and traj.finish_reason != "submitted":
        reward, passed, reason = 0.0, False, f"not submitted ({traj.finish_reason}); verifier: {reason}"
    traj.reward = reward
    traj.info = {
        "reason": reason,
        "passed": passed,
        "duration_s": result.duration_s,
        "verifier_reward": float(result.reward),
    }
    return traj


class RolloutWorkers:
    def __init__(
        self,
        orchestrator: Orchestrator,
        chat: ChatFormatter,
        agent_cfg: AgentConfig,
        sandbox_cfg: SandboxConfig,
        *,
        workers: int,
        temperature: float,
        top_p: float = 1.0,
        top_k: int = 0,
        require_submit: bool = False,
    ):
        self.orch = orchestrator
        self.chat = chat
        self.agent_cfg = agent_cfg
        self.sandbox_cfg = sandbox_cfg
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.require_submit = require_submit
        self.pool = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="tmax-episode")
        self.stats = RolloutStats()
        self._lock = threading.Lock()
        self.stopping = threading.Event()

    def episode(self, task: Task, seed: int, group_id: int) -> Trajectory | None:
        """One episode with the current policy; None when the task's environment failed (not the model)."""
        if self.stopping.is_set():
            return None
        policy = EnginePolicy(
            self.orch,
            sampling=SamplingParams(
                temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=seed
            ),
            stop_token_ids=[self.chat.end_id],
        )

        def agent(task: Task, shell) -> Trajectory:
            return run_episode(
                task.instruction,
                policy,
                shell,
                self.chat,
                self.agent_cfg,
                task_id=task.name,
                group_id=group_id,
            )

        try:
            result = run_task(task, agent, self.sandbox_cfg)
        finally:
            policy.close()
        traj = result.agent_output
        with self._lock:
            self.stats.episodes += 1
            if traj is None:
                self.stats.failures[result.reason.split(":")[0]] += 1
                return None
            self.stats.generated_tokens += traj.num_generated
        score_episode(traj, result, require_submit=self.require_submit)
        return traj

    def groups(
        self, tasks: Sequence[Task], group_size: int, seed_keys: Sequence[tuple[int, ...]], group_ids
    ) -> list[Group]:
        """Run ``group_size`` episodes per task concurrently; returns one Group per task."""
        futures = {
            (t, g): self.pool.submit(self.episode, task, derive_seed(*seed_keys[t], g), group_ids[t])
            for t, task in enumerate(tasks)
            for g in range(group_size)
        }
        out = []
        for t, task in enumerate(tasks):
            trajs = [futures[(t, g)].result() for g in range(group_size)]
            out.append(Group(task.name, [tr for tr in trajs if tr is not None]))
        return out

    def pass_rate(self, tasks: Sequence[Task], samples: int, run_seed: int) -> dict:
        """Mean reward and pass rate over ``tasks x samples`` episodes with the current policy.

        With several JAX processes each runs its share of the tasks (every ``process_count``-th) on
        its own engine and the counts are summed over all of them (a collective: every process must
        call it); a task's sampling seeds do not depend on the process count.
        """
        import jax

        from tmax_jax.distributed import allgather_json

        pid, nproc = jax.process_index(), jax.process_count()
        mine = list(range(pid, len(tasks), nproc))
        groups = self.groups([tasks[i] for i in mine], samples, [(run_seed, 999_999, i) for i in mine], mine)
        trajs = [tr for g in groups for tr in g.trajectories]
        local = [
            len(trajs),
            sum(bool(tr.info["passed"]) for tr in trajs),
            sum(tr.reward for tr in trajs),
            sum(tr.num_turns for tr in trajs),
        ]
        # Per task (by index into ``tasks``): [episodes, passed], for pass rates per family and axis.
        mine_per_task = {
            str(i): [len(g.trajectories), sum(bool(tr.info["passed"]) for tr in g.trajectories)]
            for i, g in zip(mine, groups)
        }
        gathered = allgather_json([local, mine_per_task])
        episodes, passed, reward, turns = np.sum([g[0] for g in gathered], axis=0).tolist()
        per_task = [[0, 0] for _ in tasks]
        for _, share in gathered:
            for i, counts in share.items():
                per_task[int(i)] = counts
        if not episodes:
            return {"pass_rate": 0.0, "reward_mean": 0.0, "episodes": 0, "per_task": per_task}
        return {
            "pass_rate": passed / episodes,
            "reward_mean": reward / episodes,
            "episodes": int(episodes),
            "turns_mean": turns / episodes,
            "per_task": per_task,  # [episodes, passed] of each task, in the order given
        }

    def close(self) -> None:
        self.stopping.set()
        self.pool.shutdown(wait=True, cancel_futures=True)


TURN_PER_LINE = "# tmax-jax: one turn per line"


def solution_commands(script: str) -> list[str]:
    """The bash calls that replay a solution script: its body as one call, or, when the script has
    the line ``# tmax-jax: one turn per line``, each non-comment line as a call of its own (a
    multi-turn demonstration)."""
    lines = [ln for ln in script.splitlines() if ln.strip() and not ln.startswith("#!")]
    if TURN_PER_LINE in (ln.strip() for ln in lines):
        return [ln for ln in lines if not ln.lstrip().startswith("#")]
    return ["\n".join(lines)]


def demonstrations(
    tasks: Sequence[Task],
    chat: ChatFormatter,
    agent_cfg: AgentConfig,
    sandbox_cfg: SandboxConfig,
    *,
    workers: int,
) -> tuple[list[Trajectory], Counter]:
    """Replay each task's reference solution through the harness (one bash call with solve.sh's body)
    and keep the trajectories the verifier accepts: SFT data in exactly the format of RL episodes.

    Returns the demonstrations and the reasons the others were rejected.
    """
    # A demonstration is never cut by the per-turn token limit meant for sampling.
    # It keeps the context reserve of sampling: a longer reply limit must not leave an observation no room.
    demo_cfg = dataclasses.replace(
        agent_cfg,
        max_tokens_per_turn=max(agent_cfg.max_tokens_per_turn, 4096),
        context_reserve_tokens=agent_cfg.reply_reserve,
    )
    rejected: Counter = Counter()

    def one(task: Task) -> Trajectory | None:
        if task.solution is None or not task.solution.is_file():
            rejected["no solution script"] += 1
            return None
        commands = solution_commands(task.solution.read_text())
        policy = ScriptedPolicy(commands, chat, harness=agent_cfg.harness)
        # Nor by the turn limit: a multi-turn solution gets its commands and the submit.
        cfg = dataclasses.replace(demo_cfg, max_turns=max(demo_cfg.max_turns, len(commands) + 1))
        result = run_task(
            task,
            lambda t, sh: run_episode(t.instruction, policy, sh, chat, cfg, task_id=t.name),
            sandbox_cfg,
            pool=pool,
        )
        traj = result.agent_output
        if traj is None or not result.passed:
            why = result.reason if traj is None else f"verifier reward {result.reward} ({traj.finish_reason})"
            rejected[why] += 1
            return None
        traj.reward = float(result.reward)
        return traj

    # On an exception or Ctrl-C the pool drops the queued replays and kills the running ones'
    # sandboxes, so an interrupted warm start ends at once instead of replaying every task first.
    with SandboxPool(sandbox_cfg, size=workers) as pool:
        futures = [pool.submit(one, t) for t in tasks]
        demos = [t for t in (f.result() for f in futures) if t is not None]
    return demos, rejected


def pass_rates_by_group(tasks: Sequence[Task], before: dict, after: dict) -> dict:
    """Held-out pass rates before/after per family and per axis value, from two ``pass_rate`` results.

    Returns ``{"by_family": {family: {before, after, tasks}}, "by_axis": {axis: {value: {...}}}}``;
    a result without ``per_task`` (an eval written by an older version) gives ``None`` for its side.
    """
    from tmax_jax.tasks.model import task_axes, task_family

    def rates(result: dict, members: list[int]) -> float | None:
        per = result.get("per_task")
        if not per or len(per) != len(tasks):
            return None
        eps = sum(per[i][0] for i in members)
        return sum(per[i][1] for i in members) / eps if eps else None

    def entry(members: list[int]) -> dict:
        return {"before": rates(before, members), "after": rates(after, members), "tasks": len(members)}

    fams: dict[str, list[int]] = {}
    axes: dict[str, dict[str, list[int]]] = {}
    for i, t in enumerate(tasks):
        fams.setdefault(task_family(t), []).append(i)
        for axis, value in task_axes(t).items():
            axes.setdefault(axis, {}).setdefault(value, []).append(i)
    return {
        "by_family": {f: entry(m) for f, m in sorted(fams.items())},
        "by_axis": {a: {v: entry(m) for v, m in sorted(vals.items())} for a, vals in sorted(axes.items())},
    }
