"""``tmax-jax study``: the spec's errors, the statistics against float64 references, and a
two-variant, two-seed micro-study run end to end whose table is checked against the runs' own
summaries (and which a second invocation does not rerun)."""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from train_helpers import TINY_ARGS, train_env

from tmax_jax.errors import ConfigError
from tmax_jax.study import commands, load_study
from tmax_jax.study.compare import mean_ci, t975, verdict

ROOT = Path(__file__).resolve().parents[1]


def _t_cdf(x: float, df: float) -> float:
    """Student's t CDF by integrating its density (float64, Simpson's rule): the reference."""
    grid = np.linspace(0.0, x, 20001)
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    pdf = c * (1 + grid**2 / df) ** (-(df + 1) / 2)
    h = grid[1] - grid[0]
    integral = h / 3 * (pdf[0] + pdf[-1] + 4 * pdf[1:-1:2].sum() + 2 * pdf[2:-1:2].sum())
    return 0.5 + integral


@pytest.mark.parametrize("df", [1, 2, 3, 5, 9, 17, 30])
def test_t_quantiles_match_the_t_distribution(df):
    assert _t_cdf(t975(df), df) == pytest.approx(0.975, abs=2e-4)


def test_mean_ci_and_verdict_against_numpy():
    xs = [0.25, 0.40, 0.31]
    got = mean_ci(xs)
    sd = float(np.std(np.array(xs, dtype=np.float64), ddof=1))
    assert got["mean"] == pytest.approx(np.mean(xs)) and got["std"] == pytest.approx(sd)
    assert got["ci95"] == pytest.approx(4.303 * sd / math.sqrt(3))
    assert mean_ci([0.5])["ci95"] is None and mean_ci([])["mean"] is None
    base, same = [0.20, 0.30, 0.25], [0.22, 0.28, 0.27]
    assert verdict(base, same)["text"].startswith("within noise")
    far = verdict(base, [0.60, 0.65, 0.62])
    a, b = np.array(base), np.array([0.60, 0.65, 0.62])
    va, vb = a.var(ddof=1) / 3, b.var(ddof=1) / 3
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 2)
    assert far["diff"] == pytest.approx(b.mean() - a.mean())
    assert far["ci95"] == pytest.approx(t975(df) * math.sqrt(va + vb))
    assert far["text"].startswith("better than the baseline")
    assert verdict(base, [0.0, 0.02, 0.01])["text"].startswith("worse")


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_study_file_errors_name_the_problem(tmp_path):
    base = ROOT / "configs" / "tiny-cpu.yaml"
    cases = {
        "variants: {a: {}}\n": "needs 'base'",
        f"base: {base}\nvariants: {{}}\n": "non-empty mapping",
        f"base: {base}\nvariants: {{a: {{}}}}\nseeds: [0, 0]\n": "seeds repeat",
        f"base: {base}\nvariants: {{a: {{}}}}\nbaseline: b\n": "baseline 'b' is not a variant",
        f"base: {base}\nvariants: {{a: {{}}}}\nsteps: 3\n": "unknown study key 'steps'",
        f"base: {base}\nvariants: {{a: {{rl.loss.nmae: grpo}}}}\n": "variant 'a'",
        f"base: {base}\nvariants: {{'a b': {{}}}}\n": "variant name",
        "base: nowhere.yaml\nvariants: {a: {}}\n": "not found",
    }
    for i, (text, want) in enumerate(cases.items()):
        with pytest.raises(ConfigError, match=want.replace("(", r"\(")):
            load_study(_write(tmp_path / f"s{i}.yaml", text))


def test_shipped_studies_load_and_print_their_commands():
    for path in sorted((ROOT / "configs" / "studies").glob("*.yaml")):
        study = load_study(path)
        lines = commands(study)
        assert len(lines) == len(study.variants) * len(study.seeds), path
        assert all(ln.startswith(f"tmax-jax train {ROOT}/configs/tiny-cpu.yaml ") for ln in lines), path


MICRO = [*TINY_ARGS, "steps=1", "tasks.num_heldout=1", "rollout_workers=2"]


def test_micro_study_end_to_end(tmp_path):
    """Two variants x two seeds of a one-step run; the table's numbers are the runs' own."""
    sets = "\n".join(f"  {a.split('=', 1)[0]}: {a.split('=', 1)[1]}" for a in MICRO)
    spec = _write(
        tmp_path / "micro.yaml",
        f"base: {ROOT / 'configs' / 'tiny-cpu.yaml'}\nout: {tmp_path / 'out'}\nseeds: [0, 1]\n"
        f"set:\n{sets}\nvariants:\n  dppo: {{}}\n  grpo: {{rl.loss.name: grpo}}\n",
    )
    cmd = [sys.executable, "-m", "tmax_jax", "study", str(spec)]
    r = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    out = tmp_path / "out"
    comparison = json.loads((out / "comparison.json").read_text())
    assert comparison["missing"] == [] and set(comparison["variants"]) == {"dppo", "grpo"}
    with (out / "comparison.csv").open() as f:
        table = {row["variant"]: row for row in csv.DictReader(f)}
    for variant in ("dppo", "grpo"):
        sums = [json.loads((out / "runs" / f"{variant}-s{s}" / "summary.json").read_text()) for s in (0, 1)]
        before = [s["pass_rate_before"] for s in sums]
        after = [s["pass_rate_after"] for s in sums]
        stats = comparison["variants"][variant]
        assert stats["heldout_before"]["mean"] == pytest.approx(np.mean(before))
        assert stats["heldout_after"]["mean"] == pytest.approx(np.mean(after))
        gains = np.array(after) - np.array(before)
        assert stats["heldout_gain"]["mean"] == pytest.approx(gains.mean())
        # The table shows the same numbers, in points.
        assert table[variant]["held-out after"].split(" ± ")[0] == f"{100 * np.mean(after):.1f}"
        assert table[variant]["seeds"] == "2"
    assert table["dppo"]["verdict"] == "baseline" and table["grpo"]["verdict"]
    html = (out / "comparison.html").read_text()
    assert html.count("<tr>") == 3 and "data:image/png;base64," in html
    # A second invocation reruns nothing: every run is finished.
    walls = {p: json.loads(p.read_text()) for p in sorted(out.glob("runs/*/study_run.json"))}
    r2 = subprocess.run(cmd, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=300)
    assert r2.returncode == 0 and r2.stdout.count("finished before, not rerun") == 4, r2.stdout
    assert {p: json.loads(p.read_text()) for p in walls} == walls
