"""The comparison of a study's variants: numbers per run, per variant over seeds, and a verdict each.

Per run (``run_record``): the held-out pass rate before and after RL and its gain, the train pass
rate and reward per step, the off-policy metrics (trainer-engine logprob mismatch, the fraction of
tokens DPPO masked, staleness), training tokens/s and wall time, and the study eval's pass@1 when the
study has one. Per variant (``variant_stats``): each number's mean over seeds with a 95% Student-t
interval. Against the baseline (``verdict``): Welch's t interval of the difference of mean held-out
gains; a difference whose interval holds 0 is called within noise.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from tmax_jax.study.spec import Study

# Two-sided 95% quantiles of Student's t (t_{0.975, df}), df = 1..30; past 30 the normal's 1.960
# is within 2%.
_T975 = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip

# Per-step metrics averaged over a run's steps, as the table names them.
STEP_METRICS = {
    "mismatch": "mismatch/mean_abs_logprob_diff",
    "masked_fraction": "masked_fraction",
    "staleness_max": "staleness_max",
    "train_tokens_per_s": "train_tokens_per_s",
}


def t975(df: float) -> float:
    """t_{0.975, df} for a (possibly fractional, Welch) df >= 1: the table, linear in between."""
    if df > len(_T975):
        return 1.960
    lo = max(int(math.floor(df)), 1)
    frac = df - lo
    hi = min(lo + 1, len(_T975))
    return _T975[lo - 1] + frac * (_T975[hi - 1] - _T975[lo - 1])


def mean_ci(values: list[float]) -> dict[str, Any]:
    """Mean, sample standard deviation and the 95% t interval's half-width (None below 2 values)."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return {"n": 0, "mean": None, "std": None, "ci95": None}
    mean = float(np.mean(xs))
    if len(xs) < 2:
        return {"n": 1, "mean": mean, "std": None, "ci95": None}
    std = float(np.std(xs, ddof=1))
    return {"n": len(xs), "mean": mean, "std": std, "ci95": t975(len(xs) - 1) * std / math.sqrt(len(xs))}


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def run_record(study: Study, variant: str, seed: int) -> dict[str, Any] | None:
    """What one finished run measured (None: not finished)."""
    run = study.run_dir(variant, seed)
    path = run / "summary.json"
    if not path.is_file():
        return None
    s = json.loads(path.read_text())
    rows = _read_jsonl(run / "metrics.jsonl")
    rec: dict[str, Any] = {
        "variant": variant,
        "seed": seed,
        "run_dir": str(run),
        "steps": s.get("steps"),
        "heldout_before": s["pass_rate_before"],
        "heldout_after": s["pass_rate_after"],
        "heldout_gain": s["pass_rate_after"] - s["pass_rate_before"],
        "train_pass_rate": [[r["step"], r["pass_rate"]] for r in rows if r.get("pass_rate") is not None],
        "reward": [[r["step"], r["reward_mean"]] for r in rows if r.get("reward_mean") is not None],
        "heldout_curve": [[0, s["pass_rate_before"]], *s.get("heldout_pass_rate_per_eval", [])],
    }
    for name, key in STEP_METRICS.items():
        vals = [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))]
        rec[name] = float(np.mean(vals)) if vals else None
    meta = run / "study_run.json"
    rec["wall_s"] = json.loads(meta.read_text()).get("wall_s") if meta.is_file() else None
    ev = run / "study_eval" / "summary.json"
    rec["eval_pass_at_1"] = json.loads(ev.read_text())["overall"]["pass_at"]["1"] if ev.is_file() else None
    return rec


def variant_stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Each number's mean and 95% interval over a variant's seeds."""
    keys = ["heldout_before", "heldout_after", "heldout_gain", *STEP_METRICS, "wall_s", "eval_pass_at_1"]
    out: dict[str, Any] = {"seeds": [r["seed"] for r in records]}
    for k in keys:
        out[k] = mean_ci([r[k] for r in records if r.get(k) is not None])
    return out


def verdict(base: list[float], other: list[float], points: float = 100.0) -> dict[str, Any]:
    """The difference of mean gains (other - base) with Welch's 95% t interval, and what it says."""
    a = [float(x) for x in base]
    b = [float(x) for x in other]
    if not a or not b:
        return {"diff": None, "ci95": None, "text": "no finished runs to compare"}
    diff = float(np.mean(b) - np.mean(a))
    if len(a) < 2 or len(b) < 2:
        return {"diff": diff, "ci95": None, "text": f"{diff * points:+.1f} points (one seed: no interval)"}
    va, vb = np.var(a, ddof=1) / len(a), np.var(b, ddof=1) / len(b)
    se = math.sqrt(va + vb)
    if se == 0:
        ci = 0.0
    else:
        df = (va + vb) ** 2 / ((va**2) / (len(a) - 1) + (vb**2) / (len(b) - 1)) if (va or vb) else 1.0
        ci = t975(max(df, 1.0)) * se
    lo, hi = diff - ci, diff + ci
    span = f"{diff * points:+.1f} points (95% CI {lo * points:+.1f} to {hi * points:+.1f})"
    if lo <= 0 <= hi:
        text = f"within noise: {span}"
    else:
        text = f"{'better' if diff > 0 else 'worse'} than the baseline: {span}"
    return {"diff": diff, "ci95": ci, "text": text}


def compare(study: Study) -> dict[str, Any]:
    """The whole comparison: every finished run's record, each variant's stats and verdict."""
    records = {
        v: [r for s in study.seeds if (r := run_record(study, v, s)) is not None] for v in study.variants
    }
    base_gains = [r["heldout_gain"] for r in records[study.baseline]]
    variants = {}
    for v, recs in records.items():
        stats = variant_stats(recs)
        if v == study.baseline:
            stats["verdict"] = {"diff": 0.0, "ci95": None, "text": "baseline"}
        else:
            stats["verdict"] = verdict(base_gains, [r["heldout_gain"] for r in recs])
        variants[v] = stats
    return {
        "study": str(study.path),
        "description": study.description,
        "baseline": study.baseline,
        "seeds": list(study.seeds),
        "runs": {v: recs for v, recs in records.items()},
        "variants": variants,
        "missing": [
            study.run_name(v, s) for v, s in study.runs() if s not in {r["seed"] for r in records[v]}
        ],
    }
