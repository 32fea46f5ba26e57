"""From attempt records to the numbers of a report: per task, per category, overall pass@k."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from tmax_jax.eval.passk import mean_pass_at_k, pass_at_k
from tmax_jax.eval.results import UNSCORED, AttemptRecord, records_by_task

UNCATEGORIZED = "uncategorized"


def report_ks(k: int) -> list[int]:
    """1, the powers of two below k, and k: the points of the pass@k curve."""
    ks = {1, k}
    p = 2
    while p < k:
        ks.add(p)
        p *= 2
    return sorted(ks)


def _task_row(
    task_id: str, category: str, recs: Sequence[AttemptRecord], ks: Sequence[int]
) -> dict[str, Any]:
    unavailable = [r for r in recs if r.status in UNSCORED]
    scored = [r for r in recs if r.status not in UNSCORED]
    row: dict[str, Any] = {
        "task_id": task_id,
        "category": category,
        "attempts": len(scored),
        "passes": sum(r.passed for r in scored),
        "errors": sum(r.status == "error" for r in scored),
        "mean_reward": float(np.mean([r.reward for r in scored])) if scored else None,
        "mean_duration_s": float(np.mean([r.duration_s for r in recs])) if recs else None,
    }
    if unavailable:
        row["status"] = unavailable[-1].status
        row["reason"] = unavailable[-1].reason
    elif not scored:
        row["status"] = "not_run"
    else:
        row["status"] = "evaluated"
    n, c = row["attempts"], row["passes"]
    row["pass_at"] = {
        str(j): (pass_at_k(n, c, j) if row["status"] == "evaluated" and n >= j else None) for j in ks
    }
    return row


def _group_stats(rows: Sequence[Mapping[str, Any]], ks: Sequence[int]) -> dict[str, Any]:
    evaluated = [r for r in rows if r["status"] == "evaluated"]
    counts = [(r["attempts"], r["passes"]) for r in evaluated]
    rewards = [r["mean_reward"] for r in evaluated]
    return {
        "tasks": len(rows),
        "evaluated": len(evaluated),
        "env_unavailable": sum(r["status"] == "env_unavailable" for r in rows),
        "invalid": sum(r["status"] == "invalid" for r in rows),
        "not_run": sum(r["status"] == "not_run" for r in rows),
        "attempts": sum(r["attempts"] for r in evaluated),
        "errors": sum(r["errors"] for r in evaluated),
        "mean_reward": float(np.mean(rewards)) if rewards else None,
        "pass_at": {str(j): mean_pass_at_k(counts, j) for j in ks},
        "solved_any": sum(r["passes"] > 0 for r in evaluated),
        "zero_pass": sum(r["passes"] == 0 for r in evaluated),
    }


def summarize(
    records: Iterable[AttemptRecord],
    tasks: Mapping[str, str],
    k: int,
    *,
    meta: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON summary of a run over ``tasks`` (task id -> category) with ``k`` attempts each.

    pass@j averages over evaluated tasks only: environment-unavailable and invalid tasks are listed,
    not scored.
    """
    ks = report_ks(k)
    by_task = records_by_task(records)
    rows = [_task_row(tid, tasks.get(tid, UNCATEGORIZED), by_task.get(tid, []), ks) for tid in sorted(tasks)]
    categories: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        categories.setdefault(row["category"], []).append(row)
    return {
        **dict(meta or {}),
        "k": k,
        "ks": ks,
        "overall": _group_stats(rows, ks),
        "categories": {cat: _group_stats(cat_rows, ks) for cat, cat_rows in sorted(categories.items())},
        "tasks": rows,
        "env_unavailable": [
            {"task_id": r["task_id"], "reason": r["reason"]} for r in rows if r["status"] == "env_unavailable"
        ],
        "invalid": [
            {"task_id": r["task_id"], "reason": r["reason"]} for r in rows if r["status"] == "invalid"
        ],
    }


def harness_matrix(
    summaries: Mapping[str, Mapping[str, Any]], *, meta: Mapping[str, Any] | None = None
) -> dict:
    """One report over the runs of one agent under several harnesses (``tmax-jax eval --harness all``).

    ``summaries``: harness -> that run's ``summarize`` output. The result holds, per harness, its
    overall stats and its per-category stats (the harness x category table), the categories seen in
    any run, and each run's own summary path (``<harness>/summary.json``).
    """
    if not summaries:
        raise ValueError("harness_matrix needs at least one harness's summary")
    ks = sorted({j for s in summaries.values() for j in s["ks"]})
    categories = sorted({c for s in summaries.values() for c in s["categories"]})
    return {
        **dict(meta or {}),
        "harnesses": list(summaries),
        "k": max(s["k"] for s in summaries.values()),
        "ks": ks,
        "categories": categories,
        "by_harness": {
            h: {
                "overall": s["overall"],
                "categories": dict(s["categories"]),
                "summary": f"{h}/summary.json",
                "report": f"{h}/report.html",
            }
            for h, s in summaries.items()
        },
    }
