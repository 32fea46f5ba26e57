"""Eval throughput (attempts per minute) at several concurrencies, in real bubblewrap sandboxes.

    python benchmarks/bench_eval.py                       # oracle agent, concurrency 1, 4, 8
    python benchmarks/bench_eval.py --agent tiny          # a tiny random Qwen 3.5 through our engine
    python benchmarks/bench_eval.py --agent tiny --preset 0.8b --dtype bfloat16   # on an accelerator

Every number is measured in this run; the ratio column is against concurrency 1 of the same run.
The task set is generated: N small Harbor tasks (file creation, counting, a solution with a helper
script), bash verifiers. The model's compile time is measured per engine (slot count), outside the timed runs.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

TASK_TOML = """\
version = "1.0"
[metadata]
category = "{category}"
[verifier]
timeout_sec = 60.0
[agent]
timeout_sec = 300.0
"""

KINDS = {
    "files": (
        "Create /app/hello.txt containing exactly: Hello, world!",
        "FROM ubuntu:24.04\nWORKDIR /app\n",
        '[ "$(cat /app/hello.txt 2>/dev/null)" = "Hello, world!" ]',
        {"solve.sh": "echo 'Hello, world!' > /app/hello.txt\n"},
    ),
    "text": (
        "Write the number of lines of /app/words.txt to /app/count.txt.",
        "FROM ubuntu:24.04\nWORKDIR /app\nRUN printf 'a\\nb\\nc\\n' > /app/words.txt\n",
        '[ "$(tr -d " \\n" < /app/count.txt 2>/dev/null)" = "3" ]',
        {"solve.sh": "wc -l < /app/words.txt > /app/count.txt\n"},
    ),
    "scripts": (
        "Write /app/in.txt upper-cased to /app/out.txt.",
        "FROM ubuntu:24.04\nWORKDIR /app\nRUN echo 'quiet words' > /app/in.txt\n",
        '[ "$(cat /app/out.txt 2>/dev/null)" = "QUIET WORDS" ]',
        {
            "solve.sh": 'bash "$(dirname "$0")/upper.sh"\n',
            "upper.sh": "tr a-z A-Z < /app/in.txt > /app/out.txt\n",
        },
    ),
}


def make_task_set(root: Path, n: int) -> Path:
    kinds = list(KINDS)
    for i in range(n):
        category = kinds[i % len(kinds)]
        instruction, dockerfile, cond, solution = KINDS[category]
        d = root / f"{category}-{i:03d}"
        for sub in ("environment", "tests", "solution"):
            (d / sub).mkdir(parents=True)
        (d / "instruction.md").write_text(instruction)
        (d / "task.toml").write_text(TASK_TOML.format(category=category))
        (d / "environment" / "Dockerfile").write_text(dockerfile)
        (d / "tests" / "test.sh").write_text(
            f"mkdir -p /logs/verifier\nif {cond}; then r=1; else r=0; fi\necho $r > /logs/verifier/reward.txt\n"
        )
        for name, body in solution.items():
            (d / "solution" / name).write_text(body)
    return root


def make_checkpoint(out: Path, preset: str, dtype: str) -> Path:
    from flax import nnx

    from tmax_jax.checkpoints import save_hf
    from tmax_jax.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
    from tmax_jax.tokenizer import train_tiny_tokenizer

    tok = train_tiny_tokenizer(out / "tok", vocab_size=512)
    # The tokenizer has 512 ids; a bigger preset keeps its shape except the (random) vocabulary.
    cfg = Qwen35Config.preset(preset, vocab_size=512)
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0))
    return save_hf(model, out / f"{preset}-random", tokenizer=tok)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--agent", choices=["oracle", "tiny"], default="oracle")
    ap.add_argument("--tasks", type=int, default=16, help="tasks in the generated set")
    ap.add_argument("--concurrency", default="1,4,8")
    ap.add_argument("--preset", default="tiny", help="--agent tiny: Qwen 3.5 shape (tiny, 0.8b, ...)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--max-turns", type=int, default=3)
    ap.add_argument("--max-tokens-per-turn", type=int, default=32)
    args = ap.parse_args(argv)
    concurrencies = [int(c) for c in args.concurrency.split(",")]

    import jax

    from tmax_jax.eval.agents import OracleAgent
    from tmax_jax.eval.runner import EvalConfig, evaluate

    work = Path(tempfile.mkdtemp(prefix="bench_eval_"))
    tasks = make_task_set(work / "tasks", args.tasks)
    print(
        f"{args.tasks} tasks, agent {args.agent}, jax {jax.__version__} on {jax.devices()[0].platform}, "
        f"{os.cpu_count()} CPUs"
    )

    def agent_for(c: int):
        if args.agent == "oracle":
            return OracleAgent()
        from tmax_jax.eval.model_agent import checkpoint_agent

        return checkpoint_agent(
            ckpt,
            max_turns=args.max_turns,
            slots=c,
            max_context_tokens=2048,
            max_tokens_per_turn=args.max_tokens_per_turn,
            dtype=args.dtype,
            temperature=1.0,
        )

    # Environment layers are built once and cached; build them before timing anything.
    t0 = time.perf_counter()
    evaluate(tasks, OracleAgent(), work / "build-out", EvalConfig(k=1, concurrency=4), log=lambda m: None)
    print(f"environment builds + one oracle pass: {time.perf_counter() - t0:.1f}s (not in the timings below)")

    if args.agent == "tiny":
        ckpt = make_checkpoint(work, args.preset, args.dtype)
        make_task_set(work / "warm", 1)

    rows = []
    for c in concurrencies:
        agent = agent_for(c)
        if args.agent == "tiny":
            # Each slot count is its own engine: compile it on one episode before timing.
            t0 = time.perf_counter()
            evaluate(work / "warm", agent, work / f"warm-out-c{c}", EvalConfig(k=1), log=lambda m: None)
            print(f"concurrency {c}: compile + first episode {time.perf_counter() - t0:.1f}s (not timed)")
        t0 = time.perf_counter()
        s = evaluate(tasks, agent, work / f"out-c{c}", EvalConfig(k=1, concurrency=c), log=lambda m: None)
        wall = time.perf_counter() - t0
        close = getattr(agent, "close", None)
        if callable(close):
            close()
        n = s["overall"]["attempts"]
        rows.append((c, n, wall, 60.0 * n / wall, s["overall"]["pass_at"]["1"], s["overall"]["errors"]))
    base = rows[0][3]
    print(
        f"{'concurrency':>11} {'attempts':>8} {'wall s':>8} {'tasks/min':>10} {'vs c=' + str(rows[0][0]):>8} "
        f"{'pass@1':>7} {'errors':>6}"
    )
    for c, n, wall, tpm, p1, errs in rows:
        print(f"{c:>11} {n:>8} {wall:>8.2f} {tpm:>10.1f} {tpm / base:>8.2f} {p1:>7.3f} {errs:>6}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
