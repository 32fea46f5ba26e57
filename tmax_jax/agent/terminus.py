"""Terminus-2-style JSON replies: ``analysis``, ``plan``, ``commands: [{keystrokes, duration}]``,
``task_complete``. Used for evaluation under that harness."""

from __future__ import annotations

import dataclasses
import json

from tmax_jax.agent.protocol import FormatError


@dataclasses.dataclass(frozen=True)
class TerminusCommand:
    keystrokes: str
    duration: float = 1.0


@dataclasses.dataclass(frozen=True)
class TerminusReply:
    analysis: str
    plan: str
    commands: tuple[TerminusCommand, ...]
    task_complete: bool


def _first_json_object(text: str) -> str:
    # The model may wrap the object in prose or a code fence: take the first balanced {...}.
    start = text.find("{")
    if start < 0:
        raise FormatError("no JSON object found in the reply")
    depth, in_str, esc = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start : i + 1]
    raise FormatError("the JSON object in the reply is not closed")


def parse_terminus_reply(text: str, *, max_duration: float = 60.0) -> TerminusReply:
    """Parse and validate one Terminus-2 reply; FormatError names the offending field."""
    try:
        obj = json.loads(_first_json_object(text))
    except json.JSONDecodeError as e:
        raise FormatError(f"reply is not valid JSON: {e.msg} at position {e.pos}") from e
    if not isinstance(obj, dict):
        raise FormatError("reply must be a JSON object")
    for key in ("analysis", "plan"):
        if not isinstance(obj.get(key, ""), str):
            raise FormatError(f"field '{key}' must be a string")
    raw_cmds = obj.get("commands", [])
    if not isinstance(raw_cmds, list):
        raise FormatError("field 'commands' must be a list")
    commands = []
    for i, c in enumerate(raw_cmds):
        if not isinstance(c, dict) or not isinstance(c.get("keystrokes"), str):
            raise FormatError(f"commands[{i}] must be an object with a string 'keystrokes'")
        duration = c.get("duration", 1.0)
        if isinstance(duration, bool) or not isinstance(duration, (int, float)) or duration < 0:
            raise FormatError(f"commands[{i}].duration must be a non-negative number")
        commands.append(TerminusCommand(c["keystrokes"], min(float(duration), max_duration)))
    complete = obj.get("task_complete", False)
    if not isinstance(complete, bool):
        raise FormatError("field 'task_complete' must be true or false")
    return TerminusReply(obj.get("analysis", ""), obj.get("plan", ""), tuple(commands), complete)
