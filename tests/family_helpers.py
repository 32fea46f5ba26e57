"""Shared helpers for the tests of the procedural task families: one family's task dir, the
working dir its prompt names."""

from __future__ import annotations

import random
import re
from pathlib import Path

from tmax_jax.tasks.axes import Signature
from tmax_jax.tasks.generator import all_families
from tmax_jax.tasks.generator.base import write_tmax_dir
from tmax_jax.tasks.loader import load_task


def family_signature(family: str, complexity: str = "short") -> tuple:
    """(family, a signature of its own axes with persona "tester" at ``complexity``)."""
    fam = all_families()[family]
    sig = Signature(
        fam.domain, fam.skill_type, fam.primitive_skill, "tester", fam.fixture_kind, complexity,
        fam.command_complexity, fam.verifier_kind,
    )  # fmt: skip
    return fam, sig


def draft_dir(tmp_path: Path, family: str, seed: str, complexity: str = "short") -> Path:
    """A TMAX task dir of ``family`` drawn with ``seed``, under ``tmp_path``."""
    fam, sig = family_signature(family, complexity)
    return write_tmax_dir(
        fam.make(random.Random(seed), sig), sig.to_dict(), tmp_path / f"{family}-{seed}", family, 0
    )


def dir_of(d: Path, name: str) -> str:
    """The task's working dir, as its prompt names it (``<dir>/<name>``)."""
    return re.search(rf"(/[^\s'\"]+)/{re.escape(name)}", load_task(d).instruction).group(1)
