"""``tmax-jax export-hf RUN_DIR [--step N] --out DIR``: a training step's policy as an HF checkpoint."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("export-hf", help="write a run's checkpointed policy as a Hugging Face directory")
    p.add_argument("run_dir")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    p.add_argument("--out", required=True, help="output directory (safetensors + config + tokenizer)")
    p.set_defaults(func=run)


def run(args) -> int:
    from tmax_jax.train.export import export_step

    step, out = export_step(args.run_dir, args.step, args.out)
    print(f"exported step {step} of {args.run_dir} to {out}")
    return 0
