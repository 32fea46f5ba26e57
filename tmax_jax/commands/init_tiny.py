"""``tmax-jax init-tiny OUT_DIR``: a random tiny Qwen 3.5 checkpoint plus a locally trained tokenizer,
so everything runs offline on a laptop."""

from __future__ import annotations

import argparse


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "init-tiny",
        help="write a random tiny Qwen 3.5 checkpoint (HF layout) with a locally trained tokenizer",
        description="Writes OUT_DIR/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json, ...}.",
    )
    p.add_argument("out_dir", help="directory to create (existing model files in it are replaced)")
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights")
    p.add_argument("--vocab-size", type=int, default=512, help="tokenizer and model vocabulary size")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import jax
    from flax import nnx

    from tmax_jax.checkpoints.tiny import write_tiny_checkpoint

    out, model = write_tiny_checkpoint(args.out_dir, seed=args.seed, vocab_size=args.vocab_size)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"wrote {out} ({n_params:,} parameters; {model.config.num_hidden_layers} layers)")
    return 0
