"""``tmax-jax generate --checkpoint DIR --prompt TEXT``: a quick look at what a checkpoint says."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate a completion for one prompt from an HF-layout checkpoint",
        description="Loads DIR (weights + tokenizer), applies its chat template unless --raw, and decodes.",
    )
    p.add_argument("--checkpoint", required=True, help="HF-layout checkpoint directory (with its tokenizer)")
    p.add_argument("--prompt", required=True, help="user message (or raw text with --raw)")
    p.add_argument("--raw", action="store_true", help="tokenize the prompt as is, without the chat template")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="compute/parameter dtype"
    )
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="draft this many tokens per decode step with the checkpoint's MTP module (same output)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from tmax_jax.checkpoints import load_hf
    from tmax_jax.compilation_cache import enable_compilation_cache
    from tmax_jax.engine import generate
    from tmax_jax.engine.api import speculative_settings
    from tmax_jax.errors import CheckpointError
    from tmax_jax.tokenizer import load_tokenizer

    # The engine's prefill and decode programs compile in seconds each (minutes for large models on
    # an accelerator): a second run with the same shapes loads them from disk.
    enable_compilation_cache(min_compile_secs=1.0)
    ckpt = Path(args.checkpoint)
    if not ckpt.is_dir():
        raise CheckpointError(f"--checkpoint {ckpt}: not a directory")
    tokenizer = load_tokenizer(ckpt)
    model = load_hf(ckpt, args.dtype)
    if args.raw:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        messages = [{"role": "user", "content": args.prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_ids = tokenizer.encode(text)
    eos = sorted({model.config.eos_token_id, tokenizer.eos_token_id} - {None})
    (out,) = generate(
        model,
        [prompt_ids],
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        eos_token_id=eos,
        max_concurrent=1,
        cache_dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32,
        **speculative_settings(
            ckpt, args.speculative_tokens, setting="--speculative-tokens", dtype=args.dtype
        ),
    )
    print(tokenizer.decode(out.tokens, skip_special_tokens=False))
    return 0
