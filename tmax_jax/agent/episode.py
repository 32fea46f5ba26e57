"""The multi-turn episode loop: policy <-> sandbox shell under a harness, building a token trajectory."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import numpy as np

from tmax_jax.agent.chat import ChatFormatter
from tmax_jax.agent.context import CONTEXT_EXHAUSTED, fit_observation
from tmax_jax.agent.harness import HARNESSES, Harness, get_harness, shell_output
from tmax_jax.agent.trajectory import Trajectory
from tmax_jax.errors import ConfigError

# The bash harness's prompt, the default before prompts moved into harnesses: a config holding it
# means the harness default (so runs recorded with it still resume).
_LEGACY_DEFAULT_PROMPT = (
    "You are an expert terminal agent. Solve the task by running bash commands with the bash tool, "
    "one tool call per reply. When the task is complete, run `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`."
)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    harness: str = "bash"  # one of tmax_jax.agent.harness.HARNESSES
    max_turns: int = 64
    max_tokens_per_turn: int = 2048
    max_context_tokens: int = 65536
    max_format_errors: int = 64
    max_output_chars: int = 8192
    command_timeout_s: float = 60.0
    max_calls_per_reply: int = 8  # tool calls of one reply that are run (in order)
    # Near the context limit an observation is cut so that this many tokens (at most
    # max_tokens_per_turn) stay free for the next reply (see tmax_jax.agent.context).
    context_reserve_tokens: int = 512
    keep_recent_outputs: int = 2  # re-sent conversations: newest observations never elided
    elide_at: float = 0.75  # re-sent conversations: elide old outputs past this share of the context
    # Render the harness's tool schemas into the system turn (the chat template's tools block).
    # Tiny demo models skip it: the system prompt alone names the tool and saves ~300 tokens a turn.
    tool_schema_in_prompt: bool = True
    system_prompt: str = ""  # "" = the harness's own prompt

    def __post_init__(self) -> None:
        if self.harness not in HARNESSES:
            raise ConfigError(f"agent.harness={self.harness!r}; expected one of {list(HARNESSES)}")
        for name in ("max_turns", "max_tokens_per_turn", "max_context_tokens", "max_calls_per_reply"):
            if getattr(self, name) < 1:
                raise ConfigError(f"agent.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.elide_at <= 1.0:
            raise ConfigError(f"agent.elide_at must be in (0, 1], got {self.elide_at}")
        if self.system_prompt == _LEGACY_DEFAULT_PROMPT and self.harness == "bash":
            object.__setattr__(self, "system_prompt", "")

    def prompt(self, harness: Harness | None = None) -> str:
        """The system prompt this episode starts with."""
        return self.system_prompt or (harness or get_harness(self.harness)).system_prompt

    @property
    def reply_reserve(self) -> int:
        return min(self.max_tokens_per_turn, self.context_reserve_tokens)


@dataclasses.dataclass
class Generation:
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (end-of-turn token) or "length"
    # MoE engines recording routing: int [len(tokens), layers, top_k], the experts each token was
    # routed to when the engine fed it (-1 where not recorded); routing replay trains on them.
    experts: np.ndarray | None = None


class TurnGenerator(Protocol):
    """One episode's view of the policy: feeds new context tokens, returns the sampled reply.

    Implementations keep the prefix state between calls (the engine only prefills the new tokens).
    """

    def __call__(self, new_tokens: list[int], *, max_new_tokens: int) -> Generation: ...


class ShellLike(Protocol):
    def run(self, command: str, timeout: float | None = None): ...


_shell_result = shell_output  # kept for callers of the old name


def make_chat(tokenizer, cfg: AgentConfig) -> ChatFormatter:
    """The chat formatter of ``cfg``'s harness: its tools in the prompt unless the config leaves them out."""
    tools = get_harness(cfg.harness).tools if cfg.tool_schema_in_prompt else None
    return ChatFormatter(tokenizer, tools=tools, template_kwargs={"enable_thinking": False})


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
    """Run one episode until submit, a limit, or too many format errors. The reward is set by the caller.

    ``finish_reason``: submitted, max_turns, format_errors or context_exhausted (the trajectory is
    kept in every case).
    """
    harness = get_harness(cfg.harness)
    messages = [{"role": "system", "content": cfg.prompt(harness)}, {"role": "user", "content": instruction}]
    traj = Trajectory(
        task_id=task_id, group_id=group_id, messages=list(messages), info={"harness": harness.name}
    )
    new_ids = chat.prompt_ids(messages)
    session = harness.start(shell, cfg)
    try:
        for turn in range(cfg.max_turns):
            budget = cfg.max_context_tokens - len(traj.tokens) - len(new_ids)
            if budget <= 0:
                traj.finish_reason = CONTEXT_EXHAUSTED
                break
            traj.append(new_ids, generated=False)
            gen = policy(new_ids, max_new_tokens=min(cfg.max_tokens_per_turn, budget))
            traj.append(
                gen.tokens, generated=True, logprobs=gen.logprobs, versions=gen.versions, experts=gen.experts
            )
            traj.num_turns = turn + 1
            ended = bool(gen.tokens) and gen.tokens[-1] == chat.end_id
            reply = chat.decode(gen.tokens[:-1] if ended else gen.tokens)
            traj.messages.append({"role": "assistant", "content": reply})
            step = session.act(reply)
            traj.num_format_errors += step.format_errors
            if step.done:
                traj.finish_reason = "submitted"
                break
            if traj.num_format_errors > cfg.max_format_errors:
                traj.finish_reason = "format_errors"
                break
            room = cfg.max_context_tokens - len(traj.tokens)
            fitted = fit_observation(
                chat,
                harness.observation_role,
                step.observation,
                ended_with_eos=ended,
                room=room,
                reserve=cfg.reply_reserve,
            )
            if fitted is None:  # not even a cut observation fits: the messages stay the tokens
                traj.finish_reason = CONTEXT_EXHAUSTED
                break
            new_msg, new_ids = fitted
            traj.messages.append(new_msg)
        else:
            traj.finish_reason = "max_turns"
    finally:
        session.close()
    traj.validate()
    return traj
