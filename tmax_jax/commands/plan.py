"""``tmax-jax plan CONFIG.yaml``: per-device memory of a training config, without allocating anything."""

from __future__ import annotations

import argparse
import json
import sys

from tmax_jax.errors import ConfigError

PROGRAMS = ("train_step", "prefill", "decode")  # tmax_jax.aot.PROGRAMS (kept light: no jax import here)


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
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile the train step and the engine's prefill and decode block for plan.topology with "
        "XLA:TPU (the [tpu] extra; no TPU needed) and print its per-chip bytes",
    )
    p.add_argument("--json", action="store_true", help="one JSON object per program on stdout")
    p.add_argument("--dump-hlo", metavar="DIR", help="with --compile: write each program's compiled HLO text")
    p.add_argument(
        "--programs",
        default=",".join(PROGRAMS),
        help=f"with --compile: which programs, comma-separated (default {','.join(PROGRAMS)})",
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
    if args.dump_hlo and not args.compile:
        raise ConfigError("--dump-hlo needs --compile")
    if args.compile:
        from tmax_jax import aot

        if aot.libtpu_available():
            return _compile(args, cfg)
        print(
            "tmax-jax plan: XLA:TPU is not installed here (no libtpu), so nothing was compiled; install "
            "the [tpu] extra (pip install -e '.[tpu]') for XLA's numbers. Below: the shapes-only "
            "ESTIMATE (memory_plan), not a compile.",
            file=sys.stderr,
        )
        plan = make_plan(cfg)
        if args.json:
            print(json.dumps(aot.estimate_json(plan, cfg)))
        else:
            print("ESTIMATE (shapes only, no XLA compile):")
            print(format_plan(plan, cfg))
        return 0
    plan = make_plan(cfg)
    print(format_plan(plan, cfg))
    return 0


def _compile(args: argparse.Namespace, cfg) -> int:
    from tmax_jax import aot

    programs = tuple(p.strip() for p in args.programs.split(",") if p.strip())

    def show(report):
        if args.json:
            print(json.dumps(report.to_json()), flush=True)
        else:
            print(aot.format_report(report), flush=True)

    aot.compile_programs(cfg, programs, hlo_dir=args.dump_hlo, on_report=show)
    return 0
