"""A study: one base train config, named variants of it, seeds, and an optional eval task set.

```yaml
base: configs/tiny-cpu.yaml        # a train config (relative paths: to the study file's folder, then cwd)
set: {steps: 24}                   # overrides every run gets
variants:                          # name -> overrides; the first is the baseline unless `baseline` says
  dppo_tv: {}
  grpo: {rl.loss.name: grpo}
seeds: [0, 1, 2]
baseline: dppo_tv
out: runs/studies/loss             # the study dir; one run dir per variant and seed under runs/
eval: {tasks: tests/tasks, k: 2}   # optional: every trained policy also evaluated on this task set
```

Overrides are what ``tmax-jax train --set`` takes: a dotted key (``rl.loss.name``) and a value,
which may be a mapping (``tasks.families: {a: 1, b: 1}``); a variant's key replaces the same key of
``set``. The run's own ``seed`` comes from ``seeds``. Every variant's full config is loaded (``load_train_config``) when the study is, so a
misspelt key fails before any run starts.
"""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import yaml

from tmax_jax.config import load_yaml, parse_dotted
from tmax_jax.errors import ConfigError

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_KEYS = {"base", "set", "variants", "seeds", "baseline", "out", "eval", "description"}
_EVAL_KEYS = {"tasks", "k", "concurrency"}


@dataclasses.dataclass(frozen=True)
class StudyEval:
    tasks: Path
    k: int = 1
    concurrency: int = 2


@dataclasses.dataclass(frozen=True)
class Study:
    path: Path
    base: Path
    common: dict[str, Any]
    variants: dict[str, dict[str, Any]]
    seeds: tuple[int, ...]
    baseline: str
    out: Path
    eval: StudyEval | None = None
    description: str = ""

    def run_name(self, variant: str, seed: int) -> str:
        return f"{variant}-s{seed}"

    def run_dir(self, variant: str, seed: int) -> Path:
        return self.out / "runs" / self.run_name(variant, seed)

    def overrides(self, variant: str, seed: int) -> dict[str, Any]:
        """The run's overrides as dotted keys, later entries winning: the study's, the variant's, the
        seed and the run dir."""
        out = {**self.common, **self.variants[variant]}
        out["seed"] = seed
        out["run_dir"] = str(self.run_dir(variant, seed))
        return out

    def runs(self) -> list[tuple[str, int]]:
        """Every (variant, seed), seed-major: an interrupted study has every variant at the low seeds."""
        return [(v, s) for s in self.seeds for v in self.variants]


def nested(dotted: dict[str, Any]) -> dict[str, Any]:
    """``{"rl.loss.name": "grpo"}`` -> ``{"rl": {"loss": {"name": "grpo"}}}`` (what ``override`` takes)."""
    return parse_dotted([f"{k}={yaml_value(v)}" for k, v in dotted.items()])


def yaml_value(v: Any) -> str:
    """``v`` as the one-line YAML that ``--set key=VALUE`` parses back to ``v``."""
    text = yaml.safe_dump(v, default_flow_style=True, width=1 << 20).strip()
    return text.removesuffix("\n...").strip()


def _resolve(path: str, study_dir: Path) -> Path:
    p = Path(path)
    if p.is_absolute():
        return p
    beside = Path(os.path.normpath(study_dir / p))
    return beside if beside.exists() else p


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return value


def load_study(path: str | Path, out: str | Path | None = None) -> Study:
    """Read and check a study file (every variant's config loads); ``out`` replaces its ``out``."""
    from tmax_jax.train.config import load_train_config

    path = Path(path)
    doc = load_yaml(path)  # errors name a missing file, bad YAML or a top level that is no mapping
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise ConfigError(f"{path}: unknown study key {unknown[0]!r} (known: {', '.join(sorted(_KEYS))})")
    for key in ("base", "variants"):
        if key not in doc:
            raise ConfigError(f"{path}: the study needs {key!r}")
    base = _resolve(str(doc["base"]), path.parent)
    if not base.is_file():
        raise ConfigError(f"{path}: base config {doc['base']!r} not found")
    variants = doc["variants"]
    if not isinstance(variants, dict) or not variants:
        raise ConfigError(f"{path}: variants must be a non-empty mapping of name -> overrides")
    for name, ov in variants.items():
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"{path}: variant name {name!r} must be letters, digits, '_', '.', '-'")
        if ov is not None and not isinstance(ov, dict):
            raise ConfigError(f"{path}: variant {name!r} must map config keys to values, got {ov!r}")
    variants = {str(k): dict(v or {}) for k, v in variants.items()}
    seeds = doc.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise ConfigError(f"{path}: seeds must be a non-empty list of non-negative integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"{path}: seeds repeat: {seeds}")
    baseline = str(doc.get("baseline", next(iter(variants))))
    if baseline not in variants:
        raise ConfigError(f"{path}: baseline {baseline!r} is not a variant ({', '.join(variants)})")
    common = doc.get("set") or {}
    if not isinstance(common, dict):
        raise ConfigError(f"{path}: set must map config keys to values")
    ev = doc.get("eval")
    study_eval = None
    if ev is not None:
        if not isinstance(ev, dict) or "tasks" not in ev or set(ev) - _EVAL_KEYS:
            raise ConfigError(f"{path}: eval must be a mapping with tasks (and k, concurrency), got {ev!r}")
        tasks = _resolve(str(ev["tasks"]), path.parent)
        if not tasks.is_dir():
            raise ConfigError(f"{path}: eval task dir {ev['tasks']!r} not found")
        study_eval = StudyEval(
            tasks,
            _positive_int(ev.get("k", 1), "eval.k"),
            _positive_int(ev.get("concurrency", 2), "eval.concurrency"),
        )
    out_dir = Path(out) if out is not None else Path(doc.get("out") or Path("runs") / "studies" / path.stem)
    study = Study(
        path=path,
        base=base,
        common=dict(common),
        variants=variants,
        seeds=tuple(seeds),
        baseline=baseline,
        out=out_dir,
        eval=study_eval,
        description=str(doc.get("description") or ""),
    )
    for variant in variants:
        try:
            load_train_config(base, nested(study.overrides(variant, seeds[0])))
        except ConfigError as e:
            raise ConfigError(f"{path}: variant {variant!r}: {e}") from None
    return study
