"""``tmax-jax plan CONFIG.yaml``: per-device memory of a training config, without allocating anything."""

from __future__ import annotations

import argparse

from tmax_jax.errors import ConfigError


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plan",
        help="print per-device bytes for params, grads, optimizer state and activations of a train config",
        description="Memory plan of `tmax-jax train CONFIG.yaml` from shapes only (jax.eval_shape): "
        "will this run fit the hardware of the config's plan section?",
    )
    p.add_argument("config", nargs="?", help="the train YAML (overrides of TrainConfig)")
    p.add_argument(
        "--config", dest="config_opt", metavar="CONFIG", help="the same, as an option (older form)"
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="extend",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="override a config field as in train, e.g. --set plan.num_devices=8 mesh.fsdp=-1 "
        "--set seq_len=32768 (repeatable)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tmax_jax.config import parse_dotted
    from tmax_jax.memory_plan import format_plan, make_plan
    from tmax_jax.train.config import load_train_config

    if args.config and args.config_opt and args.config != args.config_opt:
        raise ConfigError(f"two configs given: {args.config} and --config {args.config_opt}")
    path = args.config or args.config_opt
    if not path:
        raise ConfigError("plan needs a config: tmax-jax plan CONFIG.yaml")
    cfg = load_train_config(path, parse_dotted(args.overrides))
    plan = make_plan(cfg)
    print(format_plan(plan, cfg))
    return 0
