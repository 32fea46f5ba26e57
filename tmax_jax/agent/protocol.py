"""The bash-tool protocol TMAX trains with (a minimal mini-SWE-agent-style harness).

The model calls one tool, ``bash``, in Qwen 3.5's XML tool-call format::

    <tool_call>
    <function=bash>
    <parameter=command>
    ls -la
    </parameter>
    </function>
    </tool_call>

The tool result is the command's output (head and tail kept when it is too long, with a marker)
followed by ``(exit_code=N)``. A command whose output starts with ``SUBMIT_MARKER`` ends the episode.
"""

from __future__ import annotations

import dataclasses
import re

from tmax_jax.errors import TmaxError

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

# OpenAI-style function schema, passed to the chat template's ``tools`` argument.
BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": (
            "Run a bash command in the task's sandbox. The shell is persistent: the working directory "
            f"and exported variables carry over between calls. When the task is done, run `echo {SUBMIT_MARKER}`."
        ),
        "parameters": {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "The bash command to run."}},
            "required": ["command"],
        },
    },
}


class FormatError(TmaxError, ValueError):
    """The model's reply is not a valid tool call; the message is shown back to the model."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, str]

    @property
    def command(self) -> str:
        return self.arguments["command"]


_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNC_RE = re.compile(r"^\s*<function=([^>\s]+)>(.*)</function>\s*$", re.DOTALL)
_PARAM_RE = re.compile(r"<parameter=([^>\s]+)>(.*?)</parameter>", re.DOTALL)


def _strip_one_newline(value: str) -> str:
    # The format puts the value on its own lines; exactly one newline each side belongs to the markup.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def parse_tool_calls(text: str, *, tools: tuple[str, ...] = ("bash",)) -> list[ToolCall]:
    """All tool calls in an assistant reply, in order. Raises FormatError naming the problem.

    A reply with an opened but unclosed ``<tool_call>`` or a call to an unknown function is an error;
    a reply with no tool call at all is also an error (the harness needs an action every turn).
    """
    calls: list[ToolCall] = []
    for block in _CALL_RE.findall(text):
        m = _FUNC_RE.match(block)
        if not m:
            raise FormatError("a <tool_call> block must contain exactly one <function=NAME>...</function>")
        name, body = m.group(1), m.group(2)
        if name not in tools:
            raise FormatError(f"unknown tool '{name}'; available tools: {', '.join(tools)}")
        args = {k: _strip_one_newline(v) for k, v in _PARAM_RE.findall(body)}
        leftover = _PARAM_RE.sub("", body).strip()
        if leftover:
            raise FormatError(f"unexpected text inside <function={name}>: {leftover[:80]!r}")
        if name == "bash" and "command" not in args:
            raise FormatError("the bash tool needs a <parameter=command> with the command to run")
        calls.append(ToolCall(name, args))
    opened, closed = text.count("<tool_call>"), text.count("</tool_call>")
    if opened != closed:
        raise FormatError(f"unbalanced tool-call tags: {opened} <tool_call> vs {closed} </tool_call>")
    if not calls:
        raise FormatError(
            "no tool call found: reply with exactly one <tool_call><function=bash><parameter=command>"
            f"...</parameter></function></tool_call>; run `echo {SUBMIT_MARKER}` when done"
        )
    return calls


def render_tool_call(command: str) -> str:
    """The canonical text of one bash call (used for SFT targets and in tests)."""
    return (
        "<tool_call>\n<function=bash>\n<parameter=command>\n"
        f"{command}\n</parameter>\n</function>\n</tool_call>"
    )


def truncate_middle(text: str, max_chars: int) -> str:
    """Keep the head and tail of ``text`` with a marker saying how much was cut."""
    if max_chars <= 0 or len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    cut = len(text) - max_chars
    return f"{text[:head]}\n[... {cut} characters truncated ...]\n{text[len(text) - tail :]}"


def format_tool_result(
    output: str, exit_code: int | None, *, max_chars: int = 8192, timed_out: bool = False
) -> str:
    """What the model sees after a command: its output, then ``(exit_code=N)``."""
    body = truncate_middle(output, max_chars)
    if body and not body.endswith("\n"):
        body += "\n"
    if timed_out:
        return f"{body}(command timed out; exit_code={exit_code if exit_code is not None else -1})"
    return f"{body}(exit_code={exit_code})"


def is_submit(output: str) -> bool:
    """True when a command's output announces that the agent is done."""
    return output.lstrip().startswith(SUBMIT_MARKER)
