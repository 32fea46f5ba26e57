"""OpenHands style: CodeAct through function calling, three tools in Qwen 3.5 XML tool calls.

* ``execute_bash(command, timeout?)``: the persistent shell. ``timeout`` (seconds) overrides the
  default; a command that runs past it is stopped and the observation says so. A command ending in
  a single ``&`` is started in the background under ``nohup`` with its output in a log file (the
  observation names its pid and log), so servers keep running while the agent goes on.
* ``str_replace_editor(command, path, ...)``: ``tmax_jax.agent.editor.FileEditor`` (view with line
  numbers, create, unique-match str_replace, insert, undo_edit).
* ``finish(message?)``: ends the episode.

Each observation is a tool message: the command's output (middle cut when long) and a
``[exit code N, cwd DIR]`` line, or the editor's answer. Several calls in one reply run in order.
"""

from __future__ import annotations

import json
import re
import shlex
from typing import Any

from tmax_jax.agent.editor import EditorError, FileEditor
from tmax_jax.agent.harness import (
    Harness,
    Session,
    Step,
    check_calls,
    format_problems,
    required_params,
    shell_output,
)
from tmax_jax.agent.protocol import ToolCall, parse_reply, render_function_call, truncate_middle

MAX_TIMEOUT_S = 600.0
_BACKGROUND_RE = re.compile(r"(?<![&|>])&\s*$")

EXECUTE_BASH = {
    "type": "function",
    "function": {
        "name": "execute_bash",
        "description": (
            "Run a bash command in a persistent shell (the directory and variables carry over). One "
            "command per call; chain steps with && . Commands cannot be interactive. For a server or any "
            "long job, end the command with & to run it in the background (its output goes to a log "
            "file). A command running past its timeout is stopped."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The bash command to run."},
                "timeout": {"type": "number", "description": "Seconds before the command is stopped."},
            },
            "required": ["command"],
        },
    },
}

STR_REPLACE_EDITOR = {
    "type": "function",
    "function": {
        "name": "str_replace_editor",
        "description": (
            "View, create and edit files. `view` shows a file with line numbers (or a directory two "
            "levels deep); `create` writes a new file (not an existing one); `str_replace` replaces "
            "old_str, which must occur exactly once, by new_str; `insert` adds new_str after line "
            "insert_line (0 = top); `undo_edit` reverts the file's last edit. Paths are absolute."
        ),
        "parameters": {
            "type": "object",
            "properties": {
                "command": {
                    "type": "string",
                    "enum": ["view", "create", "str_replace", "insert", "undo_edit"],
                    "description": "The editor command.",
                },
                "path": {"type": "string", "description": "Absolute path of a file or directory."},
                "file_text": {"type": "string", "description": "create: the file's content."},
                "old_str": {"type": "string", "description": "str_replace: the exact text to replace."},
                "new_str": {"type": "string", "description": "str_replace / insert: the new text."},
                "insert_line": {"type": "integer", "description": "insert: the line to insert after."},
                "view_range": {
                    "type": "array",
                    "items": {"type": "integer"},
                    "description": "view: [first, last] lines, last -1 = to the end.",
                },
            },
            "required": ["command", "path"],
        },
    },
}

FINISH = {
    "type": "function",
    "function": {
        "name": "finish",
        "description": "Call when the task is complete (and checked): ends the episode.",
        "parameters": {
            "type": "object",
            "properties": {"message": {"type": "string", "description": "A short summary of what was done."}},
            "required": [],
        },
    },
}

TOOLS = [EXECUTE_BASH, STR_REPLACE_EDITOR, FINISH]

SYSTEM_PROMPT = """You are a capable software agent with a Linux sandbox. Solve the task by calling tools:
execute_bash to run commands, str_replace_editor to read and edit files, and finish once the task is
done and you have checked the result. Work step by step: explore first, make focused changes, verify
them (run the program or its tests). Do not ask the user anything; nobody will answer."""

FORMAT_HINT = (
    "Call a tool as <tool_call>\n<function=execute_bash>\n<parameter=command>\nls\n</parameter>\n"
    "</function>\n</tool_call> (tools: execute_bash, str_replace_editor, finish)."
)


class OpenHandsHarness(Harness):
    name = "openhands"
    observation_role = "tool"
    system_prompt = SYSTEM_PROMPT

    @property
    def tools(self) -> list[dict]:
        return TOOLS

    def start(self, shell: Any, cfg: Any) -> Session:
        return _OpenHandsSession(self, shell, cfg)

    def render_command(self, command: str) -> str:
        return render_function_call("execute_bash", {"command": command})

    def render_submit(self) -> list[str]:
        return [render_function_call("finish", {"message": "The task is done."})]


class _OpenHandsSession(Session):
    def __init__(self, harness: Harness, shell: Any, cfg: Any):
        super().__init__(harness, shell, cfg)
        self.editor = FileEditor(shell)
        self.background_jobs = 0

    def act(self, reply: str, tool_calls: list[ToolCall] | None = None) -> Step:
        req = required_params(TOOLS)
        if tool_calls is None:
            parsed = parse_reply(reply, req)
            calls, problems = parsed.calls, parsed.problems
        else:
            calls, problems = check_calls(tool_calls, req)
        if not calls and not problems:
            problems = ["no tool call found in the reply"]
        observations = []
        for call in calls[: self.cfg.max_calls_per_reply]:
            if call.name == "finish":
                return Step("\n".join([*observations, "Finished."]), True, 1 if problems else 0)
            if call.name == "execute_bash":
                observations.append(self.execute_bash(call.arguments))
            else:
                observations.append(self.edit(call.arguments))
        if problems:
            observations.append(format_problems(problems, FORMAT_HINT))
        return Step("\n".join(observations), False, 1 if problems else 0)

    def execute_bash(self, args: dict) -> str:
        command = str(args["command"])
        timeout = self.cfg.command_timeout_s
        if args.get("timeout") not in (None, ""):
            try:
                timeout = min(max(float(args["timeout"]), 1.0), MAX_TIMEOUT_S)
            except (TypeError, ValueError):
                return f"Error: timeout must be a number of seconds, got {args['timeout']!r}"
        if _BACKGROUND_RE.search(command):
            self.background_jobs += 1
            log = f"/tmp/tmax-bg-{self.background_jobs}.log"
            body = _BACKGROUND_RE.sub("", command)
            command = (
                f"nohup bash -c {shlex.quote(body)} > {log} 2>&1 &\n"
                f'echo "[started in the background: pid $!; its output goes to {log}]"'
            )
        output, code, timed_out = shell_output(self.shell.run(command, timeout=timeout))
        body = truncate_middle(output, self.cfg.max_output_chars).rstrip("\n")
        cwd, _, _ = shell_output(self.shell.run("pwd", timeout=10.0))
        if timed_out:
            status = (
                f"[the command ran past its {timeout:g}s timeout and was stopped; run long jobs in the "
                "background: COMMAND > log 2>&1 &]"
            )
        else:
            status = f"[exit code {code}, cwd {cwd.strip()}]"
        return f"{body}\n{status}" if body else status

    def edit(self, args: dict) -> str:
        args = dict(args)
        if isinstance(args.get("view_range"), str):
            try:
                args["view_range"] = json.loads(args["view_range"])
            except json.JSONDecodeError:
                return f"Error: view_range must be a JSON list like [1, 20], got {args['view_range']!r}"
        command, path = args.pop("command"), args.pop("path")
        try:
            return self.editor(str(command).strip(), str(path).strip(), **args)
        except EditorError as e:
            return f"Error: {e}"
        except TypeError as e:  # an argument the command does not take
            return f"Error: {e}"
