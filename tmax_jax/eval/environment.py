"""Can a task's environment be built without the internet?

Terminal-Bench-style tasks build their image from ``environment/Dockerfile``; many of them install
packages at build time. On an offline machine such a build cannot succeed, and the attempt says
nothing about the model, so the evaluation reports these tasks as "environment unavailable"
instead of scoring them 0. The check reads the Dockerfile statically (no build is attempted).
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

# Commands that download at build time, matched against each shell command of a RUN step (split on
# && ; | and newlines); the first match names the command. The patterns err towards "fetches": a
# false "unavailable" costs one skipped task, a false "available" scores the model 0 for our network.
_FETCHERS: tuple[tuple[str, re.Pattern[str]], ...] = tuple(
    (name, re.compile(pattern))
    for name, pattern in (
        ("uv", r"\buv\s+(pip\s+install|sync|add|tool\s+install|python\s+install)\b"),
        ("pip install", r"\b(pip3?|python3?(\.\d+)? -m pip)\s+install\b(?!.*--no-index)"),
        ("poetry install", r"\bpoetry\s+(install|add)\b"),
        ("pipx install", r"\bpipx\s+install\b"),
        ("conda install", r"\b(conda|mamba|micromamba)\s+(install|create|env\s+create)\b"),
        ("apt-get", r"\bapt(-get)?\s+(-\S+\s+)*(install|update|upgrade|dist-upgrade|source|download)\b"),
        ("apk add", r"\bapk\s+(-\S+\s+)*(add|update|upgrade)\b(?!.*--no-network)"),
        ("yum/dnf", r"\b(yum|dnf|microdnf|zypper)\s+(-\S+\s+)*(install|update|upgrade)\b"),
        ("curl", r"\bcurl\b"),
        ("wget", r"\bwget\b"),
        ("git clone", r"\bgit\s+(clone|fetch|pull|submodule\s+update)\b"),
        ("npm install", r"\b(npm|pnpm)\s+(install|i|ci|add)\b|\byarn(\s+(install|add))?\s*$|\bnpx\b"),
        ("cargo", r"\bcargo\s+(install|fetch)\b"),
        ("go get", r"\bgo\s+(get|install|mod\s+download)\b"),
        ("gem install", r"\b(gem\s+install|bundle(\s+install)?\s*$)"),
        ("R packages", r"install\.packages\(|\bremotes::install"),
        ("cpan", r"\bcpanm?\b"),
    )
)
_URL = re.compile(r"^(https?|ftp|git)://|^git@", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class EnvironmentCheck:
    available: bool
    reason: str = ""  # why not, naming the Dockerfile line


def dockerfile_instructions(text: str) -> list[tuple[int, str, str]]:
    """``(line number, INSTRUCTION, arguments)`` with backslash continuations joined, comments dropped."""
    out: list[tuple[int, str, str]] = []
    pending: list[str] = []
    start = 0
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.rstrip()
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if pending and line.lstrip().startswith("#"):
            continue  # comment lines inside a continued instruction are ignored by docker too
        if not pending:
            start = lineno
        if line.endswith("\\"):
            pending.append(line[:-1])
            continue
        pending.append(line)
        joined = " ".join(p.strip() for p in pending)
        pending = []
        head, _, rest = joined.partition(" ")
        out.append((start, head.upper(), rest.strip()))
    if pending:
        joined = " ".join(p.strip() for p in pending)
        head, _, rest = joined.partition(" ")
        out.append((start, head.upper(), rest.strip()))
    return out


def _shell_commands(script: str) -> list[str]:
    return [c.strip() for c in re.split(r"&&|\|\||;|\||\n", script) if c.strip()]


def network_fetches(dockerfile: str) -> list[tuple[int, str]]:
    """``(line, what)`` for every build step of ``dockerfile`` text that downloads from the network."""
    found: list[tuple[int, str]] = []
    for lineno, instr, args in dockerfile_instructions(dockerfile):
        if instr == "RUN":
            # Exec form RUN ["bash", "-c", "..."] reads the same once the JSON punctuation is gone.
            script = re.sub(r'^\[|\]$|",\s*"', " ", args) if args.startswith("[") else args
            for cmd in _shell_commands(script):
                for name, pattern in _FETCHERS:
                    if pattern.search(cmd):
                        if (lineno, name) not in found:
                            found.append((lineno, name))
                        break
        elif instr == "ADD":
            srcs = [a for a in args.split() if not a.startswith("--")][:-1]
            if any(_URL.search(s) for s in srcs):
                found.append((lineno, "ADD from a URL"))
    return found


def check_environment(task_dir: str | Path, *, network: bool = False) -> EnvironmentCheck:
    """Whether ``task_dir``'s environment can be built; always available when builds have network."""
    dockerfile = Path(task_dir) / "environment" / "Dockerfile"
    if network or not dockerfile.is_file():
        return EnvironmentCheck(True)
    fetches = network_fetches(dockerfile.read_text(errors="replace"))
    if not fetches:
        return EnvironmentCheck(True)
    where = ", ".join(f"line {ln} ({what})" for ln, what in fetches[:3])
    more = f" and {len(fetches) - 3} more" if len(fetches) > 3 else ""
    return EnvironmentCheck(
        False,
        f"environment/Dockerfile fetches from the internet at build time: {where}{more}; this run is offline",
    )
