"""Terminus-2 style: JSON replies whose keystrokes are typed into a persistent terminal.

A reply is one JSON object (prose or a code fence around it is tolerated)::

    {"analysis": "...", "plan": "...",
     "commands": [{"keystrokes": "ls -la\\n", "duration": 0.5}, {"keystrokes": "C-c"}],
     "task_complete": false}

Keystrokes go to a tmux session in the sandbox exactly as typed: text is typed literally, each
``\\n`` presses Enter, and a whole-string tmux key name (``C-c``, ``C-d``, ``Escape``, ``Tab``,
``Up``, ...) presses that key. After each command the harness waits up to its ``duration`` (capped)
and stops early once the terminal is back at its shell prompt; what runs longer keeps running (a
server, an editor), as in a real terminal. The observation is the terminal's screen. The first
``task_complete: true`` is answered with a request to confirm; the second in a row ends the episode.

Sandboxes without tmux get a line terminal over the persistent shell instead (each typed line runs
as a command when Enter is pressed; the screen is the transcript's last rows).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
from typing import Any

from tmax_jax.agent.harness import Harness, Session, Step, shell_output
from tmax_jax.agent.protocol import FormatError, ToolCall, truncate_middle

SESSION = "tmax"
COLUMNS, ROWS = 160, 40
MAX_DURATION_S = 60.0
_KEY_RE = re.compile(
    r"^(?:[CM]-[A-Za-z0-9\[\\\]]|C-M-[A-Za-z]|Enter|Escape|Tab|BTab|BSpace|Space|Up|Down|Left|Right|"
    r"Home|End|PageUp|PageDown|PPage|NPage|IC|DC|F[1-9]|F1[0-2])$"
)


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


def parse_terminus_reply(text: str, *, max_duration: float = MAX_DURATION_S) -> TerminusReply:
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


SYSTEM_PROMPT = """You control a Linux terminal (a tmux session) to solve a task. Each reply is one JSON
object and nothing else:

{
  "analysis": "what the screen shows and what is left to do",
  "plan": "the next steps",
  "commands": [
    {"keystrokes": "ls -la\\n", "duration": 0.5}
  ],
  "task_complete": false
}

- keystrokes are typed exactly as given: end a command with \\n to press Enter. A keystrokes string
  that is only a key name presses that key: "C-c" (interrupt), "C-d", "Escape", "Tab", "Up", ...
- duration is how many seconds to wait for the command's output (at most 60; the wait ends early
  when the shell is back at its prompt). Use short waits for quick commands, longer for builds.
- After your commands you get the terminal's screen.
- Set "task_complete": true once the task is done and checked; you will be asked to confirm."""

CONFIRM = (
    'You set task_complete to true. If the task is done, reply again with "task_complete": true '
    "(and no commands) to finish; otherwise continue with more commands."
)


class TerminusHarness(Harness):
    name = "terminus"
    observation_role = "user"
    system_prompt = SYSTEM_PROMPT

    def start(self, shell: Any, cfg: Any) -> Session:
        return _TerminusSession(self, shell, cfg)

    def render_command(self, command: str) -> str:
        reply = {
            "analysis": "The next step of the task.",
            "plan": "Run the command.",
            "commands": [{"keystrokes": command + "\n", "duration": 30}],
            "task_complete": False,
        }
        return json.dumps(reply)

    def render_submit(self) -> list[str]:
        done = json.dumps({"analysis": "Done.", "plan": "Finish.", "commands": [], "task_complete": True})
        return [done, done]


class TmuxTerminal:
    """A tmux session inside the sandbox, driven through the persistent shell."""

    def __init__(self, shell: Any):
        self.shell = shell
        out = self._run(
            f"tmux kill-session -t {SESSION} 2>/dev/null; "
            f"tmux new-session -d -s {SESSION} -x {COLUMNS} -y {ROWS} && "
            f"tmux set-option -t {SESSION} history-limit 10000 >/dev/null && echo __tmux_ok"
        )
        if "__tmux_ok" not in out:
            raise RuntimeError(f"tmux did not start: {out.strip()[:300]}")

    def _run(self, command: str, timeout: float = 30.0) -> str:
        return shell_output(self.shell.run(command, timeout=timeout))[0]

    def send(self, keystrokes: str, duration: float) -> None:
        t = f"-t {SESSION}"
        if _KEY_RE.match(keystrokes):
            parts = [f"tmux send-keys {t} {keystrokes}"]
        else:
            parts = []
            for i, chunk in enumerate(keystrokes.split("\n")):
                if i:
                    parts.append(f"tmux send-keys {t} Enter")
                if chunk:
                    parts.append(f"tmux send-keys {t} -l -- {shlex.quote(chunk)}")
        # Wait until the pane's shell is idle again (no child process, the shell in front), or the
        # duration is spent.
        wait = (
            f"sleep 0.1; __p=$(tmux display-message -p {t} '#{{pane_pid}}'); "
            f"__end=$(( $(date +%s%N) + {int(duration * 1e9)} )); "
            'while [ "$(date +%s%N)" -lt "$__end" ]; do '
            '[ -z "$(cat /proc/$__p/task/$__p/children 2>/dev/null)" ] && '
            f"case \"$(tmux display-message -p {t} '#{{pane_current_command}}')\" in "
            "bash|sh|zsh|dash) break;; esac; sleep 0.1; done"
        )
        self._run("; ".join([*parts, wait]) if parts else wait, timeout=duration + 30.0)

    def screen(self) -> str:
        out = self._run(f"tmux capture-pane -p -t {SESSION}")
        return out.rstrip()


class LineTerminal:
    """Without tmux: typed lines run in the persistent shell when Enter is pressed."""

    def __init__(self, shell: Any, timeout: float):
        self.shell = shell
        self.timeout = timeout
        self.pending = ""
        self.transcript: list[str] = []

    def send(self, keystrokes: str, duration: float) -> None:
        if keystrokes in ("C-c", "C-d"):
            self.transcript.append(f"$ {self.pending}^C")
            self.pending = ""
            return
        if _KEY_RE.match(keystrokes):
            if keystrokes == "Enter":
                keystrokes = "\n"
            else:
                return  # other keys mean nothing to a line terminal
        chunks = keystrokes.split("\n")
        for chunk in chunks[:-1]:
            line, self.pending = self.pending + chunk, ""
            output, _, timed_out = shell_output(self.shell.run(line, timeout=self.timeout))
            self.transcript.append(f"$ {line}")
            self.transcript.extend(output.rstrip("\n").split("\n") if output else [])
            if timed_out:
                self.transcript.append(f"[stopped after {self.timeout:g}s]")
        self.pending += chunks[-1]

    def screen(self) -> str:
        return "\n".join([*self.transcript[-(ROWS - 1) :], f"$ {self.pending}"])


class _TerminusSession(Session):
    def __init__(self, harness: Harness, shell: Any, cfg: Any):
        super().__init__(harness, shell, cfg)
        self.terminal: TmuxTerminal | LineTerminal
        has_tmux = (
            "__yes" in shell_output(shell.run("command -v tmux >/dev/null && echo __yes", timeout=10))[0]
        )
        self.terminal = TmuxTerminal(shell) if has_tmux else LineTerminal(shell, cfg.command_timeout_s)
        self.asked_to_confirm = False

    def act(self, reply: str, tool_calls: list[ToolCall] | None = None) -> Step:
        try:
            parsed = parse_terminus_reply(reply)
        except FormatError as e:
            self.asked_to_confirm = False
            return Step(f"Format error: {e}\nReply with one JSON object as described.", False, 1)
        if parsed.task_complete and self.asked_to_confirm and not parsed.commands:
            return Step("Task marked complete.", True)
        for c in parsed.commands:
            self.terminal.send(c.keystrokes, c.duration)
        screen = truncate_middle(self.terminal.screen(), self.cfg.max_output_chars)
        observation = f"Terminal screen:\n{screen}"
        self.asked_to_confirm = parsed.task_complete
        if parsed.task_complete:
            observation += f"\n\n{CONFIRM}"
        return Step(observation)
