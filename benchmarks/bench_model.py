"""Prefill speed of the JAX Qwen 3.5 against transformers, and chunked vs recurrent delta rule.

CPU (default): a ~100M-parameter Qwen 3.5 shape at T=1024, jitted JAX forward vs transformers' PyTorch
forward with the same weights (ratio printed), then the two delta-rule forms at T=2048.
Accelerator (--accelerator): the 0.8B shape in bfloat16, tokens/s and model FLOP utilisation.

    python benchmarks/bench_model.py
    python benchmarks/bench_model.py --accelerator --peak-tflops 989
    python benchmarks/bench_model.py --delta-only --repeats 2   # only the delta-rule forms
"""

from __future__ import annotations

import argparse
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tmax_jax.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
from tmax_jax.models.qwen35.delta_rule import chunked_gated_delta_rule, recurrent_gated_delta_rule

# ~100M parameters with Qwen 3.5's structure (3 Gated DeltaNet : 1 gated attention, GQA, partial RoPE).
CPU_SHAPE = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=128,
    linear_num_key_heads=8,
    linear_num_value_heads=8,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    tie_word_embeddings=True,
    max_position_embeddings=4096,
)


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up / compile
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def best_of_interleaved(fns, repeats: int) -> list[float]:
    """Best time of each fn, their repeats taken in turn (fn1, fn2, fn1, fn2, ...)."""
    for fn in fns:
        fn()  # warm-up / compile
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [min(ts) for ts in times]


def n_params(model) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def forward_flops(cfg: Qwen35Config, n_matmul_params: int, batch: int, seq: int) -> float:
    """Model FLOPs of one forward: 2 per matmul weight per token, plus causal attention scores."""
    tokens = batch * seq
    attn = cfg.num_full_layers * 2 * 2 * batch * seq * seq / 2 * cfg.num_attention_heads * cfg.head_dim
    # Delta rule per token and head: state read, update, output (~3 rank-1/matvec ops of dk*dv).
    delta = (
        cfg.num_linear_layers
        * tokens
        * cfg.linear_num_value_heads
        * 6
        * cfg.linear_key_head_dim
        * cfg.linear_value_head_dim
    )
    return 2.0 * n_matmul_params * tokens + attn + delta


def projection_weights(model):
    """``(stacked weight, K, N)`` for every projection the forward multiplies by: each ``*_proj`` and
    the DeltaNet's ``in_proj_*``, stacked over a layer period, read as ``[K, N]`` per layer (the
    output projections contract everything but their last axis). The LM head is not among them."""
    for path, w in jax.tree_util.tree_leaves_with_path(nnx.state(model, nnx.Param)):
        name = str(getattr(path[-2] if len(path) > 1 else path[-1], "key", ""))
        if not (name.endswith("_proj") or name.startswith("in_proj_")):
            continue
        dims = w.shape[1:]
        if name in ("o_proj", "down_proj", "out_proj"):  # [..., D]: contracts everything but the last
            yield w, int(np.prod(dims[:-1])), dims[-1]
        else:
            yield w, dims[0], int(np.prod(dims[1:]))


def matmul_shapes(model) -> dict[tuple[int, int], int]:
    """The forward's weight matmuls as {(K, N): count}: every projection (``projection_weights``) and
    the LM head. The mixers' own work (delta rule, attention scores, conv) and every elementwise op
    are left out."""
    shapes: dict[tuple[int, int], int] = {}
    for w, k, n in projection_weights(model):
        shapes[(k, n)] = shapes.get((k, n), 0) + w.shape[0]
    d, v = model.config.hidden_size, model.config.vocab_size
    shapes[(d, v)] = shapes.get((d, v), 0) + 1
    return shapes


def matmul_bound(model, tokens: int, repeats: int) -> tuple[float, float]:
    """(seconds, GFLOP) of the forward's weight matmuls at ``tokens`` rows, each shape timed alone
    in float32 (best of ``repeats``): a lower bound on the forward's time on this host."""
    total_s = total_flop = 0.0
    rng = np.random.default_rng(0)
    mm = jax.jit(jnp.matmul)
    for (k, n), count in matmul_shapes(model).items():
        x = jnp.asarray(rng.standard_normal((tokens, k)), jnp.float32)
        w = jnp.asarray(rng.standard_normal((k, n)), jnp.float32)
        total_s += count * best_of(lambda x=x, w=w: mm(x, w).block_until_ready(), repeats)
        total_flop += count * 2.0 * tokens * k * n
    return total_s, total_flop / 1e9


def bench_cpu(args) -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from tmax_jax.checkpoints import load_hf

    cfg = Qwen35Config.preset("tiny", **CPU_SHAPE, layer_types=())
    hf_kwargs = {k: v for k, v in cfg.to_hf_config().items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hf_kwargs)).float().eval()
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        model = load_hf(d, dtype="float32")
    print(
        f"model: {n_params(model) / 1e6:.1f}M parameters, {cfg.num_hidden_layers} layers, T={args.seq}, B={args.batch}"
    )
    print(f"threads: torch {torch.get_num_threads()}, jax devices {jax.devices()}")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)

    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    x = jnp.asarray(ids)
    jax_s = best_of(lambda: fwd(state, x).block_until_ready(), args.repeats)
    tids = torch.as_tensor(ids, dtype=torch.long)

    def torch_fwd():
        with torch.no_grad():
            return hf(input_ids=tids).logits

    torch_s = best_of(torch_fwd, args.repeats)
    with torch.no_grad():
        diff = np.abs(hf(input_ids=tids).logits.numpy() - np.asarray(fwd(state, x))).max()
    tokens = args.batch * args.seq
    print(
        f"prefill  jax {tokens / jax_s:10.0f} tok/s   transformers {tokens / torch_s:10.0f} tok/s   "
        f"ratio jax/transformers = {torch_s / jax_s:.2f}x   (max |logit diff| {diff:.1e})"
    )
    bench_engine_prefill(model, hf, ids, args.repeats)
    bound_s, gflop = matmul_bound(model, tokens, max(args.repeats, 3))
    print(
        f"matmul bound: the forward's {gflop:.0f} GFLOP of weight matmuls, each shape timed alone, take "
        f"{bound_s:.3f} s ({gflop / bound_s:.0f} GFLOP/s); jax {jax_s:.3f} s, transformers {torch_s:.3f} s: "
        f"ceiling of the ratio {torch_s / bound_s:.2f}x"
    )
    bench_delta_rule(args.delta_seq, args.repeats)


def bench_engine_prefill(model, hf, ids: np.ndarray, repeats: int) -> None:
    """A request's prefill as the rollout engine runs it (its cache written, the first token drawn
    from the last position's logits) against transformers' forward with its cache and only the last
    logits (what its ``generate`` runs before the first token), one prompt at a time, same weights.
    The engine's prompt cache is off, so every call prefills."""
    import torch

    from tmax_jax.engine import Engine

    B, T = ids.shape
    engine = Engine(
        model, max_concurrent_decodes=B, max_cache_length=T + 8, max_prefill_length=T, prompt_cache_entries=0
    )
    params, firsts = engine.params, []

    def jax_prefill():
        firsts.clear()
        for row in ids:
            prefix, _ = engine.prefill(params=params, padded_tokens=row, true_length=T)
            firsts.append(prefix)
        jax.block_until_ready([(p.token, p.log_prob) for p in firsts])

    def torch_prefill():
        with torch.no_grad():
            return [
                hf(input_ids=torch.as_tensor(row[None], dtype=torch.long), use_cache=True, logits_to_keep=1)
                .logits[0, -1]
                .double()
                .log_softmax(-1)
                .numpy()
                for row in ids
            ]

    jax_s, torch_s = best_of_interleaved([jax_prefill, torch_prefill], repeats)
    jax_prefill()
    ref = torch_prefill()
    same = all(int(p.token[0]) == int(np.argmax(r)) for p, r in zip(firsts, ref))
    diff = max(abs(float(p.log_prob[0]) - r[int(p.token[0])]) for p, r in zip(firsts, ref))
    tokens = B * T
    print(
        f"engine prefill (cache + first token)  jax {tokens / jax_s:8.0f} tok/s   transformers "
        f"{tokens / torch_s:8.0f} tok/s   ratio = {torch_s / jax_s:.2f}x   (greedy first token "
        f"{'the same' if same else 'DIFFERENT'}, |logprob diff| {diff:.1e})"
    )


def bench_delta_rule(seq: int, repeats: int, heads: int = 16, dk: int = 128, dv: int = 128) -> None:
    from device_check import delta_rule_inputs

    inputs = delta_rule_inputs(1, 1, seq, heads, dk, dv, jnp.float32, jnp.float32)[:5]  # no initial state
    chunked = jax.jit(chunked_gated_delta_rule)
    recurrent = jax.jit(recurrent_gated_delta_rule)
    # Interleaved repeats: on a shared machine a burst of load then hits both forms alike.
    c_s, r_s = best_of_interleaved(
        [lambda: chunked(*inputs)[0].block_until_ready(), lambda: recurrent(*inputs)[0].block_until_ready()],
        repeats,
    )
    err = float(jnp.abs(chunked(*inputs)[0] - recurrent(*inputs)[0]).max())
    print(
        f"delta rule T={seq} H={heads} dk=dv={dk}: chunked {seq / c_s:9.0f} tok/s  recurrent {seq / r_s:9.0f} tok/s  "
        f"ratio chunked/recurrent = {r_s / c_s:.2f}x  (max |diff| {err:.1e})"
    )


def bench_accelerator(args) -> None:
    cfg = Qwen35Config.preset("0.8b")
    model = Qwen35ForCausalLM(cfg, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    fwd = jax.jit(lambda s, x: nnx.merge(graphdef, s).hidden_states(x))
    fwd_logits = jax.jit(lambda s, x: nnx.merge(graphdef, s)(x))
    ids = jnp.asarray(
        np.random.default_rng(0).integers(0, cfg.vocab_size, (args.batch, args.seq)).astype(np.int32)
    )
    total = n_params(model)
    embed = cfg.vocab_size * cfg.hidden_size
    body = total - embed  # tied: the embedding is the head, counted separately below
    tokens = args.batch * args.seq
    print(
        f"device {jax.devices()[0].device_kind}: 0.8B shape, {total / 1e9:.2f}B params, bf16, B={args.batch} T={args.seq}"
    )
    for name, f, head in (("hidden_states", fwd, 0), ("logits (fp32 head)", fwd_logits, embed)):
        s = best_of(lambda f=f: f(state, ids).block_until_ready(), args.repeats)
        flops = forward_flops(cfg, body + head, args.batch, args.seq)
        mfu = flops / s / (args.peak_tflops * 1e12)
        print(
            f"prefill {name:20s} {tokens / s:12.0f} tok/s   {flops / s / 1e12:7.1f} TFLOP/s   MFU {100 * mfu:5.1f}% "
            f"(of {args.peak_tflops:.0f} TFLOP/s bf16 peak)"
        )
    bench_delta_rule(args.delta_seq, args.repeats)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--accelerator", action="store_true", help="0.8B bf16 on the default accelerator")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--delta-seq", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--delta-only", action="store_true", help="only chunked vs recurrent delta rule")
    p.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak of the chip (H100/H200: 989)"
    )
    args = p.parse_args()
    if args.delta_only:
        bench_delta_rule(args.delta_seq, args.repeats)
    else:
        bench_accelerator(args) if args.accelerator else bench_cpu(args)


if __name__ == "__main__":
    main()
