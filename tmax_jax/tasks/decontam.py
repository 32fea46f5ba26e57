"""13-gram decontamination of a generated corpus against a benchmark's tasks (e.g. a Terminal-Bench
2.0 checkout): a task sharing any word 13-gram with a benchmark instruction is contaminated."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tmax_jax.errors import TmaxError
from tmax_jax.tasks.loader import find_tasks, load_task

_WORD = re.compile(r"[a-z0-9]+")


def ngrams(text: str, n: int = 13) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.lower())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def benchmark_ngrams(bench_dir: str | Path, n: int = 13) -> set[tuple[str, ...]]:
    """Word n-grams of every benchmark task's instruction (unreadable task dirs are skipped)."""
    out: set[tuple[str, ...]] = set()
    for d in find_tasks(bench_dir):
        try:
            out |= ngrams(load_task(d).instruction, n)
        except TmaxError:
            continue
    return out


@dataclass
class Contamination:
    path: Path
    overlaps: int
    example: str


def find_contaminated(corpus_dir: str | Path, bench_dir: str | Path, n: int = 13) -> list[Contamination]:
    bench = benchmark_ngrams(bench_dir, n)
    hits = []
    for d in find_tasks(corpus_dir):
        shared = ngrams(load_task(d).instruction, n) & bench
        if shared:
            hits.append(Contamination(d, len(shared), " ".join(sorted(shared)[0])))
    return hits
