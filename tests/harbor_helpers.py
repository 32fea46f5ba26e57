"""Small Harbor-format tasks written by tests: bash verifiers (no pytest start-up) over an ubuntu
Dockerfile, each writing the Harbor reward file."""

from __future__ import annotations

import textwrap
from pathlib import Path

TASK_TOML = """\
version = "1.0"
[metadata]
category = "{category}"
difficulty = "easy"
[verifier]
timeout_sec = 30.0
[agent]
timeout_sec = 30.0
[environment]
build_timeout_sec = 60.0
allow_internet = false
"""

# Verifiers in plain bash (no pytest start-up), each writing the Harbor reward file.
REWARD_IF = "mkdir -p /logs/verifier\nif {cond}; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi\n"


def write_harbor_task(
    root: Path, name: str, category: str, instruction: str, dockerfile: str, test_cond: str, solution: dict
):
    d = root / name
    (d / "environment").mkdir(parents=True)
    (d / "tests").mkdir()
    (d / "solution").mkdir()
    (d / "instruction.md").write_text(instruction)
    (d / "task.toml").write_text(TASK_TOML.format(category=category))
    (d / "environment" / "Dockerfile").write_text(textwrap.dedent(dockerfile))
    (d / "tests" / "test.sh").write_text("#!/bin/bash\n" + REWARD_IF.format(cond=test_cond))
    for fname, body in solution.items():
        (d / "solution" / fname).write_text("#!/bin/bash\nset -e\n" + body)
    return d
