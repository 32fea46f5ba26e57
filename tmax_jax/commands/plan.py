"""``tmax-jax plan``: per-device memory of a training config, without allocating anything."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="print per-device bytes for params, grads, optimizer state and activations of a config",
        description="Memory plan from shapes only (jax.eval_shape): will this run fit the mesh?",
    )
    p.add_argument("--config", required=True, help="run YAML (model, mesh, rl, batch, plan sections)")
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="dotted overrides, e.g. plan.num_devices=8 mesh.fsdp=-1 batch.seq_len=32768",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tmax_jax.config import parse_dotted
    from tmax_jax.memory_plan import format_plan, load_run_config, make_plan

    cfg = load_run_config(args.config, parse_dotted(args.set))
    plan = make_plan(cfg)
    print(format_plan(plan, cfg))
    return 0
