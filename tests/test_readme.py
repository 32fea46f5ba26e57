"""README.md is a guide a new user follows: every `tmax-jax` command it shows must parse with the
real argument parser, every config it names must load, and it stays a guide (no dated history)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tmax_jax.cli import build_parser
from tmax_jax.train.config import load_train_config

README = Path(__file__).resolve().parents[1] / "README.md"
TEXT = README.read_text()


def _commands() -> list[str]:
    """Every ``tmax-jax ...`` line of the README's code blocks, comments dropped."""
    out = []
    for block in re.findall(r"```bash\n(.*?)```", TEXT, re.S):
        for line in block.splitlines():
            line = line.split(" # ")[0].strip()
            for part in line.split("&&"):
                part = part.strip()
                if part.startswith("tmax-jax "):
                    out.append(part)
    return out


COMMANDS = _commands()
CONFIGS = sorted(set(re.findall(r"configs/[\w.-]+\.yaml", TEXT)))


def test_readme_shows_the_main_commands():
    subs = {shlex.split(c)[1] for c in COMMANDS}
    assert {"train", "eval", "run-task", "generate-tasks", "serve", "plan", "export-hf", "sft"} <= subs
    assert "bash scripts/setup.sh && tmax-jax train configs/tiny-cpu.yaml" in TEXT
    assert "python3 -m pytest -q -n 2 --dist loadfile tests" in TEXT


@pytest.mark.parametrize("command", COMMANDS)
def test_readme_command_parses(command):
    argv = shlex.split(command)[1:]
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # argparse's way of refusing a command line
        pytest.fail(f"README command does not parse: {command!r} (exit {e.code})")
    assert args.command == argv[0]


@pytest.mark.parametrize("path", CONFIGS)
def test_readme_config_exists_and_loads(path):
    p = README.parent / path
    assert p.is_file(), f"README names {path}, which does not exist"
    if p.name != "task_axes.yaml":
        load_train_config(p)


def test_every_shipped_config_is_in_the_readme():
    shipped = {f"configs/{p.name}" for p in (README.parent / "configs").glob("*.yaml")}
    assert shipped <= set(CONFIGS), sorted(shipped - set(CONFIGS))


def test_readme_is_a_guide_not_a_notebook():
    assert len(TEXT.splitlines()) <= 250
    # Dated measurements belong in benchmarks/RESULTS.md.
    assert not re.search(r"\b20\d\d-\d\d-\d\d\b", TEXT)
