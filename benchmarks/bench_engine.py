"""Decode throughput and time-to-first-token: the tmax-jax engine vs transformers ``generate``.

Columns: ``engine tok/s`` = all generated tokens / wall time of the whole batch through the
orchestrator (prefills included); ``decode tok/s`` = the same once every request has its first
token (continuous decoding); ``step-only`` = the jitted decode alone, in blocks of
``decode_steps`` (``step ms`` per decode step; ``1-step ms`` = one ``Engine.generate`` call); speedups
are against transformers' generate tokens/s (prefill included) on the same prompts. The last lines:
the decode-step time ratio between the largest and 8 slots, the acceptance check's shape (the
project's ``generate()``, 8 sampled prompts of 64 tokens, against transformers' sampled ``generate``),
the matmul floor of that case (its weight matmuls alone, and the ratio they cap), the same case on
the ``tiny`` preset (``--api-preset``), a decode step over a long cache, and a GRPO-style group case
(``--group-samples`` sampled completions of each of ``--group-prompts`` prompts) with the number of
prompt rows the engine prefilled.

Same random Qwen 3.5 weights (built with transformers, loaded into JAX via tmax_jax.checkpoints),
same prompts, greedy, every sequence generating exactly ``--new`` tokens, measured in one run:

    python benchmarks/bench_engine.py                       # ~9M-parameter model, CPU
    python benchmarks/bench_engine.py --preset 0.8b --dtype bfloat16 --concurrency 64 --skip-hf   # accelerator
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import numpy as np

SMALL = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_conv_kernel_dim=4, linear_key_head_dim=32,
    linear_value_head_dim=32, linear_num_key_heads=4, linear_num_value_heads=8, tie_word_embeddings=True,
    max_position_embeddings=4096,
)  # fmt: skip


def hf_model(cfg: dict):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**cfg)).float().eval()


def jax_model(hf, dtype: str = "float32"):
    """``hf``'s weights in tmax-jax's model, loaded from a checkpoint dir as a user loads one."""
    from tmax_jax.checkpoints import load_hf

    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        return load_hf(d, dtype)


def bench_hf(model, prompts: np.ndarray, new: int) -> tuple[float, float]:
    """(decode tokens/s, time to first token in s) for one batch of equal-length prompts."""
    import torch

    ids = torch.as_tensor(prompts, dtype=torch.long)
    mask = torch.ones_like(ids)
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, attention_mask=mask)
    with torch.no_grad():
        model.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm-up
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
        wall = time.perf_counter() - t0
    assert out.shape[1] == prompts.shape[1] + new
    return prompts.shape[0] * new / wall, ttft


def warm_prefill(engine, plen: int, vocab: int) -> None:
    """Compile every batched-prefill shape the orchestrator may use (1, 2, 4... prompts of ``plen``)
    on prompts the timed runs do not use (the engine's prompt cache would serve those)."""
    from tmax_jax.engine.engine import PrefillRequest

    rng = np.random.default_rng(12345)
    b = 1
    while b <= engine.max_prefill_batch:
        reqs = [PrefillRequest(rng.integers(0, vocab, size=plen).tolist()) for _ in range(b)]
        jax.block_until_ready(engine.prefill_many(engine.params, reqs)[-1].token)
        b *= 2


def weight_matrices(model, head: bool = True) -> list:
    """Every weight a forward step multiplies by, as its own ``[K, N]`` buffer: each layer's
    projections (``bench_model.projection_weights``; a stack of layers split outside any jit, so no
    copy is timed) and, with ``head``, the LM head."""
    import jax.numpy as jnp
    from bench_model import projection_weights

    mats = [
        jnp.asarray(layer.reshape(k, n)) for w, k, n in projection_weights(model) for layer in np.asarray(w)
    ]
    if head:
        mats.append(jnp.asarray(np.asarray(model.lm_head_weight())))
    return mats


def matmul_floor_s(model, rows: int, head: bool = True, repeats: int = 30) -> tuple[float, float]:
    """(seconds, weight bytes) of one program that does nothing but a step's weight matmuls at
    ``rows`` rows, all independent (XLA may overlap them): the least time those matmuls take on this
    host, short of reading fewer weight bytes (a decode step, few rows) or doing fewer FLOPs (a
    prefill, many rows). Best of ``repeats``."""
    import jax.numpy as jnp

    mats = weight_matrices(model, head)
    rng = np.random.default_rng(0)
    xs = {k: jnp.asarray(rng.standard_normal((rows, k)), jnp.float32) for k in {m.shape[0] for m in mats}}
    run = jax.jit(lambda xs, mats: [xs[m.shape[0]] @ m.astype(jnp.float32) for m in mats])
    jax.block_until_ready(run(xs, mats))
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(run(xs, mats))
        best = min(best, time.perf_counter() - t0)
    return best, float(sum(m.size * m.dtype.itemsize for m in mats))


def bench_engine(model, prompts: np.ndarray, new: int, cache_dtype) -> dict:
    from tmax_jax.engine import Engine, Orchestrator, Request, SamplingParams

    c, plen = prompts.shape
    engine = Engine(
        model, max_concurrent_decodes=c, max_cache_length=plen + new + 8, max_prefill_length=plen,
        cache_dtype=cache_dtype, eos_token_ids=(),
    )  # fmt: skip
    greedy = SamplingParams(temperature=0.0)
    reqs = [Request(prompt=p.tolist(), max_tokens=new, sampling=greedy) for p in prompts]
    warm_prefill(engine, plen, engine.vocab_size)
    with Orchestrator(engine) as orch:
        orch.generate(reqs[:1] + [Request(prompt=reqs[0].prompt, max_tokens=3, sampling=greedy)])  # compile
        t0 = time.perf_counter()
        outs = orch.generate(reqs)
        t_end = time.perf_counter()
        wall = t_end - t0
        # Decode phase: from the moment the last request got its first token (all slots busy).
        decode_start = max(t0 + o.ttft_s for o in outs)
        one = orch.submit(Request(prompt=reqs[0].prompt, max_tokens=1, sampling=greedy)).result()
    assert all(len(o.tokens) == new for o in outs)
    # The jitted step alone, without the orchestrator's per-token host work.
    params, state = engine.params, engine.init_decode_state()
    prefix, _ = engine.prefill(params=params, padded_tokens=prompts[0], true_length=plen, max_tokens=10**6)
    for s in range(c):
        state = engine.insert(prefix, state, s)
    state, res = engine.generate(params, state)
    res.data.block_until_ready()
    steps = 32
    t0 = time.perf_counter()
    for _ in range(steps):
        state, res = engine.generate(params, state)
    res.data.block_until_ready()
    one_step_s = (time.perf_counter() - t0) / steps
    k = engine.decode_steps
    state, blk = engine.generate_block(params, state, k, plen + steps + 1)
    blk.tokens.block_until_ready()
    blocks = 4
    t0 = time.perf_counter()
    for b in range(blocks):
        state, blk = engine.generate_block(params, state, k, plen + steps + (b + 1) * k + 1)
    blk.tokens.block_until_ready()
    step_s = (time.perf_counter() - t0) / (blocks * k)
    return dict(
        tok_s=c * new / wall,
        decode_tok_s=c * (new - 1) / max(t_end - decode_start, 1e-9),
        ttft=one.ttft_s,
        ttft_in_batch=statistics.median(o.ttft_s for o in outs),
        step_tok_s=c / step_s,
        step_ms=step_s * 1e3,
        one_step_ms=one_step_s * 1e3,
    )


def right_draft(model):
    """(model, mtp) where the draft knows the model (``oracle_draft`` at mix 0): the mechanics' best
    case, how much a step of k drafts can save."""
    from tmax_jax.models.qwen35.mtp import oracle_draft

    return oracle_draft(model)


def bench_speculative(
    model, mtp, prompts: np.ndarray, new: int, k: int, temperature: float, cache_dtype
) -> dict:
    """The plain engine and one drafting ``k`` tokens per step with ``mtp``, on the same requests
    through the orchestrator (best of 2 warm runs each): tok/s, decode steps, equal tokens."""
    from tmax_jax.engine import Engine, Orchestrator, Request, SamplingParams

    c, plen = prompts.shape
    kw = dict(max_concurrent_decodes=c, max_cache_length=plen + new + 8 * (k + 1), max_prefill_length=plen,
              cache_dtype=cache_dtype, eos_token_ids=())  # fmt: skip
    reqs = [
        Request(prompt=p.tolist(), max_tokens=new, sampling=SamplingParams(temperature=temperature, seed=i))
        for i, p in enumerate(prompts)
    ]
    out = {}
    for name, engine in (
        ("plain", Engine(model, **kw)),
        ("spec", Engine(model, mtp=mtp, speculative_tokens=k, **kw)),
    ):
        warm_prefill(engine, plen, engine.vocab_size)
        with Orchestrator(engine) as orch:
            orch.generate(reqs)  # compile
            best = float("inf")
            for _ in range(2):
                steps0 = orch.steps
                t0 = time.perf_counter()
                res = orch.generate(reqs)
                best = min(best, time.perf_counter() - t0)
                steps = orch.steps - steps0
        out[name] = dict(tok_s=c * new / best, steps=steps, tokens=[r.tokens for r in res])
    out["same"] = out["plain"]["tokens"] == out["spec"]["tokens"]
    return out


def bench_group(model, hf, prompts: np.ndarray, samples: int, new: int, slots: int, cache_dtype) -> dict:
    """``samples`` sampled completions (T=1) of each prompt: engine tok/s, prompt rows it prefilled,
    and transformers' sampled generate (``num_return_sequences``) on the same prompts."""
    from tmax_jax.engine import Engine, Orchestrator, Request, SamplingParams

    n, plen = prompts.shape
    engine = Engine(
        model, max_concurrent_decodes=slots, max_cache_length=plen + new + 8, max_prefill_length=plen,
        cache_dtype=cache_dtype, eos_token_ids=(),
    )  # fmt: skip
    reqs = [
        Request(
            prompt=p.tolist(), max_tokens=new, sampling=SamplingParams(temperature=1.0, seed=i * samples + j)
        )
        for i, p in enumerate(prompts)
        for j in range(samples)
    ]
    with Orchestrator(engine) as orch:
        orch.generate(
            [Request(prompt=[1] * plen, max_tokens=3, sampling=SamplingParams(temperature=1.0))] * 2
        )
        engine.prefill_counts.clear()
        t0 = time.perf_counter()
        outs = orch.generate(reqs)
        wall = time.perf_counter() - t0
    assert all(len(o.tokens) == new for o in outs)
    out = dict(tok_s=len(reqs) * new / wall, prefill_rows=engine.prefill_counts["rows"],
               prefill_calls=engine.prefill_counts["calls"], requests=len(reqs), hf_tok_s=float("nan"))  # fmt: skip
    if hf is not None:
        import torch

        ids = torch.as_tensor(prompts, dtype=torch.long)
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0,
                  attention_mask=torch.ones_like(ids), num_return_sequences=samples)  # fmt: skip
        with torch.no_grad():
            hf.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            out["hf_tok_s"] = len(reqs) * new / (time.perf_counter() - t0)
    return out


def bench_api(model, hf, prompts: np.ndarray, new: int, rounds: int = 3) -> dict:
    """The acceptance check's shape: ``tmax_jax.engine.generate`` (sampled, T=1) on ``prompts`` against
    transformers' sampled ``generate`` on the same weights, best of ``rounds`` warm calls each
    (the first engine call compiles and is reported apart)."""
    import torch

    from tmax_jax.engine import generate

    t0 = time.perf_counter()
    generate(model, prompts.tolist(), max_new_tokens=new, temperature=1.0, seed=0)
    cold = time.perf_counter() - t0
    eng, ref = [], []
    ids = torch.as_tensor(prompts, dtype=torch.long)
    kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None, pad_token_id=0,
              attention_mask=torch.ones_like(ids))  # fmt: skip
    for r in range(rounds):
        t0 = time.perf_counter()
        outs = generate(model, prompts.tolist(), max_new_tokens=new, temperature=1.0, seed=r + 1)
        eng.append(sum(len(o.tokens) for o in outs) / (time.perf_counter() - t0))
        with torch.no_grad():
            t0 = time.perf_counter()
            hf.generate(ids, max_new_tokens=new, min_new_tokens=new, **kw)
            ref.append(len(prompts) * new / (time.perf_counter() - t0))
    return dict(tok_s=max(eng), hf_tok_s=max(ref), cold_s=cold)


def bench_long(model, slots: int, keys: int, cache_dtype) -> float:
    """ms per decode step with ``slots`` slots attending over ``keys`` cached positions."""
    from tmax_jax.engine import Engine

    eng = Engine(model, max_concurrent_decodes=slots, max_cache_length=keys, max_prefill_length=64,
                 min_attend_bucket=keys, cache_dtype=cache_dtype, eos_token_ids=())  # fmt: skip
    params = eng.params
    prompt = np.arange(48) % eng.vocab_size
    prefix, _ = eng.prefill(params=params, padded_tokens=prompt, true_length=48, max_tokens=10**6)
    state = eng.init_decode_state()
    for s in range(slots):
        state = eng.insert(prefix, state, s)
    k = eng.decode_steps
    state, blk = eng.generate_block(params, state, k, 48 + k)
    blk.tokens.block_until_ready()
    times = []
    for b in range(5):
        t0 = time.perf_counter()
        state, blk = eng.generate_block(params, state, k, 48 + (b + 2) * k)
        blk.tokens.block_until_ready()
        times.append((time.perf_counter() - t0) / k)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt-len", type=int, default=48)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument(
        "--preset", default=None, help="a Qwen35Config preset (random weights) instead of the ~9M model"
    )
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--skip-hf", action="store_true", help="engine only (large presets)")
    ap.add_argument("--group-prompts", type=int, default=4, help="group case: prompts (0 = skip the case)")
    ap.add_argument("--group-samples", type=int, default=32, help="group case: samples per prompt")
    ap.add_argument("--api-prompts", type=int, default=8, help="generate() case: prompts (0 = skip)")
    ap.add_argument("--api-prompt-len", type=int, default=64)
    ap.add_argument(
        "--api-preset",
        default="tiny",
        help="the generate() case again on this Qwen35Config preset's random weights ('' = skip)",
    )
    ap.add_argument(
        "--long-keys",
        type=int,
        nargs="*",
        default=[4096],
        help="long-cache decode case: cached keys (none = skip)",
    )
    ap.add_argument("--long-slots", type=int, nargs="+", default=[8], help="long-cache decode case: slots")
    ap.add_argument(
        "--speculative", type=int, nargs="*", default=[1, 3],
        help="speculative case (8 sequences): drafted tokens per step, each run with a random MTP module "
        "(greedy and sampled) and with a draft that knows the model (empty = skip)",
    )  # fmt: skip
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from tmax_jax.models.qwen35 import Qwen35Config, Qwen35ForCausalLM

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    hf = None
    if args.preset:
        cfg = Qwen35Config.preset(args.preset)
        model = Qwen35ForCausalLM(cfg, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
        vocab = cfg.vocab_size
    else:
        hf = hf_model(SMALL)
        model = jax_model(hf, args.dtype)
        vocab = SMALL["vocab_size"]
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    print(f"model: {args.preset or '~9M test shape'}, {n_params / 1e6:.1f}M params, {args.dtype}, "
          f"devices: {jax.devices()[0].platform} x{jax.device_count()}, prompt {args.prompt_len}, new {args.new}")  # fmt: skip
    rng = np.random.default_rng(0)
    print(f"{'conc':>5} {'engine tok/s':>13} {'decode tok/s':>13} {'step-only tok/s':>16} {'step ms':>8} "
          f"{'1-step ms':>9} {'TTFT ms':>8} {'HF tok/s':>9} {'HF TTFT ms':>11} {'speedup':>8} {'decode speedup':>15}")  # fmt: skip
    step_ms = {}
    for c in args.concurrency:
        prompts = rng.integers(0, vocab, size=(c, args.prompt_len)).astype(np.int32)
        e = bench_engine(model, prompts, args.new, dtype)
        h_tok, h_ttft = (
            bench_hf(hf, prompts, args.new) if hf is not None and not args.skip_hf else (float("nan"),) * 2
        )
        step_ms[c] = e["step_ms"]
        print(f"{c:>5} {e['tok_s']:>13.0f} {e['decode_tok_s']:>13.0f} {e['step_tok_s']:>16.0f} {e['step_ms']:>8.2f} "
              f"{e['one_step_ms']:>9.2f} {e['ttft'] * 1e3:>8.1f} {h_tok:>9.0f} {h_ttft * 1e3:>11.1f} "
              f"{e['tok_s'] / h_tok:>7.1f}x {e['decode_tok_s'] / h_tok:>14.1f}x")  # fmt: skip
    top = max(step_ms)
    if 8 in step_ms and top > 8:
        print(f"decode step, {top} slots / 8 slots: {step_ms[top] / step_ms[8]:.2f}x")
    if args.api_prompts > 0 and hf is not None and not args.skip_hf:
        prompts = rng.integers(0, vocab, size=(args.api_prompts, args.api_prompt_len)).astype(np.int32)
        a = bench_api(model, hf, prompts, args.new)
        print(f"generate(): {args.api_prompts} prompts x {args.api_prompt_len} tokens, {args.new} sampled: engine "
              f"{a['tok_s']:.0f} tok/s, HF {a['hf_tok_s']:.0f} tok/s ({a['tok_s'] / a['hf_tok_s']:.1f}x; best of 3 "
              f"warm calls each; the first engine call, compiling, took {a['cold_s']:.1f} s)")  # fmt: skip
        n = args.api_prompts
        floor_s, nbytes = matmul_floor_s(model, n)
        prefill_s, _ = matmul_floor_s(model, n * args.api_prompt_len, head=False, repeats=10)
        hf_call_s = n * args.new / a["hf_tok_s"]
        print(f"matmul floor: a decode step's weight matmuls alone at {n} rows ({nbytes / 2**20:.1f} MiB of "
              f"weights) take {floor_s * 1e3:.2f} ms ({nbytes / floor_s / 1e9:.1f} GB/s; the engine's step at 8 "
              f"slots: {step_ms.get(8, float('nan')):.2f} ms), the prefill's ({n} x {args.api_prompt_len} rows, no "
              f"head) {prefill_s * 1e3:.1f} ms; {args.new} steps and one prefill at the floor cap the generate() "
              f"ratio at {hf_call_s / (args.new * floor_s + prefill_s):.1f}x")  # fmt: skip
    if args.api_prompts > 0 and args.api_preset and hf is not None and not args.skip_hf:
        small = Qwen35Config.preset(args.api_preset)
        small_kw = {k: v for k, v in small.to_hf_config().items() if k not in ("architectures", "model_type")}
        small_hf = hf_model(small_kw)
        small_model = jax_model(small_hf, args.dtype)
        prompts = rng.integers(0, small.vocab_size, size=(args.api_prompts, args.api_prompt_len)).astype(
            np.int32
        )
        a = bench_api(small_model, small_hf, prompts, args.new)
        print(f"generate() on the {args.api_preset!r} preset (hidden {small.hidden_size}, {small.num_hidden_layers} "
              f"layers), same shape: engine {a['tok_s']:.0f} tok/s, HF {a['hf_tok_s']:.0f} tok/s "
              f"({a['tok_s'] / a['hf_tok_s']:.1f}x)")  # fmt: skip
    for slots in args.long_slots:
        for keys in args.long_keys:
            ms = bench_long(model, slots, keys, dtype)
            print(f"long cache: {slots} slots attending over {keys} keys: {ms:.2f} ms per decode step")
    if args.speculative:
        from tmax_jax.models.qwen35.mtp import MultiTokenPredictor

        prompts = rng.integers(0, vocab, size=(8, args.prompt_len)).astype(np.int32)
        random_mtp = MultiTokenPredictor(model.config, 1, dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(1))
        known = right_draft(model)
        print(
            "speculative decoding, 8 sequences (engine with k drafted tokens per step against the plain one):"
        )
        for k in args.speculative:
            for label, (m, d), t in (
                ("random MTP, greedy", (model, random_mtp), 0.0),
                ("random MTP, sampled T=1", (model, random_mtp), 1.0),
                ("right draft, sampled T=1", known, 1.0),
            ):
                r = bench_speculative(m, d, prompts, args.new, k, t, dtype)
                p, q = r["plain"], r["spec"]
                print(f"  k={k} {label:<25} {q['tok_s']:>6.0f} vs {p['tok_s']:>6.0f} tok/s ({q['tok_s'] / p['tok_s']:.2f}x), "
                      f"decode steps {q['steps']} vs {p['steps']}, same tokens: {r['same']}")  # fmt: skip
    if args.group_prompts > 0:
        slots = max(args.concurrency)
        prompts = rng.integers(0, vocab, size=(args.group_prompts, args.prompt_len)).astype(np.int32)
        g = bench_group(
            model, None if args.skip_hf else hf, prompts, args.group_samples, args.new, slots, dtype
        )
        print(f"group: {args.group_samples} samples x {args.group_prompts} prompts on {slots} slots: engine "
              f"{g['tok_s']:.0f} tok/s, HF {g['hf_tok_s']:.0f} tok/s ({g['tok_s'] / g['hf_tok_s']:.1f}x); "
              f"prefilled {g['prefill_rows']} prompt rows in {g['prefill_calls']} calls for {g['requests']} requests")  # fmt: skip


if __name__ == "__main__":
    main()
