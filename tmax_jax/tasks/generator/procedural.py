"""The procedural generator: sample a signature, pick the family that fits it best, draft the task.

Families fix some axes (domain, skills, verifier and fixture kinds, command complexity); the persona
and task complexity of the draw shape the wording and the data sizes. The stored signature is what
the task really is; the draw is kept beside it as ``requested_axes``.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

from tmax_jax.errors import ConfigError
from tmax_jax.tasks.axes import AxisSampler, Signature
from tmax_jax.tasks.generator.base import Family, TaskDraft, write_tmax_dir
from tmax_jax.tasks.generator.harbor_writer import write_harbor_dir
from tmax_jax.tasks.generator.registry import all_families

MATCH_WEIGHTS = {"domain": 4, "verifier_kind": 2, "fixture_kind": 2, "command_complexity": 1}


@dataclass
class Generated:
    path: Path
    family: str
    signature: dict[str, str]


class ProceduralGenerator:
    def __init__(self, sampler: AxisSampler | None = None, families: dict[str, Family] | None = None):
        self.sampler = sampler or AxisSampler.from_yaml()
        self.families = families or all_families()
        if not self.families:
            raise ConfigError("no procedural task families registered")

    def choose(self, rng: random.Random, sig: Signature) -> Family:
        def score(f: Family) -> int:
            return sum(w for axis, w in MATCH_WEIGHTS.items() if getattr(f, axis) == getattr(sig, axis))

        fams = sorted(self.families.values(), key=lambda f: f.name)
        best = max(score(f) for f in fams)
        return rng.choice([f for f in fams if score(f) == best])

    def draft(self, rng: random.Random) -> tuple[Family, TaskDraft, Signature, Signature]:
        want = self.sampler.sample(rng)
        fam = self.choose(rng, want)
        personas = self.sampler.domains[fam.domain]["personas"]
        persona = want.persona if want.persona in personas else rng.choice(list(personas))
        actual = Signature(
            fam.domain, fam.skill_type, fam.primitive_skill, persona, fam.fixture_kind, want.task_complexity,
            fam.command_complexity, fam.verifier_kind,
        )  # fmt: skip
        return fam, fam.make(rng, actual), actual, want

    def generate_one(self, out_root: Path, seed: int, index: int, fmt: str = "tmax") -> Generated:
        # Every task has its own stream, so task i is the same whatever n is.
        rng = random.Random(f"tmax-jax:{seed}:{index}")
        fam, draft, sig, want = self.draft(rng)
        digest = hashlib.sha256((draft.prompt + draft.final_check).encode()).hexdigest()[:8]
        name = f"{index:05d}-{fam.name}-{digest}"
        out = Path(out_root) / name
        if fmt == "tmax":
            write_tmax_dir(draft, sig.to_dict(), out, name, seed, requested=want.to_dict())
        elif fmt == "harbor":
            write_harbor_dir(draft, sig.to_dict(), out, name, seed)
        else:
            raise ConfigError(f"unknown task format {fmt!r} (tmax or harbor)")
        return Generated(out, fam.name, sig.to_dict())

    def generate_family(self, out_root: Path, family: str, seed: int, fmt: str = "harbor") -> Generated:
        """Task number ``seed`` of the named family (its own stream: the same task whatever else is
        generated), written to ``out_root/<family>-<seed>``. The family fixes its axes; the persona and
        task complexity are drawn from the sampler."""
        fam = self.families.get(family)
        if fam is None:
            raise ConfigError(f"unknown task family {family!r} (known: {', '.join(sorted(self.families))})")
        rng = random.Random(f"tmax-jax:{family}:{seed}")
        sig = self.sampler.sample(
            rng, domain=fam.domain, skill_type=fam.skill_type, primitive_skill=fam.primitive_skill,
            fixture_kind=fam.fixture_kind, command_complexity=fam.command_complexity,
            verifier_kind=fam.verifier_kind,
        )  # fmt: skip
        draft = fam.make(rng, sig)
        name = f"{family}-{seed:07d}"
        out = Path(out_root) / name
        if fmt == "tmax":
            write_tmax_dir(draft, sig.to_dict(), out, name, seed)
        elif fmt == "harbor":
            write_harbor_dir(draft, sig.to_dict(), out, name, seed)
        else:
            raise ConfigError(f"unknown task format {fmt!r} (tmax or harbor)")
        return Generated(out, fam.name, sig.to_dict())
