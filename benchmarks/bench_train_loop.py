"""Sync vs async RL loop on the tiny CPU config: rollout tokens/s, trainer tokens/s, and the share of
wall time the trainer waits for rollouts. Both modes run in this process on the same checkpoint.

    python benchmarks/bench_train_loop.py --checkpoint RUN_DIR/sft --steps 6
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tmax_jax.train.config import load_train_config
from tmax_jax.train.loop import train


def run(mode: str, args, root: Path) -> dict:
    overrides = {
        "run_dir": str(root / mode),
        "mode": mode,
        "steps": args.steps,
        "sft": {"steps": 0},
        "model": {"checkpoint": args.checkpoint},
        "eval": {"samples_per_task": 1},
        "tasks": {"num_heldout": 4, "words": 2},
    }
    cfg = load_train_config(args.config, overrides)
    t0 = time.monotonic()
    train(cfg, progress=False)
    wall = time.monotonic() - t0
    rows = [json.loads(x) for x in (root / mode / "metrics.jsonl").read_text().splitlines()]
    rows = rows[1:] or rows  # step 1 includes compilation
    gen = sum(r["generated_tokens"] for r in rows)
    roll = sum(r["rollout_s"] for r in rows)
    wait = sum(r["trainer_wait_s"] for r in rows)
    train_s = sum(r["train_s"] for r in rows)
    tps = [r["train_tokens_per_s"] for r in rows if "train_tokens_per_s" in r]
    return {
        "mode": mode,
        "wall_s": wall,
        "rollout_tok_per_s": gen / max(roll, 1e-9),
        "trainer_tok_per_s": sum(tps) / max(len(tps), 1),
        "trainer_wait_frac": wait / max(wait + train_s, 1e-9),
        "steady_step_s": (wait + train_s) / len(rows),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--checkpoint", required=True, help="an SFT'd tiny checkpoint (e.g. runs/tiny-cpu/sft)")
    p.add_argument("--steps", type=int, default=6)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        res = [run(m, args, Path(d)) for m in ("sync", "async")]
    for r in res:
        print(
            f"{r['mode']:>5}: steady step {r['steady_step_s']:.2f} s, rollout {r['rollout_tok_per_s']:.0f} tok/s, "
            f"trainer {r['trainer_tok_per_s']:.0f} tok/s, trainer waits {100 * r['trainer_wait_frac']:.0f}% "
            f"(wall {r['wall_s']:.0f} s)"
        )
    print(f"async/sync steady step time ratio: {res[1]['steady_step_s'] / res[0]['steady_step_s']:.2f}x")


if __name__ == "__main__":
    main()
