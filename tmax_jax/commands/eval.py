"""``tmax-jax eval``: pass@k of an agent over a directory of Harbor tasks, resumable, with reports."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tmax_jax.agent.harness import HARNESSES
from tmax_jax.commands.run_task import verifier_mode_option
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
        "--harness",
        choices=[*HARNESSES, "all"],
        default="bash",
        help="the model agent's harness: bash (TMAX's bash tool), mini-swe, openhands, terminus, or all "
        "(each in turn into OUT/<harness>/, one report over all of them in OUT)",
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
    # Harbor's semantics by default: scores comparable with published Terminal-Bench numbers.
    verifier_mode_option(p, "harbor")
    p.add_argument("--temperature", type=float, default=1.0, help="model agent sampling temperature")
    p.add_argument("--max-turns", type=int, default=64, help="model agent turn limit per episode")
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="--checkpoint: draft this many tokens per decode step with its MTP module (mtp.* "
        "tensors); the sampled tokens do not change",
    )
    p.add_argument("--max-tokens-per-turn", type=int, default=2048, help="model agent reply length limit")
    p.add_argument(
        "--max-context",
        type=int,
        default=32768,
        help="tokens per episode: the cache length for --checkpoint, the limit old outputs are elided "
        "against for --llm-url",
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


def _harnesses(args) -> list[str]:
    return list(HARNESSES) if args.harness == "all" else [args.harness]


def _make_agents(args) -> dict[str, tuple]:
    """harness -> (agent, identity); baselines have no harness (one entry, key "")."""
    from tmax_jax.eval.agents import builtin_agent

    if args.llm_url is None and args.model is not None:
        raise ConfigError("--model is only used with --llm-url")
    if args.agent:
        if args.harness == "all":
            raise ConfigError("--harness all needs a model agent (--checkpoint or --llm-url), not --agent")
        return {"": (builtin_agent(args.agent), {})}
    from tmax_jax.eval.model_agent import checkpoint_agents, endpoint_agent

    if args.checkpoint is not None:
        agents = checkpoint_agents(
            args.checkpoint,
            _harnesses(args),
            temperature=args.temperature,
            max_turns=args.max_turns,
            slots=args.concurrency,
            max_context_tokens=args.max_context,
            max_tokens_per_turn=args.max_tokens_per_turn,
            speculative_tokens=args.speculative_tokens,
        )
        ident = {
            "checkpoint": str(args.checkpoint.resolve()),
            **_sampling(args),
            "max_tokens_per_turn": args.max_tokens_per_turn,
            "max_context": args.max_context,
        }
        return {h: (a, {**ident, "harness": h}) for h, a in agents.items()}
    if args.llm_url is not None:
        if not args.model:
            raise ConfigError("--llm-url needs --model NAME (the model the endpoint serves)")
        ident = {"llm_url": args.llm_url, "model": args.model, **_sampling(args)}
        return {
            h: (
                endpoint_agent(
                    args.llm_url,
                    args.model,
                    harness=h,
                    temperature=args.temperature,
                    max_turns=args.max_turns,
                    max_tokens_per_turn=args.max_tokens_per_turn,
                    max_context_tokens=args.max_context,
                ),
                {**ident, "harness": h},
            )
            for h in _harnesses(args)
        }
    raise ConfigError(
        "choose what to evaluate: --agent oracle|noop, --checkpoint DIR, or --llm-url URL --model NAME"
    )


def _print_summary(summary: dict, out: Path, label: str = "") -> None:
    o = summary["overall"]
    passes = "  ".join(
        f"pass@{j} {o['pass_at'][str(j)]:.3f}" if o["pass_at"][str(j)] is not None else f"pass@{j} n/a"
        for j in summary["ks"]
    )
    print(
        f"{label}{o['evaluated']} tasks evaluated, {o['env_unavailable']} environment unavailable, "
        f"{o.get('invalid', 0)} invalid, "
        f"{o['errors']} crashed attempts: {passes}"
    )
    for cat, s in summary["categories"].items():
        p1 = s["pass_at"]["1"]
        print(f"  {cat:24s} {s['evaluated']:4d} tasks  pass@1 {'n/a' if p1 is None else f'{p1:.3f}'}")
    for row in summary.get("invalid", []):
        print(f"  invalid: {row['task_id']}: {row['reason'][:200]}")


def run(args: argparse.Namespace) -> int:
    from tmax_jax.compilation_cache import enable_compilation_cache
    from tmax_jax.eval.runner import EvalConfig, evaluate
    from tmax_jax.eval.summary import harness_matrix
    from tmax_jax.sandbox.config import SandboxConfig

    enable_compilation_cache(min_compile_secs=1.0)  # a model agent's engine programs, for the next run
    cfg = EvalConfig(
        k=args.k, concurrency=args.concurrency, network=args.network, retry_errors=args.retry_errors
    )
    agents = _make_agents(args)
    out = args.out or Path("runs") / "eval" / f"{_agent_label(args)}-{args.tasks.resolve().name}"
    sandbox_cfg = SandboxConfig(
        backend=args.backend, rootfs=args.rootfs, network=args.network, verifier_mode=args.verifier_mode
    )
    summaries: dict[str, dict] = {}
    try:
        for harness, (agent, identity) in agents.items():
            # One harness: OUT itself (as before); several: OUT/<harness>/ each, resumable on its own.
            where = out / harness if args.harness == "all" else out
            summaries[harness] = evaluate(
                args.tasks, agent, where, cfg, sandbox_cfg=sandbox_cfg, identity=identity
            )
    finally:
        for agent, _ in agents.values():
            close = getattr(agent, "close", None)
            if callable(close):
                close()
    if args.harness != "all":
        _print_summary(next(iter(summaries.values())), out)
        print(f"report: {out / 'report.html'}  summary: {out / 'summary.json'}")
        return 0
    import json

    from tmax_jax.eval.html_report import render_harness_html

    combined = harness_matrix(
        summaries, meta={"agent": _agent_label(args), "tasks_dir": str(args.tasks.resolve())}
    )
    for harness, summary in summaries.items():
        _print_summary(summary, out / harness, label=f"[{harness}] ")
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(combined, indent=2, sort_keys=True))
    (out / "report.html").write_text(render_harness_html(combined))
    print(f"report: {out / 'report.html'}  summary: {out / 'summary.json'}")
    return 0
