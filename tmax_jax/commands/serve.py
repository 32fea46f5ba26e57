"""``tmax-jax serve --checkpoint DIR --port P``: an OpenAI-compatible server for a checkpoint."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "serve",
        help="serve a checkpoint over an OpenAI-compatible HTTP API",
        description="Serve /v1/completions and /v1/chat/completions (streaming, logprobs) for a checkpoint.",
    )
    p.add_argument("--checkpoint", required=True, help="HF-layout checkpoint directory (with its tokenizer)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument(
        "--dtype", default="float32", choices=["float32", "bfloat16"], help="compute/parameter dtype"
    )
    p.add_argument("--slots", type=int, default=8, help="concurrent decode slots")
    p.add_argument("--max-cache-length", type=int, default=2048, help="prompt + generated tokens per slot")
    p.add_argument("--max-prefill-length", type=int, default=512)
    p.add_argument("--max-queued", type=int, default=256, help="waiting requests before 503s")
    p.add_argument("--default-max-tokens", type=int, default=256)
    p.add_argument(
        "--speculative-tokens",
        type=int,
        default=0,
        help="draft this many tokens per decode step with the checkpoint's MTP module (mtp.* tensors) "
        "and verify them in one pass; the output is the same, only faster when drafts are accepted",
    )
    p.add_argument(
        "--model-name", default=None, help="id reported by /v1/models (default: the directory name)"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import jax.numpy as jnp

    from tmax_jax.checkpoints import load_hf
    from tmax_jax.compilation_cache import enable_compilation_cache
    from tmax_jax.engine import Engine, Orchestrator
    from tmax_jax.engine.api import model_eos_ids, speculative_settings
    from tmax_jax.engine.server import OpenAIServer
    from tmax_jax.errors import CheckpointError
    from tmax_jax.tokenizer import load_tokenizer

    # The engine's prefill and decode programs compile in seconds each (minutes for large models on
    # an accelerator): a second run with the same shapes loads them from disk.
    enable_compilation_cache(min_compile_secs=1.0)
    ckpt = Path(args.checkpoint)
    if not ckpt.is_dir():
        raise CheckpointError(f"--checkpoint {ckpt}: not a directory")
    model = load_hf(ckpt, args.dtype)
    tokenizer = load_tokenizer(ckpt)
    eos = set(model_eos_ids(model))
    if isinstance(tokenizer.eos_token_id, int):
        eos.add(tokenizer.eos_token_id)
    engine = Engine(
        model,
        max_concurrent_decodes=args.slots,
        max_cache_length=args.max_cache_length,
        max_prefill_length=min(args.max_prefill_length, args.max_cache_length),
        cache_dtype=jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32,
        eos_token_ids=sorted(eos),
        tokenizer=tokenizer,
        **speculative_settings(
            ckpt, args.speculative_tokens, setting="--speculative-tokens", dtype=args.dtype
        ),
    )
    with Orchestrator(engine, max_queued=args.max_queued) as orch:
        server = OpenAIServer(
            orch,
            tokenizer,
            model_name=args.model_name or ckpt.resolve().name,
            host=args.host,
            port=args.port,
            default_max_tokens=args.default_max_tokens,
        )
        print(
            f"tmax-jax serve: {server.url}/v1 (model {server.model_name}, {args.slots} slots)",
            file=sys.stderr,
        )
        try:
            server.serve_forever()
        finally:
            server.shutdown()
    return 0
