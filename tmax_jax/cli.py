"""The ``tmax-jax`` command line.

Each sub-command lives in its own module under ``tmax_jax/commands/`` and exposes
``register(subparsers)``, which adds its parser and sets ``func``. Modules are listed here so that
``tmax-jax --help`` shows every command; heavy imports (jax, torch) stay inside the commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from tmax_jax import hostmem
from tmax_jax.errors import TmaxError

# One entry per sub-command module (tmax_jax/commands/<name>.py).
COMMAND_MODULES: list[str] = [
    "serve",
    "eval",
    "run_task",
    "generate_tasks",
    "corpus_stats",
    "calibrate",
    "plan",
    "train",
    "sft",
    "export_hf",
    "init_tiny",
    "generate",
    "fit_mtp",
    "study",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tmax-jax",
        description="JAX-native TMAX: train terminal agents with RL (Qwen 3.5, DPPO).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        importlib.import_module(f"tmax_jax.commands.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "uses_jax", True):
            # Before the command starts JAX's backend (tmax_jax/hostmem.py says why and when).
            hostmem.configure()
        rc = args.func(args)
    except TmaxError as e:
        print(f"tmax-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tmax-jax {args.command}: interrupted", file=sys.stderr)
        return 130
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
