"""Learnable task families for the CPU demo.

A tiny random model cannot solve real terminal tasks, but it can learn, from a short warm start and
then from reward, a short shell protocol. Each task is a real Harbor-format task (instruction.md,
task.toml, environment/Dockerfile, tests/test.sh, solution/solve.sh) graded in the sandbox like any
other.

* ``write_word``: write a given word into a file (one command).
* ``largest_number``: a file of numbers lies in /app/data; go there with one command, write the
  largest into /app/answer.txt with the next, then submit (three turns). Training and held-out tasks draw their
  file names from disjoint word lists (``TRAIN_NAMES`` / ``HELDOUT_NAMES``) and their numbers from
  the seed, so no held-out instruction or answer is a training one. The command that solves it
  reads the file through a glob (``cd /app/data``, then ``sort -n * | tail -1``): the policy has to
  learn the protocol (go to the data, compute and write, submit), not copy a name it never saw.
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
    """The write_word family's one-line solution."""
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


# largest_number ---------------------------------------------------------------------------------
TRAIN_NAMES = (
    "alpha", "bravo", "cargo", "delta", "ember", "fable", "gamma", "haven",
    "ivory", "jolly", "karma", "lunar", "mango", "noble", "opera", "pixel",
)  # fmt: skip
HELDOUT_NAMES = ("quartz", "rumba", "sable", "tango", "ultra", "vapor", "waltz", "yodel", "zebra", "umbra")
# One command per turn: go to the data, compute and write the answer (then the submit turn).
LARGEST_SOLUTION = ("cd /app/data", "sort -n * | tail -1 > /app/answer.txt")

_LARGEST_TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if [ -f /app/answer.txt ] && [ "$(tr -d '[:space:]' < /app/answer.txt)" = "{answer}" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


def largest_instruction(name: str, count: int) -> str:
    return (
        f"The file /app/data/{name}.txt holds {count} numbers, one per line. "
        "Write the largest of them into /app/answer.txt, then submit.\n"
    )


def write_largest_task(root: str | Path, seed: int, *, heldout: bool = False) -> Path:
    """Task number ``seed`` of the largest_number family: the file name comes from the held-out or the
    training list, the numbers (3..9 of them, 10..999, distinct) from the seed."""
    rng = random.Random(f"largest_number:{seed}")
    name = rng.choice(HELDOUT_NAMES if heldout else TRAIN_NAMES)
    count = rng.randint(3, 9)
    numbers = rng.sample(range(10, 1000), count)
    d = Path(root) / f"largest_number_{seed:05d}"
    if d.exists():
        shutil.rmtree(d)
    (d / "environment" / "data").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "instruction.md").write_text(largest_instruction(name, count))
    (d / "task.toml").write_text(_TASK_TOML.format(seed=seed).replace('"write_word"', '"largest_number"'))
    (d / "environment" / "data" / f"{name}.txt").write_text("".join(f"{n}\n" for n in numbers))
    (d / "environment" / "Dockerfile").write_text("FROM ubuntu:24.04\nWORKDIR /app\nCOPY data/ /app/data/\n")
    (d / "tests" / "test.sh").write_text(_LARGEST_TEST_SH.format(answer=max(numbers)))
    # The demonstration replays each line as a turn of its own (train/rollout.py: solution_commands).
    (d / "solution" / "solve.sh").write_text(
        "#!/bin/bash\n# tmax-jax: one turn per line\n" + "".join(f"{c}\n" for c in LARGEST_SOLUTION)
    )
    return d


DEMO_FAMILIES = ("write_word", "largest_number")


def write_demo_task(
    family: str, root: str | Path, seed: int, *, heldout: bool, words: int = len(WORDS)
) -> Path:
    """One task of demo ``family``; held-out tasks of ``largest_number`` use the held-out names."""
    if family == "write_word":
        return write_task(root, seed, num_words=words)
    if family == "largest_number":
        return write_largest_task(root, seed, heldout=heldout)
    raise ValueError(f"unknown demo family {family!r} (known: {list(DEMO_FAMILIES)})")
