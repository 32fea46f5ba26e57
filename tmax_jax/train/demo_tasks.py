"""A trivially learnable task family for the CPU demo: write a given word into a file.

A tiny random model cannot solve real terminal tasks, but it can learn, from a short warm start and
then from reward, to copy a word from the instruction into a shell command. Each task is a real
Harbor-format task (instruction.md, task.toml, environment/Dockerfile, tests/test.sh,
solution/solve.sh) graded in the sandbox like any other.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

WORDS = (
    "apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "rocket",
    "forest", "silver", "garden", "planet", "candle", "window", "orange", "marble",
)  # fmt: skip
FILES = ("answer.txt", "out.txt", "result.txt")

_TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if [ -f /app/{file} ] && [ "$(tr -d '[:space:]' < /app/{file})" = "{word}" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""

_TASK_TOML = """[metadata]
category = "demo"
family = "write_word"
seed = {seed}

[verifier]
timeout_sec = 30

[agent]
timeout_sec = 120

[environment]
cpus = 1
memory = "512M"
allow_internet = false
"""


def solution_command(word: str, file: str) -> str:
    return f"echo {word} > /app/{file}"


def write_task(root: str | Path, seed: int, *, num_words: int = len(WORDS), num_files: int = 1) -> Path:
    """Write task number ``seed`` under ``root``; the word (and file) are drawn from the seed."""
    rng = random.Random(seed)
    word = rng.choice(WORDS[:num_words])
    file = rng.choice(FILES[:num_files])
    d = Path(root) / f"write_word_{seed:05d}"
    if d.exists():
        shutil.rmtree(d)
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "instruction.md").write_text(f"Write the word {word} into the file /app/{file}.\n")
    (d / "task.toml").write_text(_TASK_TOML.format(seed=seed))
    (d / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\n")
    (d / "tests" / "test.sh").write_text(_TEST_SH.format(word=word, file=file))
    (d / "solution" / "solve.sh").write_text(f"#!/bin/bash\n{solution_command(word, file)}\n")
    return d


def write_tasks(root: str | Path, seeds, **kwargs) -> list[Path]:
    Path(root).mkdir(parents=True, exist_ok=True)
    return [write_task(root, s, **kwargs) for s in seeds]
