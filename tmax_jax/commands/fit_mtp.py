"""``tmax-jax fit-mtp --checkpoint DIR --out DIR (--prompts FILE | --tasks DIR)``: fit the
checkpoint's multi-token-prediction module to the policy (speculative decoding's draft).

The policy samples completions of the prompts, the module is distilled towards the policy's own
next-token distributions on them (``train/mtp_fit.py``), and DIR is written to OUT with the fitted
module as its ``mtp.*`` tensors. A checkpoint without a module gets a new one (``--layers``). Before
and after, a speculative engine decodes held-out prompts and the tokens it emits per model step are
printed: the draft's acceptance, measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "fit-mtp",
        help="fit a checkpoint's MTP module (speculative decoding's draft) to its policy",
        description=__doc__.split("\n\n", 1)[1],
    )
    p.add_argument("--checkpoint", required=True, type=Path, help="HF-layout checkpoint (with its tokenizer)")
    p.add_argument("--out", required=True, type=Path, help="output directory (a new one)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument(
        "--prompts",
        type=Path,
        help='JSONL: {"prompt": text} (tokenised as is) or {"messages": [...]} (chat template) per line',
    )
    src.add_argument(
        "--tasks", type=Path, help="task directories (searched recursively): each one's first agent turn"
    )
    p.add_argument("--harness", default="bash", help="--tasks: the agent harness whose prompt opens episodes")
    p.add_argument(
        "--no-tool-schema", action="store_true", help="--tasks: leave the tool schemas out of the prompt"
    )
    p.add_argument("--system-prompt", default="", help="--tasks: instead of the harness's system prompt")
    p.add_argument("--samples", type=int, default=4, help="completions sampled per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (0 = greedy)")
    p.add_argument("--steps", type=int, default=500, help="optimiser steps")
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--layers", type=int, default=1, help="layers of a new module (the checkpoint has none)")
    p.add_argument("--heldout", type=float, default=0.1, help="share of prompts kept to measure acceptance")
    p.add_argument("--speculative-tokens", type=int, default=3, help="k of the acceptance measurement")
    p.add_argument("--slots", type=int, default=16, help="concurrent sequences while sampling")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.set_defaults(func=run)


def _prompts(args, tokenizer) -> list[list[int]]:
    from tmax_jax.agent.chat import ChatFormatter
    from tmax_jax.errors import ConfigError

    if args.prompts is not None:
        if not args.prompts.is_file():
            raise ConfigError(f"--prompts {args.prompts}: no such file")
        out = []
        for n, line in enumerate(args.prompts.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--prompts {args.prompts}:{n}: not JSON ({e.msg})") from None
            if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
                out.append(list(tokenizer.encode(rec["prompt"], add_special_tokens=False)))
            elif isinstance(rec, dict) and isinstance(rec.get("messages"), list):
                out.append(ChatFormatter(tokenizer).prompt_ids(rec["messages"]))
            else:
                raise ConfigError(
                    f'--prompts {args.prompts}:{n}: expected {{"prompt": text}} or {{"messages": [...]}}'
                )
        return out
    from tmax_jax.agent.episode import AgentConfig, make_chat
    from tmax_jax.tasks.loader import find_tasks, load_task

    cfg = AgentConfig(
        harness=args.harness, tool_schema_in_prompt=not args.no_tool_schema, system_prompt=args.system_prompt
    )
    chat = make_chat(tokenizer, cfg)
    system = cfg.prompt()
    return [
        chat.prompt_ids(
            [{"role": "system", "content": system}, {"role": "user", "content": load_task(t).instruction}]
        )
        for t in find_tasks(args.tasks)
    ]


def run(args: argparse.Namespace) -> int:
    import jax.numpy as jnp
    from flax import nnx

    from tmax_jax.checkpoints import load_hf, load_mtp, save_hf
    from tmax_jax.engine.api import model_eos_ids
    from tmax_jax.errors import CheckpointError, ConfigError
    from tmax_jax.models.qwen35.mtp import MultiTokenPredictor
    from tmax_jax.tokenizer import load_tokenizer
    from tmax_jax.train.mtp_fit import draft_tokens_per_step, fit_mtp, sample_completions

    ckpt, out = args.checkpoint, args.out
    if not ckpt.is_dir():
        raise CheckpointError(f"--checkpoint {ckpt}: not a directory")
    if out.exists() and (out.resolve() == ckpt.resolve() or any(out.iterdir())):
        raise ConfigError(f"--out {out}: must be a new or empty directory (not the checkpoint itself)")
    if not 0.0 <= args.heldout < 1.0:
        raise ConfigError(f"--heldout must be in [0, 1), got {args.heldout}")
    for name in ("samples", "max_new_tokens", "slots", "speculative_tokens"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    tokenizer = load_tokenizer(ckpt)
    prompts = [p for p in _prompts(args, tokenizer) if p]
    if len(prompts) < 2:
        raise ConfigError(f"fit-mtp needs at least 2 prompts, got {len(prompts)}")
    model = load_hf(ckpt, args.dtype)
    dt = jnp.dtype(args.dtype)
    mtp = load_mtp(ckpt, args.dtype)
    if mtp is None:
        print(f"{ckpt} holds no MTP module: fitting a new {args.layers}-layer one", flush=True)
        mtp = MultiTokenPredictor(
            model.config, args.layers, dtype=dt, param_dtype=dt, rngs=nnx.Rngs(args.seed)
        )
    eos = sorted(set(model_eos_ids(model)) | ({tokenizer.eos_token_id} - {None}))
    n_held = max(1, round(len(prompts) * args.heldout)) if args.heldout > 0 else 0
    train, held = prompts[: len(prompts) - n_held], prompts[len(prompts) - n_held :]
    gen = dict(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, slots=args.slots, eos_token_ids=eos
    )
    measure = dict(k=args.speculative_tokens, seed=args.seed + 7, **gen)
    before = draft_tokens_per_step(model, mtp, held, **measure) if held else 0.0
    rows, masks = sample_completions(model, train, samples=args.samples, seed=args.seed, **gen)
    print(f"sampled {len(rows)} completions of {len(train)} prompts", flush=True)
    losses = fit_mtp(
        model, mtp, rows, steps=args.steps, learning_rate=args.learning_rate, batch_size=args.batch_size,
        seed=args.seed, log=lambda m: print(m, flush=True), masks=masks,
    )  # fmt: skip
    after = draft_tokens_per_step(model, mtp, held, **measure) if held else 0.0
    save_hf(model, out, tokenizer=ckpt, mtp=mtp)
    k = args.speculative_tokens
    measured = (
        f"on {len(held)} held-out prompts, k={k}, T={args.temperature}: {before:.2f} -> {after:.2f} "
        f"tokens per model step (acceptance {(before - 1) / k:.2f} -> {(after - 1) / k:.2f})"
        if held
        else "no held-out prompts, acceptance not measured"
    )
    print(f"fit-mtp: loss {losses[0]:.4f} -> {losses[-1]:.4f}; {measured}; wrote {out}")
    return 0
