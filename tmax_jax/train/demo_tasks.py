"""Learnable task families for the CPU demo.

A tiny random model cannot solve real terminal tasks, but it can learn, from a short warm start and
then from reward, a short shell protocol. Each task is a real Harbor-format task (instruction.md,
task.toml, environment/Dockerfile, tests/test.sh, solution/solve.sh) graded in the sandbox like any
other.

* ``write_word``: write a given word into a file (one command).
* The data-file families (``DATA_FAMILIES``): ``largest_number`` (the largest of a file of
  numbers), ``count_errors`` (how many lines of a log contain ERROR), ``column_sum`` (the sum of a
  CSV's number column). A data file lies in /app/data; go there with one command, write the answer
  into /app/answer.txt with the family's own command, then submit (three turns). Training and
  held-out tasks draw their file names from disjoint word lists (``TRAIN_NAMES`` /
  ``HELDOUT_NAMES``) and their data from the seed, so no held-out instruction or answer is a
  training one. The commands read the file through a glob: the policy has to learn the protocol and
  which command each instruction asks for, not copy a name it never saw.
"""

from __future__ import annotations

import random
import shutil
from collections.abc import Callable
from dataclasses import dataclass
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


# Data-file families -------------------------------------------------------------------------------
TRAIN_NAMES = (
    "alpha", "bravo", "cargo", "delta", "ember", "fable", "gamma", "haven",
    "ivory", "jolly", "karma", "lunar", "mango", "noble", "opera", "pixel",
)  # fmt: skip
HELDOUT_NAMES = ("quartz", "rumba", "sable", "tango", "ultra", "vapor", "waltz", "yodel", "zebra", "umbra")

_ANSWER_TEST_SH = """#!/bin/bash
mkdir -p /logs/verifier
if [ -f /app/answer.txt ] && [ "$(tr -d '[:space:]' < /app/answer.txt)" = "{answer}" ]; then
  echo 1 > /logs/verifier/reward.txt
else
  echo 0 > /logs/verifier/reward.txt
fi
"""


@dataclass(frozen=True)
class DataFamily:
    """A family of three-turn tasks over one data file in /app/data: go there (``cd /app/data``),
    compute the answer into /app/answer.txt with the family's own command, submit. The families
    share the first and last turns and differ in the middle one, so a policy that scores on all of
    them reads the instruction to pick it."""

    name: str
    suffix: str  # the data file's extension
    # (name, count) -> the instruction; rng -> (file text, count, answer)
    instruction: Callable[[str, int], str]
    make: Callable[[random.Random], tuple[str, int, str]]
    command: str  # the middle turn, reading the file through a glob

    @property
    def solution(self) -> tuple[str, str]:
        return ("cd /app/data", self.command)

    def write(self, root: str | Path, seed: int, *, heldout: bool = False) -> Path:
        """Task number ``seed``: the file name from the held-out or the training list, the data from
        the seed."""
        rng = random.Random(f"{self.name}:{seed}")
        stem = rng.choice(HELDOUT_NAMES if heldout else TRAIN_NAMES)
        text, count, answer = self.make(rng)
        d = Path(root) / f"{self.name}_{seed:05d}"
        if d.exists():
            shutil.rmtree(d)
        (d / "environment" / "data").mkdir(parents=True)
        (d / "tests").mkdir()
        (d / "solution").mkdir()
        (d / "instruction.md").write_text(self.instruction(stem, count))
        (d / "task.toml").write_text(_TASK_TOML.format(seed=seed).replace('"write_word"', f'"{self.name}"'))
        (d / "environment" / "data" / f"{stem}.{self.suffix}").write_text(text)
        (d / "environment" / "Dockerfile").write_text(
            "FROM ubuntu:24.04\nWORKDIR /app\nCOPY data/ /app/data/\n"
        )
        (d / "tests" / "test.sh").write_text(_ANSWER_TEST_SH.format(answer=answer))
        # The demonstration replays each line as a turn of its own (train/rollout.py: solution_commands).
        (d / "solution" / "solve.sh").write_text(
            "#!/bin/bash\n# tmax-jax: one turn per line\n" + "".join(f"{c}\n" for c in self.solution)
        )
        return d


def largest_instruction(name: str, count: int) -> str:
    return (
        f"The file /app/data/{name}.txt holds {count} numbers, one per line. "
        "Write the largest of them into /app/answer.txt, then submit.\n"
    )


def _largest_data(rng: random.Random) -> tuple[str, int, str]:
    count = rng.randint(3, 9)
    numbers = rng.sample(range(10, 1000), count)
    return "".join(f"{n}\n" for n in numbers), count, str(max(numbers))


def _count_instruction(name: str, count: int) -> str:
    return (
        f"The log /app/data/{name}.log holds {count} lines. "
        "Write how many of them contain ERROR into /app/answer.txt, then submit.\n"
    )


def _count_data(rng: random.Random) -> tuple[str, int, str]:
    count = rng.randint(4, 9)
    errors = rng.randint(1, count - 1)
    lines = [f"ERROR job {rng.randint(1, 99)} failed" for _ in range(errors)]
    lines += [f"ok job {rng.randint(1, 99)} done" for _ in range(count - errors)]
    rng.shuffle(lines)
    return "".join(f"{ln}\n" for ln in lines), count, str(errors)


def _sum_instruction(name: str, count: int) -> str:
    return (
        f"The file /app/data/{name}.csv holds {count} rows of an item and a number. "
        "Write the sum of the numbers into /app/answer.txt, then submit.\n"
    )


def _sum_data(rng: random.Random) -> tuple[str, int, str]:
    count = rng.randint(3, 7)
    numbers = [rng.randint(1, 99) for _ in range(count)]
    rows = [f"item{i},{n}" for i, n in enumerate(numbers)]
    return "".join(f"{r}\n" for r in rows), count, str(sum(numbers))


DATA_FAMILIES = {
    f.name: f
    for f in (
        DataFamily(
            "largest_number",
            "txt",
            largest_instruction,
            _largest_data,
            "sort -n * | tail -1 > /app/answer.txt",
        ),
        DataFamily(
            "count_errors", "log", _count_instruction, _count_data, "grep -c ERROR * > /app/answer.txt"
        ),
        DataFamily(
            "column_sum",
            "csv",
            _sum_instruction,
            _sum_data,
            "awk -F, '{s+=$2} END {print s}' * > /app/answer.txt",
        ),
    )
}
LARGEST_SOLUTION = DATA_FAMILIES["largest_number"].solution


def write_largest_task(root: str | Path, seed: int, *, heldout: bool = False) -> Path:
    """Task number ``seed`` of the largest_number family (3..9 distinct numbers, 10..999)."""
    return DATA_FAMILIES["largest_number"].write(root, seed, heldout=heldout)


DEMO_FAMILIES = ("write_word", *DATA_FAMILIES)


def write_demo_task(
    family: str, root: str | Path, seed: int, *, heldout: bool, words: int = len(WORDS)
) -> Path:
    """One task of demo ``family``; held-out tasks of the data-file families use the held-out names."""
    if family == "write_word":
        return write_task(root, seed, num_words=words)
    if family in DATA_FAMILIES:
        return DATA_FAMILIES[family].write(root, seed, heldout=heldout)
    raise ValueError(f"unknown demo family {family!r} (known: {list(DEMO_FAMILIES)})")
