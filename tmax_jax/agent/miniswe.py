"""mini-swe-agent style: no tools, one bash command per reply in a fenced block.

The model thinks in prose and ends each reply with exactly one fenced ```bash block. The command
runs in a fresh ``bash -c`` (as mini-swe-agent runs each action in its own subprocess: ``cd`` and
``export`` do not carry over, so chain them with ``&&``), in the task's working directory. The
observation is a user turn::

    <returncode>0</returncode>
    <output>
    ...
    </output>

with the middle of a long output cut and a note saying so. The episode ends when a command's output
starts with ``COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` (``echo`` it as a command of its own).
"""

from __future__ import annotations

import re
import shlex
from typing import Any

from tmax_jax.agent.harness import Harness, Session, Step, shell_output
from tmax_jax.agent.protocol import SUBMIT_MARKER, ToolCall, is_submit, truncate_middle

_FENCE_RE = re.compile(r"```(?:bash|sh|shell)[ \t]*\n(.*?)(?:\n)?```", re.DOTALL)

SYSTEM_PROMPT = f"""You are a skilled engineer working in a Linux shell to complete a task.

Every reply has two parts: first a short THOUGHT explaining what you will do and why, then exactly ONE
command in a fenced code block:

THOUGHT: the file list tells me where the config lives; I will read it next.

```bash
cat /app/config.ini
```

Rules:
- Exactly one ```bash block per reply, holding one command (join steps with && or ;).
- Each command runs in a new shell in the task's directory: `cd` and `export` do not persist, so
  chain them (`cd src && make`).
- The command cannot be interactive (no editors, pagers or prompts waiting for input); write files
  with heredocs, sed or a script.
- When the task is done and checked, reply with this command alone, on its own:

```bash
echo {SUBMIT_MARKER}
```
"""

FORMAT_HINT = (
    "Reply with a THOUGHT and then exactly ONE command in a ```bash fenced block. "
    f"When done, run `echo {SUBMIT_MARKER}` as that command."
)


def find_commands(text: str) -> list[str]:
    """The fenced bash blocks of a reply, in order."""
    return [m.strip("\n") for m in _FENCE_RE.findall(text)]


def format_observation(output: str, returncode: int | None, *, max_chars: int, timed_out: bool) -> str:
    body = truncate_middle(output, max_chars)
    note = ""
    if body is not output:
        note = (
            f"<note>The output had {len(output)} characters; its middle was cut. Use head, tail, grep "
            "or redirect to a file to see less at once.</note>\n"
        )
    if timed_out:
        note += "<note>The command timed out and was stopped; run long jobs in the background.</note>\n"
    body = body.rstrip("\n")
    return (
        f"<returncode>{returncode}</returncode>\n{note}<output>\n{body}\n</output>"
        if body
        else (f"<returncode>{returncode}</returncode>\n{note}<output>\n</output>")
    )


class MiniSweHarness(Harness):
    name = "mini-swe"
    observation_role = "user"
    system_prompt = SYSTEM_PROMPT
    persistent_shell = False

    def start(self, shell: Any, cfg: Any) -> Session:
        return _MiniSweSession(self, shell, cfg)

    def render_command(self, command: str) -> str:
        return f"THOUGHT: I will run the next step.\n\n```bash\n{command}\n```"

    def render_submit(self) -> list[str]:
        return [f"THOUGHT: The task is done.\n\n```bash\necho {SUBMIT_MARKER}\n```"]


class _MiniSweSession(Session):
    def act(self, reply: str, tool_calls: list[ToolCall] | None = None) -> Step:
        commands = find_commands(reply)
        if len(commands) != 1:
            what = "no ```bash block" if not commands else f"{len(commands)} ```bash blocks"
            return Step(f"Format error: found {what}; exactly one is needed.\n{FORMAT_HINT}", False, 1)
        # A fresh shell per action, started in the persistent shell's directory (never changed).
        res = self.shell.run(f"bash -c {shlex.quote(commands[0])}", timeout=self.cfg.command_timeout_s)
        output, code, timed_out = shell_output(res)
        if is_submit(output):
            return Step(output, True)
        return Step(
            format_observation(output, code, max_chars=self.cfg.max_output_chars, timed_out=timed_out)
        )
