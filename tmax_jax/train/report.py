"""The end of a run: summary.json, the learning curve and the before/after HTML report."""

from __future__ import annotations

import json

import numpy as np

from tmax_jax.distributed import is_primary
from tmax_jax.figures import learning_curve_figure, save_png
from tmax_jax.train.rollout import pass_rates_by_group


def summary(run, before: dict, after: dict, step: int) -> dict:
    rows = run.metrics.read()
    return {
        "run_dir": str(run.run_dir),
        "steps": step,
        "policy_init": str(run.policy_init),
        "harness": run.cfg.agent.harness,
        "pass_rate_before": before["pass_rate"],
        "pass_rate_after": after["pass_rate"],
        "reward_before": before["reward_mean"],
        "reward_after": after["reward_mean"],
        "heldout_tasks": len(run.heldout_tasks),
        "samples_per_task": run.cfg.eval.samples_per_task,
        "train_pass_rate_per_step": [r.get("pass_rate") for r in rows],
        "heldout_pass_rate_per_eval": [
            [r["step"], r["heldout_pass_rate"]] for r in rows if r.get("heldout_pass_rate") is not None
        ],
        "episode_turns_mean": float(np.mean([r["episode_turns_mean"] for r in rows])) if rows else None,
        "heldout_turns_mean_after": after.get("turns_mean"),
        **{f"pass_rate_{k}": v for k, v in pass_rates_by_group(run.heldout_tasks, before, after).items()},
    }


def learning_curve_points(rows: list[dict], before: dict, after: dict) -> tuple[list, list]:
    """(train, held-out) (step, pass rate) points: the train rate of every step, and the held-out rate
    at step 0 (before RL), at each ``eval.every`` step and at the last step (after RL)."""
    train = [(r["step"], r["pass_rate"]) for r in rows if r.get("pass_rate") is not None]
    held = [(0, before["pass_rate"])]
    held += [(r["step"], r["heldout_pass_rate"]) for r in rows if r.get("heldout_pass_rate") is not None]
    held.append((rows[-1]["step"] if rows else 0, after["pass_rate"]))
    return train, held


def plot(run, before: dict, after: dict) -> None:
    train, held = learning_curve_points(run.metrics.read(), before, after)
    fig = learning_curve_figure(train, held, title="tmax-jax DPPO: pass rate per step")
    save_png(fig, run.run_dir / "learning_curve.png")


def write_report(run, before: dict, after: dict, step: int) -> dict:
    """summary.json, learning_curve.png and eval_report.html (process 0); returns the summary."""
    out = summary(run, before, after, step)
    if is_primary():
        (run.run_dir / "summary.json").write_text(json.dumps(out, indent=2))
        plot(run, before, after)
        from tmax_jax.eval.html_report import render_before_after_html

        (run.run_dir / "eval_report.html").write_text(render_before_after_html(out))
    return out
