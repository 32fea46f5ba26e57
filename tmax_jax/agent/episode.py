"""The multi-turn episode loop: policy <-> sandbox shell, building a token trajectory."""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol

from tmax_jax.agent.chat import ChatFormatter
from tmax_jax.agent.protocol import (
    SUBMIT_MARKER,
    FormatError,
    format_tool_result,
    is_submit,
    parse_tool_calls,
)
from tmax_jax.agent.terminus import parse_terminus_reply
from tmax_jax.agent.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    harness: Literal["bash", "terminus"] = "bash"
    max_turns: int = 64
    max_tokens_per_turn: int = 2048
    max_context_tokens: int = 65536
    max_format_errors: int = 64
    max_output_chars: int = 8192
    command_timeout_s: float = 60.0
    # Render the bash tool's JSON schema into the system turn (the chat template's tools block).
    # Tiny demo models skip it: the system prompt alone names the tool and saves ~300 tokens a turn.
    tool_schema_in_prompt: bool = True
    system_prompt: str = (
        "You are an expert terminal agent. Solve the task by running bash commands with the bash tool, "
        "one tool call per reply. When the task is complete, run `echo " + SUBMIT_MARKER + "`."
    )


@dataclasses.dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (end-of-turn token) or "length"


class TurnGenerator(Protocol):
    """One episode's view of the policy: feeds new context tokens, returns the sampled reply.

    Implementations keep the prefix state between calls (the engine only prefills the new tokens).
    """

    def __call__(self, new_tokens: list[int], *, max_new_tokens: int) -> Generation: ...


class ShellLike(Protocol):
    def run(self, command: str, timeout: float | None = None): ...


def _shell_result(res) -> tuple[str, int | None, bool]:
    output = getattr(res, "output", None)
    if output is None:
        output = (getattr(res, "stdout", "") or "") + (getattr(res, "stderr", "") or "")
    return output, getattr(res, "exit_code", None), bool(getattr(res, "timed_out", False))


def run_episode(
    instruction: str,
    policy: TurnGenerator,
    shell: ShellLike,
    chat: ChatFormatter,
    cfg: AgentConfig = AgentConfig(),
    *,
    task_id: str = "",
    group_id: int = 0,
) -> Trajectory:
    """Run one episode until submit, a limit, or too many format errors. The reward is set by the caller."""
    messages = [{"role": "system", "content": cfg.system_prompt}, {"role": "user", "content": instruction}]
    traj = Trajectory(task_id=task_id, group_id=group_id, messages=list(messages))
    new_ids = chat.prompt_ids(messages)
    for turn in range(cfg.max_turns):
        budget = cfg.max_context_tokens - len(traj.tokens) - len(new_ids)
        if budget <= 0:
            traj.finish_reason = "context_limit"
            break
        traj.append(new_ids, generated=False)
        gen = policy(new_ids, max_new_tokens=min(cfg.max_tokens_per_turn, budget))
        traj.append(gen.tokens, generated=True, logprobs=gen.logprobs, versions=gen.versions)
        traj.num_turns = turn + 1
        ended = bool(gen.tokens) and gen.tokens[-1] == chat.end_id
        reply = chat.decode(gen.tokens[:-1] if ended else gen.tokens)
        traj.messages.append({"role": "assistant", "content": reply})
        observation, done = _act(reply, shell, cfg, traj)
        if done:
            traj.finish_reason = "submitted"
            break
        if traj.num_format_errors > cfg.max_format_errors:
            traj.finish_reason = "format_errors"
            break
        new_msg = (
            {"role": "tool", "content": observation}
            if cfg.harness == "bash"
            else {"role": "user", "content": observation}
        )
        traj.messages.append(new_msg)
        new_ids = chat.continuation_ids([new_msg], ended_with_eos=ended)
    else:
        traj.finish_reason = "max_turns"
    traj.validate()
    return traj


def _act(reply: str, shell: ShellLike, cfg: AgentConfig, traj: Trajectory) -> tuple[str, bool]:
    """Execute the reply's action; returns (observation for the model, episode done)."""
    try:
        if cfg.harness == "terminus":
            parsed = parse_terminus_reply(reply)
            outputs = []
            for c in parsed.commands:
                output, code, timed_out = _shell_result(shell.run(c.keystrokes, timeout=max(c.duration, 1.0)))
                outputs.append(
                    format_tool_result(output, code, max_chars=cfg.max_output_chars, timed_out=timed_out)
                )
            return "\n".join(outputs) or "(no commands)", parsed.task_complete
        calls = parse_tool_calls(reply)
        if len(calls) > 1:
            raise FormatError(f"one tool call per reply, got {len(calls)}")
        output, code, timed_out = _shell_result(shell.run(calls[0].command, timeout=cfg.command_timeout_s))
    except FormatError as e:
        traj.num_format_errors += 1
        return f"Format error: {e}", False
    if is_submit(output):
        return output, True
    return format_tool_result(output, code, max_chars=cfg.max_output_chars, timed_out=timed_out), False
