"""``tmax-jax eval``: pass@k of an agent over a directory of Harbor tasks, resumable, with reports."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tmax_jax.errors import ConfigError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate an agent on a directory of Harbor tasks (pass@1, pass@k, HTML report)",
        description=(
            "Run every Harbor-format task under --tasks k times with the chosen agent in the sandbox pool. "
            "Finished attempts recorded in OUT/results.jsonl are not re-run; tasks whose Dockerfile, "
            "tests/test.sh or solution/solve.sh fetch from the internet (offline runs), or that use a "
            "Dockerfile instruction the backend cannot honour, are reported as 'environment unavailable' "
            "with the line; malformed task dirs as 'invalid'. Neither is scored. Each attempt dir keeps the "
            "agent's commands and every file the verifier wrote under /logs/verifier."
        ),
    )
    p.add_argument(
        "--tasks", required=True, type=Path, help="directory of Harbor task dirs (searched recursively)"
    )
    who = p.add_mutually_exclusive_group()
    who.add_argument(
        "--agent", choices=["oracle", "noop"], help="a baseline agent: run solution/solve.sh, or nothing"
    )
    who.add_argument("--checkpoint", type=Path, help="a model checkpoint (HF directory) served by our engine")
    who.add_argument("--llm-url", help="an OpenAI-compatible endpoint, e.g. http://localhost:8000/v1")
    p.add_argument("--model", help="model name sent to --llm-url")
    p.add_argument("-k", type=int, default=1, help="attempts per task (pass@1 .. pass@k); default 1")
    p.add_argument(
        "--harness", choices=["bash", "terminus"], default="bash", help="model agent's tool protocol"
    )
    p.add_argument("--concurrency", type=int, default=1, help="attempts (sandboxes) run at once; default 1")
    p.add_argument("--out", type=Path, help="output dir (default runs/eval/<agent>-<task dir name>)")
    p.add_argument(
        "--backend", choices=["bwrap", "podman", "apptainer"], default="bwrap", help="sandbox backend"
    )
    p.add_argument("--rootfs", default="host", help="bwrap rootfs: 'host' or a rootfs directory")
    p.add_argument(
        "--network",
        action="store_true",
        help="builds (and tasks that allow it, their agent and tests) can reach the internet; otherwise "
        "tasks that download are listed as unavailable",
    )
    p.add_argument(
        "--retry-errors", action="store_true", help="re-run attempts that crashed in an earlier run"
    )
    p.add_argument("--temperature", type=float, default=1.0, help="model agent sampling temperature")
    p.add_argument("--max-turns", type=int, default=64, help="model agent turn limit per episode")
    p.add_argument("--max-tokens-per-turn", type=int, default=2048, help="model agent reply length limit")
    p.add_argument(
        "--max-context", type=int, default=32768, help="--checkpoint: tokens per episode (cache length)"
    )
    p.set_defaults(func=run)


def _agent_label(args) -> str:
    if args.agent:
        return args.agent
    if args.checkpoint:
        return f"ckpt-{args.checkpoint.name}"
    return "llm-" + re.sub(r"[^A-Za-z0-9._-]+", "_", args.model or "model")


def _sampling(args) -> dict:
    # Part of a model run's identity: attempts sampled differently are not pass@k samples of one run.
    return {"temperature": args.temperature, "max_turns": args.max_turns}


def _make_agent(args):
    from tmax_jax.eval.agents import builtin_agent

    if args.llm_url is None and args.model is not None:
        raise ConfigError("--model is only used with --llm-url")
    if args.agent:
        return builtin_agent(args.agent), {}
    from tmax_jax.eval.model_agent import checkpoint_agent, endpoint_agent

    if args.checkpoint is not None:
        return checkpoint_agent(
            args.checkpoint,
            harness=args.harness,
            temperature=args.temperature,
            max_turns=args.max_turns,
            slots=args.concurrency,
            max_context_tokens=args.max_context,
            max_tokens_per_turn=args.max_tokens_per_turn,
        ), {
            "checkpoint": str(args.checkpoint.resolve()),
            "harness": args.harness,
            **_sampling(args),
            "max_tokens_per_turn": args.max_tokens_per_turn,
            "max_context": args.max_context,
        }
    if args.llm_url is not None:
        if not args.model:
            raise ConfigError("--llm-url needs --model NAME (the model the endpoint serves)")
        return endpoint_agent(
            args.llm_url,
            args.model,
            harness=args.harness,
            temperature=args.temperature,
            max_turns=args.max_turns,
        ), {"llm_url": args.llm_url, "model": args.model, "harness": args.harness, **_sampling(args)}
    raise ConfigError(
        "choose what to evaluate: --agent oracle|noop, --checkpoint DIR, or --llm-url URL --model NAME"
    )


def run(args: argparse.Namespace) -> int:
    from tmax_jax.eval.runner import EvalConfig, evaluate
    from tmax_jax.sandbox.config import SandboxConfig

    cfg = EvalConfig(
        k=args.k, concurrency=args.concurrency, network=args.network, retry_errors=args.retry_errors
    )
    agent, identity = _make_agent(args)
    out = args.out or Path("runs") / "eval" / f"{_agent_label(args)}-{args.tasks.resolve().name}"
    sandbox_cfg = SandboxConfig(backend=args.backend, rootfs=args.rootfs, network=args.network)
    try:
        summary = evaluate(args.tasks, agent, out, cfg, sandbox_cfg=sandbox_cfg, identity=identity)
    finally:
        close = getattr(agent, "close", None)
        if callable(close):
            close()
    o = summary["overall"]
    passes = "  ".join(
        f"pass@{j} {o['pass_at'][str(j)]:.3f}" if o["pass_at"][str(j)] is not None else f"pass@{j} n/a"
        for j in summary["ks"]
    )
    print(
        f"{o['evaluated']} tasks evaluated, {o['env_unavailable']} environment unavailable, "
        f"{o.get('invalid', 0)} invalid, "
        f"{o['errors']} crashed attempts: {passes}"
    )
    for cat, s in summary["categories"].items():
        p1 = s["pass_at"]["1"]
        print(f"  {cat:24s} {s['evaluated']:4d} tasks  pass@1 {'n/a' if p1 is None else f'{p1:.3f}'}")
    for row in summary.get("invalid", []):
        print(f"  invalid: {row['task_id']}: {row['reason'][:200]}")
    print(f"report: {out / 'report.html'}  summary: {out / 'summary.json'}")
    return 0
