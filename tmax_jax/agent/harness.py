"""Harnesses: how a model's reply becomes actions in the sandbox and what it sees back.

A harness is the agent's whole interface: its system prompt, the tool schemas rendered into the
chat template (or none), the role of observation messages, how a reply is parsed and executed,
and how an episode ends. The same policy can be trained under one and evaluated under all:

========== ============================================================================================
bash       TMAX's own (Vanillux2): one ``bash`` tool in Qwen 3.5 XML tool calls, ``(exit_code=N)``
           observations, submit by ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``
mini-swe   mini-swe-agent style: one fenced ```bash block per reply, each run in a fresh subshell,
           ``<returncode>``/``<output>`` observations as a user turn, the same submit echo
openhands  OpenHands CodeAct through function calling: ``execute_bash`` (timeout, background jobs),
           ``str_replace_editor`` (view/create/str_replace/insert/undo_edit) and ``finish``
terminus   Terminus-2: JSON with keystrokes and durations typed into a persistent tmux terminal,
           the screen as the observation, ``task_complete`` confirmed twice
========== ============================================================================================

Every harness acts only through ``shell.run(command, timeout=...)`` of the attempt's persistent
shell, so it runs on every sandbox backend. What cannot be parsed is one counted format error per
reply, and its message is the observation; it never raises.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

from tmax_jax.agent.protocol import (
    BASH_TOOL,
    SUBMIT_MARKER,
    ToolCall,
    format_tool_result,
    is_submit,
    parse_reply,
    render_tool_call,
)
from tmax_jax.errors import ConfigError

HARNESSES = ("bash", "mini-swe", "openhands", "terminus")


@dataclasses.dataclass
class Step:
    """The result of one reply: what the model sees next, whether the episode ended, format errors."""

    observation: str
    done: bool = False
    format_errors: int = 0


def shell_output(res: Any) -> tuple[str, int | None, bool]:
    """(merged output, exit code, timed out) of a shell's result object."""
    output = getattr(res, "output", None)
    if output is None:
        output = (getattr(res, "stdout", "") or "") + (getattr(res, "stderr", "") or "")
    return output, getattr(res, "exit_code", None), bool(getattr(res, "timed_out", False))


class Session(abc.ABC):
    """One episode under a harness: holds its state (editor history, terminal) between replies."""

    def __init__(self, harness: Harness, shell: Any, cfg: Any):
        self.harness = harness
        self.shell = shell
        self.cfg = cfg

    @abc.abstractmethod
    def act(self, reply: str, tool_calls: list[ToolCall] | None = None) -> Step:
        """Execute one reply. ``tool_calls``: calls the endpoint already parsed (OpenAI ``tool_calls``)."""

    def close(self) -> None:  # noqa: B027 - most sessions hold nothing to release
        """Release what the session holds (default: nothing)."""


class Harness(abc.ABC):
    name: str = ""
    observation_role: str = "tool"  # the chat role of observation messages
    system_prompt: str = ""
    # Whether cd/export of one action carry over to the next (False: each action a fresh shell).
    persistent_shell: bool = True

    @property
    def tools(self) -> list[dict] | None:
        """Function schemas for the chat template's ``tools`` (None: the harness has no tools)."""
        return None

    @abc.abstractmethod
    def start(self, shell: Any, cfg: Any) -> Session: ...

    @abc.abstractmethod
    def render_command(self, command: str) -> str:
        """A reply that runs ``command`` (scripted agents, SFT demonstrations)."""

    @abc.abstractmethod
    def render_submit(self) -> list[str]:
        """The replies that end an episode as solved."""


def required_params(tools: list[dict]) -> dict[str, tuple[str, ...]]:
    return {t["function"]["name"]: tuple(t["function"]["parameters"].get("required", ())) for t in tools}


def format_problems(problems: list[str], hint: str) -> str:
    lines = "\n".join(f"- {p}" for p in problems)
    return f"Format error:\n{lines}\n{hint}" if len(problems) > 1 else f"Format error: {problems[0]}\n{hint}"


class BashHarness(Harness):
    name = "bash"
    observation_role = "tool"
    system_prompt = (
        "You are an expert terminal agent. Solve the task by running bash commands with the bash tool, "
        "one tool call per reply. When the task is complete, run `echo " + SUBMIT_MARKER + "`."
    )
    hint = (
        "Call the tool as <tool_call>\n<function=bash>\n<parameter=command>\nCOMMAND\n</parameter>\n"
        f"</function>\n</tool_call>; run `echo {SUBMIT_MARKER}` when done."
    )

    @property
    def tools(self) -> list[dict]:
        return [BASH_TOOL]

    def start(self, shell: Any, cfg: Any) -> Session:
        return _BashSession(self, shell, cfg)

    def render_command(self, command: str) -> str:
        return render_tool_call(command)

    def render_submit(self) -> list[str]:
        return [render_tool_call(f"echo {SUBMIT_MARKER}")]


class _BashSession(Session):
    def act(self, reply: str, tool_calls: list[ToolCall] | None = None) -> Step:
        if tool_calls is None:
            parsed = parse_reply(reply, required_params(self.harness.tools))
            calls, problems = parsed.calls, parsed.problems
        else:
            calls, problems = check_calls(tool_calls, required_params(self.harness.tools))
        if not calls and not problems:
            problems = ["no tool call found in the reply"]
        # Several calls run in order (the tolerant reading); each problem is reported back.
        observations = []
        done = False
        for call in calls[: self.cfg.max_calls_per_reply]:
            output, code, timed_out = shell_output(
                self.shell.run(call.command, timeout=self.cfg.command_timeout_s)
            )
            if is_submit(output):
                observations.append(output)
                done = True
                break
            observations.append(
                format_tool_result(output, code, max_chars=self.cfg.max_output_chars, timed_out=timed_out)
            )
        if len(calls) > self.cfg.max_calls_per_reply:
            problems.append(f"only the first {self.cfg.max_calls_per_reply} tool calls of a reply are run")
        if problems:
            observations.append(format_problems(problems, self.harness.hint))
        return Step("\n".join(observations), done, 1 if problems else 0)


def check_calls(calls: list[ToolCall], tools: dict[str, tuple[str, ...]]) -> tuple[list[ToolCall], list[str]]:
    good, problems = [], []
    for c in calls:
        if c.name not in tools:
            problems.append(f"unknown tool '{c.name}'; available tools: {', '.join(tools)}")
        elif missing := [p for p in tools[c.name] if p not in c.arguments]:
            problems.append(f"the {c.name} tool needs a '{missing[0]}' argument")
        else:
            good.append(c)
    return good, problems


def get_harness(name: str) -> Harness:
    """The harness called ``name`` (one of ``HARNESSES``)."""
    if name == "bash":
        return BashHarness()
    if name == "mini-swe":
        from tmax_jax.agent.miniswe import MiniSweHarness

        return MiniSweHarness()
    if name == "openhands":
        from tmax_jax.agent.openhands import OpenHandsHarness

        return OpenHandsHarness()
    if name == "terminus":
        from tmax_jax.agent.terminus import TerminusHarness

        return TerminusHarness()
    raise ConfigError(f"unknown harness {name!r}; expected one of {', '.join(HARNESSES)}")
