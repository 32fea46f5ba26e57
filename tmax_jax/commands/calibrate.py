"""``tmax-jax calibrate DIR -k 8 (--llm-url URL --model M | --agent oracle|noop)``: pass rates per task.

Writes ``DIR/calibration.json`` (every task's k rewards, pass rate, and whether it lies in the
difficulty band ``--band LO,HI``, exclusive) and prints a table.
"""

from __future__ import annotations

from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="run a policy k times per task and record pass rates")
    p.add_argument("dir", type=Path, help="directory of TMAX/Harbor tasks")
    p.add_argument("-k", type=int, default=8, help="attempts per task (default 8)")
    who = p.add_mutually_exclusive_group(required=True)
    who.add_argument("--llm-url", help="OpenAI-compatible endpoint of the policy (e.g. tmax-jax serve)")
    who.add_argument("--agent", choices=["oracle", "noop"], help="a baseline instead of a model")
    p.add_argument("--model", default="default", help="model name for --llm-url")
    p.add_argument("--max-turns", type=int, default=32, help="model agent turn limit per episode")
    p.add_argument("--max-tokens-per-turn", type=int, default=1024)
    p.add_argument(
        "--band", default="0,1", help="keep pass rates in (LO, HI); default 0,1 drops all-0 and all-1"
    )
    p.add_argument("--concurrency", type=int, default=0, help="sandboxes at once (default: CPU count)")
    p.add_argument("--out", type=Path, help="report path (default DIR/calibration.json)")
    p.set_defaults(func=run, uses_jax=False)


def run(args) -> int:
    from tmax_jax.errors import ConfigError
    from tmax_jax.tasks.calibrate import calibrate, in_band, write_report
    from tmax_jax.tasks.loader import find_tasks

    try:
        lo, hi = (float(x) for x in args.band.split(","))
    except ValueError:
        raise ConfigError(f"--band must look like LO,HI (e.g. 0,1), got {args.band!r}") from None
    if args.agent:
        agent = "oracle" if args.agent == "oracle" else None
        closer = None
    else:
        from tmax_jax.eval.model_agent import endpoint_agent

        agent = endpoint_agent(
            args.llm_url, args.model, max_turns=args.max_turns, max_tokens_per_turn=args.max_tokens_per_turn
        )
        closer = getattr(agent, "close", None)
    try:
        results = calibrate(find_tasks(args.dir), agent, args.k, concurrency=args.concurrency or None)
    finally:
        if closer:
            closer()
    in_band(results, lo, hi)  # validates the band before writing
    out = args.out or args.dir / "calibration.json"
    write_report(results, out, lo, hi)
    band = {r.path for r in in_band(results, lo, hi)}
    w = max([len(r.task) for r in results] + [4])
    print(f"{'task':<{w}}  pass_rate  mean_reward  in_band")
    for r in results:
        print(f"{r.task:<{w}}  {r.pass_rate:9.3f}  {r.mean_reward:11.3f}  {r.path in band}")
    print(f"\n{len(band)}/{len(results)} tasks in the band ({lo:g}, {hi:g}); report: {out}")
    return 0
