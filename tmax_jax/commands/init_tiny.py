"""``tmax-jax init-tiny OUT_DIR``: a random tiny Qwen 3.5 checkpoint plus a locally trained tokenizer,
so everything runs offline on a laptop."""

from __future__ import annotations

import argparse
import dataclasses


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
    from flax import nnx

    from tmax_jax.checkpoints import save_hf
    from tmax_jax.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
    from tmax_jax.tokenizer import train_tiny_tokenizer

    tokenizer = train_tiny_tokenizer(args.out_dir, vocab_size=args.vocab_size)
    ids = tokenizer.convert_tokens_to_ids
    cfg = Qwen35Config.preset(
        "tiny",
        vocab_size=args.vocab_size,
        eos_token_id=ids("<|im_end|>"),
        pad_token_id=ids("<|endoftext|>"),
        bos_token_id=None,
    )
    model = Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(args.seed))
    out = save_hf(model, args.out_dir, tokenizer=tokenizer)
    n_params = sum(x.size for x in __import__("jax").tree.leaves(nnx.state(model, nnx.Param)))
    print(f"wrote {out} ({n_params:,} parameters; {dataclasses.asdict(cfg)['num_hidden_layers']} layers)")
    return 0
