"""``tmax-jax train CONFIG.yaml [--run-dir DIR] [--set key.sub=value ...]``: the RL run (resumes when RUN_DIR has checkpoints)."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("train", help="warm start + asynchronous DPPO on sandboxed terminal tasks")
    p.add_argument("config", help="YAML config (overrides of TrainConfig; see configs/tiny-cpu.yaml)")
    p.add_argument("--run-dir", help="run directory (default: the config's run_dir)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--harness",
        choices=["bash", "mini-swe", "openhands", "terminus"],
        help="the agent harness episodes run under (sets agent.harness; recorded in RUN_DIR/config.yaml). "
        "A config's agent.system_prompt still wins over the harness's own prompt: --set agent.system_prompt='' "
        "to use it",
    )
    p.add_argument(
        "--verifier-mode",
        choices=["strict", "harbor"],
        help="sets sandbox.verifier_mode (default strict: the agent's processes are stopped before the "
        "tests, which get a network of their own; harbor: services the agent left answer the tests)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field, e.g. --set steps=5 --set rl.loss.delta=0.2 (repeatable)",
    )
    p.set_defaults(func=run)


def run(args) -> int:
    from tmax_jax.config import parse_dotted
    from tmax_jax.distributed import initialize
    from tmax_jax.train.config import load_train_config
    from tmax_jax.train.loop import train

    overrides = parse_dotted(args.overrides)
    if args.run_dir:
        overrides["run_dir"] = args.run_dir
    if getattr(args, "verifier_mode", None):
        overrides.setdefault("sandbox", {})["verifier_mode"] = args.verifier_mode
    if getattr(args, "harness", None):
        overrides.setdefault("agent", {})["harness"] = args.harness
    cfg = load_train_config(args.config, overrides)
    # Before anything touches a device; a no-op when tpu/multihost.py has already joined.
    initialize(cfg.distributed)
    summary = train(cfg, progress=not args.no_progress)
    print(json.dumps(summary))
    return 130 if summary.get("interrupted") else 0
