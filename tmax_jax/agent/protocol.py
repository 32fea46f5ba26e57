"""Qwen 3.5 XML tool calls: the bash tool TMAX trains with, and a tolerant parser for any tool set.

The model calls a tool in Qwen 3.5's XML tool-call format::

    <tool_call>
    <function=bash>
    <parameter=command>
    ls -la
    </parameter>
    </function>
    </tool_call>

The tool result is the command's output (head and tail kept when it is too long, with a marker)
followed by ``(exit_code=N)``. A command whose output starts with ``SUBMIT_MARKER`` ends the episode.

Sampled replies are often not that tidy, so ``parse_reply`` reads what the model meant where that is
unambiguous and reports the rest as problems instead of raising:

* a missing ``</parameter>``, ``</function>`` or ``</tool_call>`` closes at the next tag or the end
  of the reply (a reply cut by the token limit or by the end-of-turn token);
* repeated opening tags (``<tool_call><tool_call>``, a ``<function=bash>`` said twice) are one tag;
  a parameter given twice keeps the non-empty value (two different values is a problem);
* a ``<function=NAME>`` without the ``<tool_call>`` around it is still a call;
* JSON arguments: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Hermes style
  older Qwen models use) and ``<function=NAME>{"command": ...}</function>``;
* several calls in one reply are all returned, in order;
* text outside the tags (prose, a code fence, a ``<think>`` block) is ignored; a call inside a
  ``<think>`` block is not a call.
"""

from __future__ import annotations

import dataclasses
import json
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
    arguments: dict

    @property
    def command(self) -> str:
        return self.arguments["command"]


@dataclasses.dataclass
class ParsedReply:
    """The calls read from a reply, and what could not be read (each one a format error)."""

    calls: list[ToolCall]
    problems: list[str]


_TAG_RE = re.compile(
    r"<tool_call>|</tool_call>|<function=([^>\n]*)>|</function>|<parameter=([^>\n]*)>|</parameter>"
)
_THINK_RE = re.compile(r"<think>.*?(?:</think>|\Z)", re.DOTALL)


def _strip_one_newline(value: str) -> str:
    # The format puts the value on its own lines; exactly one newline each side belongs to the markup.
    if value.startswith("\n"):
        value = value[1:]
    if value.endswith("\n"):
        value = value[:-1]
    return value


def _without_thinking(text: str) -> str:
    # A generation prompt may open the think block itself: then the reply holds only its end.
    if "</think>" in text and "<think>" not in text.split("</think>", 1)[0]:
        text = text.split("</think>", 1)[1]
    return _THINK_RE.sub("", text)


def _json_object(text: str) -> dict | None:
    start = text.find("{")
    if start < 0:
        return None
    try:
        obj, _ = json.JSONDecoder().raw_decode(text[start:])
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


class _Call:
    """One call under construction while the tags are walked."""

    def __init__(self, start: int):
        self.start = start  # where its raw text begins (for JSON bodies)
        self.name: str | None = None
        self.body_start = start
        self.params: dict[str, str] = {}
        self.param: str | None = None
        self.param_start = 0
        self.function_end: int | None = None  # where </function> was, inside a <tool_call>
        self.problems: list[str] = []

    def close_param(self, text: str, end: int) -> None:
        if self.param is None:
            return
        name, value = self.param, _strip_one_newline(text[self.param_start : end])
        if end == len(text):  # cut off by the end of the reply: its trailing newlines are not content
            value = value.rstrip("\n")
        self.param = None
        old = self.params.get(name)
        if old is None or not old.strip():
            self.params[name] = value
        elif value.strip() and value != old:
            self.problems.append(f"parameter '{name}' is given twice with different values")

    @property
    def empty(self) -> bool:
        return self.name is None and not self.params and self.param is None


def _finish(call: _Call, text: str, end: int, tools: dict[str, tuple[str, ...]]) -> ToolCall | str | None:
    """The ToolCall, a problem message, or None (nothing there: a stray tag)."""
    call.close_param(text, end)
    if call.problems:
        return call.problems[0]
    body = text[call.body_start : end]
    if call.name is None:
        obj = _json_object(text[call.start : end])
        if obj is not None and isinstance(obj.get("name"), str):
            args = obj.get("arguments", obj.get("parameters", {}))
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return f"the arguments of '{obj['name']}' are not a JSON object"
            call.name, call.params = obj["name"], args if isinstance(args, dict) else {}
            if not isinstance(args, dict):
                return f"the arguments of '{obj['name']}' must be a JSON object"
        elif call.params:
            if len(tools) != 1:
                return "a <tool_call> needs <function=NAME> naming the tool to call"
            call.name = next(iter(tools))
        elif text[call.start : end].strip():
            return "a <tool_call> block must contain <function=NAME>...</function> (or JSON name/arguments)"
        else:
            return None
    elif not call.params:
        obj = _json_object(body)
        if obj is not None:
            call.params = obj
    name = call.name.strip()
    if name not in tools:
        return f"unknown tool '{name}'; available tools: {', '.join(tools)}"
    missing = [p for p in tools[name] if p not in call.params]
    if missing:
        return f"the {name} tool needs <parameter={missing[0]}>"
    return ToolCall(name, dict(call.params))


def parse_reply(text: str, tools: dict[str, tuple[str, ...]] | tuple[str, ...] = ("bash",)) -> ParsedReply:
    """Every tool call in a reply and every problem met, never raising.

    ``tools`` maps each tool name to its required parameters (a bare tuple of names means bash's
    ``command`` for ``bash`` and nothing for the others).
    """
    if not isinstance(tools, dict):
        tools = {t: (("command",) if t == "bash" else ()) for t in tools}
    text = _without_thinking(text)
    calls: list[ToolCall] = []
    problems: list[str] = []
    cur: _Call | None = None
    in_wrapper = False

    def close(end: int) -> None:
        nonlocal cur
        if cur is not None:
            got = _finish(cur, text, end, tools)
            if isinstance(got, ToolCall):
                calls.append(got)
            elif got is not None:
                problems.append(got)
        cur = None

    for m in _TAG_RE.finditer(text):
        tag = m.group(0)
        if tag == "<tool_call>":
            if cur is not None and not cur.empty:
                close(m.start())  # the previous call was never closed
            if cur is None:
                cur = _Call(m.end())
            in_wrapper = True
        elif tag == "</tool_call>":
            if cur is not None:
                close(cur.function_end if cur.function_end is not None else m.start())
            in_wrapper = False
        elif tag.startswith("<function="):
            name = m.group(1).strip()
            if cur is not None and cur.name is not None:
                if cur.name == name and not cur.params and cur.param is None:
                    cur.body_start = m.end()  # the same tag said twice
                    continue
                close(m.start())  # a second call without closing the first
            if cur is None:
                cur = _Call(m.start())
            cur.name, cur.body_start = name, m.end()
        elif tag == "</function>":
            if cur is not None:
                cur.close_param(text, m.start())
                if not in_wrapper:
                    close(m.start())
                else:
                    cur.function_end = m.start()
        elif tag.startswith("<parameter="):
            pname = m.group(2).strip()
            if cur is None:
                cur = _Call(m.start())
            if cur.param == pname and not text[cur.param_start : m.start()].strip():
                cur.param_start = m.end()  # the same tag said twice
                continue
            cur.close_param(text, m.start())
            cur.param, cur.param_start = pname, m.end()
        elif tag == "</parameter>":
            if cur is not None:
                cur.close_param(text, m.start())
    if cur is not None:  # the reply ended inside a call
        close(cur.function_end if cur.function_end is not None and cur.param is None else len(text))
    return ParsedReply(calls, problems)


def parse_tool_calls(text: str, *, tools: tuple[str, ...] = ("bash",)) -> list[ToolCall]:
    """All tool calls in an assistant reply, in order; FormatError when a part of it cannot be read
    or there is no call at all (the harness needs an action every turn)."""
    parsed = parse_reply(text, tools)
    if parsed.problems:
        raise FormatError(parsed.problems[0])
    if not parsed.calls:
        raise FormatError(
            "no tool call found: reply with exactly one <tool_call><function=bash><parameter=command>"
            f"...</parameter></function></tool_call>; run `echo {SUBMIT_MARKER}` when done"
        )
    return parsed.calls


def render_function_call(name: str, arguments: dict) -> str:
    """The canonical XML text of one call (SFT targets, scripted agents, tests)."""
    params = "".join(
        f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n"
        for k, v in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def render_tool_call(command: str) -> str:
    """The canonical text of one bash call."""
    return render_function_call("bash", {"command": command})


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
