"""The nine task axes of TMAX's compositional sampler, read from ``configs/task_axes.yaml``.

A signature is one draw: domain, skill_type, primitive_skill, persona (these four hierarchical:
skills and personas belong to a domain), fixture_kind, task_complexity, command_complexity and
verifier_kind. Draws are seeded (same seed, same signatures) and follow the configured weights,
re-weighted per corpus kind (``legacy``, ``sft_v2``, ``rl_v2``). Each task's ``task.json`` stores its
signature under ``axes``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tmax_jax.config import load_yaml
from tmax_jax.errors import ConfigError

AXES_FILE = Path(__file__).resolve().parents[2] / "configs" / "task_axes.yaml"
FLAT_AXES = ("fixture_kind", "task_complexity", "command_complexity", "verifier_kind")
AXIS_NAMES = ("domain", "skill_type", "primitive_skill", "persona", *FLAT_AXES)


@dataclass(frozen=True)
class Signature:
    domain: str
    skill_type: str
    primitive_skill: str
    persona: str
    fixture_kind: str
    task_complexity: str
    command_complexity: str
    verifier_kind: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


class AxisSampler:
    """``sample(rng)`` -> Signature; ``marginals()`` -> the exact probability of every value."""

    def __init__(self, spec: dict[str, Any], corpus_kind: str = "rl_v2"):
        self.corpus_kind = corpus_kind
        domains = spec.get("domains")
        if not isinstance(domains, dict) or not domains:
            raise ConfigError("task axes: 'domains' must be a non-empty mapping")
        kinds = spec.get("corpus_kinds", {})
        if corpus_kind not in kinds:
            raise ConfigError(
                f"task axes: unknown corpus kind {corpus_kind!r} (known: {', '.join(sorted(kinds))})"
            )
        mult = kinds[corpus_kind] or {}
        axes = spec.get("axes", {})
        for a in FLAT_AXES:
            if a not in axes:
                raise ConfigError(f"task axes: missing axis {a!r}")
        for a, m in mult.items():
            if a not in (*FLAT_AXES, "domain"):
                raise ConfigError(f"task axes: corpus kind {corpus_kind!r} re-weights unknown axis {a!r}")
            known = axes[a] if a != "domain" else domains
            for v in m:
                if v not in known:
                    raise ConfigError(
                        f"task axes: corpus kind {corpus_kind!r}: unknown value {v!r} of axis {a!r}"
                    )
        self.domains: dict[str, dict] = {}
        self.domain_w: dict[str, float] = {}
        for name, d in domains.items():
            if not d.get("personas") or not d.get("skills"):
                raise ConfigError(f"task axes: domain {name!r} needs personas and skills")
            self.domains[name] = d
            self.domain_w[name] = float(d.get("weight", 1.0)) * float(mult.get("domain", {}).get(name, 1.0))
        self.flat: dict[str, dict[str, float]] = {
            a: {v: float(w) * float(mult.get(a, {}).get(v, 1.0)) for v, w in axes[a].items()}
            for a in FLAT_AXES
        }
        for a, ws in {"domain": self.domain_w, **self.flat}.items():
            if any(w < 0 for w in ws.values()) or sum(ws.values()) <= 0:
                raise ConfigError(f"task axes: weights of {a!r} must be >= 0 with a positive sum")

    @classmethod
    def from_yaml(cls, path: str | Path = AXES_FILE, corpus_kind: str = "rl_v2") -> AxisSampler:
        return cls(load_yaml(path), corpus_kind)

    @staticmethod
    def _pick(rng: random.Random, weights: dict[str, float]) -> str:
        names = list(weights)
        return rng.choices(names, weights=[weights[n] for n in names], k=1)[0]

    def sample(self, rng: random.Random, **fixed: str) -> Signature:
        """One signature; ``fixed`` pins axes (e.g. ``domain="security"``) and samples the rest."""
        for k in fixed:
            if k not in AXIS_NAMES:
                raise ConfigError(f"unknown axis {k!r} (known: {', '.join(AXIS_NAMES)})")
        domain = fixed.get("domain") or self._pick(rng, self.domain_w)
        d = self.domains[domain]
        skill_type = fixed.get("skill_type") or rng.choice(sorted(d["skills"]))
        primitive = fixed.get("primitive_skill") or rng.choice(list(d["skills"][skill_type]))
        persona = fixed.get("persona") or rng.choice(list(d["personas"]))
        rest = {a: fixed.get(a) or self._pick(rng, self.flat[a]) for a in FLAT_AXES}
        return Signature(domain, skill_type, primitive, persona, **rest)

    def marginals(self) -> dict[str, dict[str, float]]:
        out = {}
        for a, ws in {"domain": self.domain_w, **self.flat}.items():
            total = sum(ws.values())
            out[a] = {v: w / total for v, w in ws.items()}
        return out
