"""One part of the accelerator check (``benchmarks/device_check.sh`` runs every part, each in its own
process under its own time limit, so a crash, an out-of-memory or a hang costs only that part).

    python benchmarks/device_check.py --part check            # masked head, Pallas kernels vs the JAX path
    python benchmarks/device_check.py --part kernel           # delta-rule ms, tokens/s, TFLOP/s, temporaries
    python benchmarks/device_check.py --part attention        # Triton attention kernel vs the JAX form
    python benchmarks/device_check.py --part train --size 2b  # train step tokens/s, MFU, peak memory
    ... --smoke                                               # tiny sizes, runs on a CPU (interpret mode)

Every measurement prints as it is made (a timeout keeps what came before); every sub-step catches
its own error, prints it and goes on. Ratios and rates are measured in this run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_train_step's batch builder

H200_BF16_PEAK_TFLOPS = 989.0  # dense bf16, vendor datasheet (SXM); ~790 measured on random data here


def say(*a):
    print(*a, flush=True)


def attempt(label, fn, *args):
    """``fn(*args)``; on any error print it (with the last frames) and carry on with ``None``."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - a device check reports and continues
        say(f"[{label}] ERROR {type(e).__name__}: {str(e)[:2000]}")
        say("".join(traceback.format_exception(e)[-6:])[-3000:])
        return None


def timed(fn, repeats):
    """(first call seconds (compile + run), median of ``repeats`` further calls)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times)


def peak_bytes():
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def gib(n):
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def delta_rule_inputs(seed, B, T, H, K, V, qk_dtype, v_dtype):
    rng = np.random.default_rng(seed)
    q = rng.normal(size=(B, T, H, K)).astype(np.float32)
    k = rng.normal(size=(B, T, H, K)).astype(np.float32)
    q = q / np.linalg.norm(q, axis=-1, keepdims=True) * K**-0.5
    k = k / np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.normal(size=(B, T, H, V)).astype(np.float32)
    g = (-np.log1p(np.exp(rng.normal(size=(B, T, H))))).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, T, H))))).astype(np.float32)
    s0 = rng.normal(size=(B, H, K, V)).astype(np.float32)
    return (
        jnp.asarray(q, qk_dtype),
        jnp.asarray(k, qk_dtype),
        jnp.asarray(v, v_dtype),
        jnp.asarray(g),
        jnp.asarray(beta),
        jnp.asarray(s0),
    )


# ------------------------------------------------------------------------------------------------
def implementations(smoke):
    """name -> f(q, k, v, g, beta, s0, groups, chunk) for the JAX path and the kernels; "pallas-high"
    (TF32x3 matmuls) only where it differs from "pallas" (GPU), or in the smoke run (plumbing)."""
    from tmax_jax.kernels import chunked_gated_delta_rule, pallas_chunked_gated_delta_rule, resolve_kernels

    _, launcher, interpret = resolve_kernels("pallas")
    impls = {"jax": lambda *a, C: chunked_gated_delta_rule(*a, C, kernels="jax")}
    if launcher == "gpu" or smoke:
        # Before "pallas": at HIGHEST Triton emits every float32 dot as IEEE FMA loops (no tensor
        # cores), dozens of [64, 128]-sized dots per kernel, which may be what never finished
        # compiling on the H100/H200 runs; TF32x3 dots are tensor-core MMAs, far less code.
        impls["pallas-high"] = lambda *a, C: pallas_chunked_gated_delta_rule(
            *a, C, backend=launcher, interpret=interpret, precision="high"
        )
    impls["pallas"] = lambda *a, C: chunked_gated_delta_rule(*a, C, kernels="pallas")
    return impls


def _check_one(B, T, H, K, V, C, impls):
    say(f"[check] B={B} T={T} H={H} K={K} V={V} chunk={C}")
    q, k, v, g, beta, s0 = delta_rule_inputs(0, B, T, H, K, V, jnp.float32, jnp.float32)
    groups = np.zeros((B, T), np.int32)
    groups[0, T // 3 :], groups[0, T // 2 + 5 :] = 1, 2  # three packed segments in row 0
    groups = jnp.asarray(groups)
    rng = np.random.default_rng(1)
    do = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
    ds = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
    res = {}
    for name, impl in impls.items():
        fn = jax.jit(lambda *a, impl=impl: impl(*a, groups, C=C))
        if name != "jax":
            # The kernels hung on GPUs so far: the forward alone first, lowered, compiled and run as
            # separate printed stages, so a timeout shows which stage never finished.
            t0 = time.perf_counter()
            lowered = fn.lower(q, k, v, g, beta, s0)
            say(f"[check] {name:11s} forward lowered in {time.perf_counter() - t0:.1f}s")
            t0 = time.perf_counter()
            compiled = lowered.compile()
            say(f"[check] {name:11s} forward compiled in {time.perf_counter() - t0:.1f}s")
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(q, k, v, g, beta, s0))
            say(f"[check] {name:11s} forward ran in {time.perf_counter() - t0:.1f}s")
        t0 = time.perf_counter()
        (o, s), pull = jax.vjp(fn, q, k, v, g, beta, s0)
        res[name] = jax.block_until_ready([o, s, *pull((do, ds))])
        say(f"[check] {name:11s} forward + VJP (compile and run) {time.perf_counter() - t0:.1f}s")
    worst = {}
    for name in res:
        if name == "jax":
            continue
        errs = []
        for a, b in zip(res[name], res["jax"]):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            errs.append(float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)))
        worst[name] = max(errs)
        parts = " ".join(
            f"{n} {e:.1e}" for n, e in zip(("out", "final", "dq", "dk", "dv", "dg", "dbeta", "ds0"), errs)
        )
        say(f"[check] {name:11s} max|x - jax| / max|jax|: {parts}")
    return worst


def _check_masked_head(B, T, D, V, chunk, hidden_dtype=jnp.bfloat16):
    """The train step's masked LM head (own backward, blocks past the response skipped) against the
    whole head's autodiff on the device: logprobs, d hidden and d head, relative to their scale.
    ``hidden_dtype``: the hidden states' (bfloat16 as in training; float32 checks the backward's
    arithmetic without bfloat16's rounding)."""
    from tmax_jax.rl.logprobs import token_logprobs

    k = jax.random.split(jax.random.key(7), 4)
    h = jax.random.normal(k[0], (B, T, D), jnp.float32).astype(hidden_dtype)
    emb = 0.02 * jax.random.normal(k[1], (V, D), jnp.float32)
    t = jax.random.randint(k[2], (B, T), 0, V, jnp.int32)
    mask = (jnp.arange(T)[None, :] >= T // 4) & (jax.random.uniform(k[3], (B, T)) < 0.8)
    g = jnp.where(mask, 1.0, 0.0)

    def masked(h, emb):
        return jnp.sum(token_logprobs(h, emb, t, chunk_size=chunk, mask_BxT=mask, head_vd=True) * g)

    def whole(h, emb):
        return jnp.sum(jnp.where(mask, token_logprobs(h, emb.T, t, chunk_size=chunk), 0.0) * g)

    t0 = time.perf_counter()
    got = jax.block_until_ready(jax.jit(jax.value_and_grad(masked, (0, 1)))(h, emb))
    ms = time.perf_counter() - t0
    ref = jax.block_until_ready(jax.jit(jax.value_and_grad(whole, (0, 1)))(h, emb))
    names = ("loss", "d hidden", "d head")
    rows = []
    for name, x, y in zip(names, jax.tree.leaves(got), jax.tree.leaves(ref)):
        err = float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)))) / max(
            float(jnp.max(jnp.abs(y.astype(jnp.float32)))), 1e-30
        )
        rows.append((name, jnp.dtype(x.dtype), err, head_tolerance(x.dtype)))
    ok = all(err < tol for _, _, err, tol in rows)
    detail = ", ".join(f"{n} {e:.2e} ({dt.name}, < {tol:.1e})" for n, dt, e, tol in rows)
    say(
        f"[check] {'PASS' if ok else 'FAIL'} masked LM head B={B} T={T} D={D} V={V} chunk {chunk}, "
        f"{jnp.dtype(hidden_dtype).name} hidden: "
        f"max|x - whole| / max|whole|: {detail}; first call {ms:.1f} s"
    )


def head_tolerance(dtype) -> float:
    """The masked head check's bound for one output, relative to its largest magnitude: 1e-3 in
    float32; in a narrower dtype two of its ulps at that magnitude. d hidden has the hidden states'
    dtype (bfloat16 in training), and two float32 sums in different orders round to neighbouring
    bfloat16 values: one ulp is 2^-7 of the value's power of two (measured on CPU and an H100 at the
    check's shape, 2026-12-05: 2.23e-3 in bfloat16, 1.4e-7 with float32 hidden states)."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float32 or dtype == jnp.float64:
        return 1e-3
    return 2.0 * 2.0 ** -jnp.finfo(dtype).nmant


def _check_f32_dot(M, D, V, repeats):
    """Each ``TMAX_JAX_F32_DOT`` algorithm on a head-shaped float32 matmul ``[M, D] @ [D, V]``: its
    error against float64 (relative to the largest logit) and its time on the device."""
    from tmax_jax.models.qwen35.numerics import F32_DOT_ALGORITHMS

    rng = np.random.default_rng(3)
    h = rng.standard_normal((M, D)).astype(np.float32)
    w = (0.02 * rng.standard_normal((D, V))).astype(np.float32)
    ref = h.astype(np.float64) @ w.astype(np.float64)
    hd, wd = jnp.asarray(h), jnp.asarray(w)
    for name, algorithm in F32_DOT_ALGORITHMS.items():
        precision = None if jax.default_backend() == "cpu" else algorithm
        fn = jax.jit(
            lambda a, b, p=precision: jnp.einsum(
                "md,dv->mv", a, b, precision=p, preferred_element_type=jnp.float32
            )
        )
        try:
            out = np.asarray(fn(hd, wd), np.float64)
            _, med = timed(lambda fn=fn: fn(hd, wd), repeats)
        except Exception as e:  # noqa: BLE001 (an algorithm this device lacks)
            say(f"[check] f32 dot {name:8s} failed: {type(e).__name__}: {str(e)[:160]}")
            continue
        err = np.abs(out - ref).max() / np.abs(ref).max()
        say(
            f"[check] f32 dot {name:8s} [{M}x{D}] @ [{D}x{V}]: max error / max|logit| {err:.1e}  "
            f"{med * 1e3:8.2f} ms  {2 * M * D * V / med / 1e12:7.1f} TFLOP/s"
        )


def part_check(args):
    """The kernels (kernels="pallas": Triton on GPU, Mosaic on TPU, interpret mode on CPU) against the
    pure-JAX path: outputs, final state and the VJP, float32 inputs, packed rows, T % C != 0. First,
    the train step's masked LM head against the whole head (pure JAX; seconds)."""
    from tmax_jax.kernels import resolve_kernels

    head_shapes = [(2, 100, 32, 500, 64)] if args.smoke else [(2, 4096 + 37, 1024, 32768, 1024)]
    for shape in head_shapes:
        for hidden_dtype in (jnp.bfloat16, jnp.float32):
            attempt(f"masked head {shape}", _check_masked_head, *shape, hidden_dtype)
    dot_shape = (64, 32, 256, 2) if args.smoke else (2048, 2048, 32768, 10)
    attempt(f"f32 dot {dot_shape}", _check_f32_dot, *dot_shape)

    _, launcher, interpret = resolve_kernels("pallas")
    impls = implementations(args.smoke)
    say(
        f"[check] backend {jax.default_backend()} ({jax.devices()[0].device_kind}); launcher {launcher}, interpret={interpret}"
    )
    # A small shape first: on an H200 (2026-12-04) the 2,085-token one did not finish in 80 s, and
    # the per-implementation times below tell compile from run.
    shapes = (
        [(2, 100, 2, 16, 16, 16)]
        if args.smoke
        else [(1, 128 + 37, 1, 128, 128, 64), (2, 2048 + 37, 4, 128, 128, 64)]
    )
    results = [attempt(f"check {shape}", _check_one, *shape, impls) for shape in shapes]
    for name in impls:
        if name == "jax":
            continue
        errs = [r[name] for r in results if r is not None]
        worst = max(errs) if len(errs) == len(shapes) else float("inf")  # a failed shape fails the check
        verdict = "PASS" if worst < 1e-3 else "FAIL"
        say(
            f"[check] {verdict} {name}: worst relative error {worst:.2e} over {len(errs)}/{len(shapes)} shapes (threshold 1e-3)"
        )


# ------------------------------------------------------------------------------------------------
def chunk_flops(C, K, V):
    """Matmul FLOPs per chunk of this implementation's algorithm (value dim unsplit), forward and
    backward (the backward recomputes the forward's chunk internals)."""
    inverse = int(np.log2(C)) * 2 * 2 * C**3  # divide and conquer: log2(C) rounds of two matmuls
    fwd = 2 * C * C * (3 * K + 2 * V) + 3 * 2 * C * K * V + inverse
    bwd = inverse + 2 * C**3 * 2 + 9 * 2 * C * C * K + 5 * 2 * C * C * V + 7 * 2 * C * K * V
    return fwd, bwd


def compile_and_time(fn, inputs, repeats):
    """A jitted ``fn`` on ``inputs``: ``(compile seconds, first call seconds, median of repeats,
    XLA's compiled temporaries in bytes or the error's name when the backend gives none)``."""
    t0 = time.perf_counter()
    compiled = fn.lower(*inputs).compile()
    compile_s = time.perf_counter() - t0
    try:
        temp = compiled.memory_analysis().temp_size_in_bytes
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        temp = type(e).__name__
    first, med = timed(lambda: compiled(*inputs), repeats)
    return compile_s, first, med, temp


def _time_delta_rule(label, fn, inputs, flops, tokens, repeats, token_heads=None):
    compile_s, _, med, temp = compile_and_time(fn, inputs, repeats)
    mem = ""
    if token_heads is not None:
        mem = (
            f"  temporaries n/a ({temp})"
            if isinstance(temp, str)
            else f"  temporaries {gib(temp)} ({temp / token_heads / 1024:.2f} KiB/token/head)"
        )
    say(
        f"[kernel] {label}  compile {compile_s:6.2f}s  {med * 1e3:9.2f} ms  {tokens / med:12.0f} tok/s  "
        f"{flops / med / 1e12:7.2f} TFLOP/s{mem}"
    )
    return med


def part_kernel(args):
    """Delta-rule forward and forward+backward: pure JAX vs the Pallas kernels, at one training shape
    (q/k float32 as the layer makes them, v bfloat16), with XLA's compiled temporaries per token."""
    B, T, H, K, V, C = (1, 256, 2, 16, 16, 16) if args.smoke else (1, 32768, 16, 128, 128, 64)
    say(f"[kernel] B={B} T={T} H={H} K={K} V={V} chunk={C} on {jax.devices()[0].device_kind}")
    q, k, v, g, beta, _ = delta_rule_inputs(0, B, T, H, K, V, jnp.float32, jnp.bfloat16)
    w = jnp.asarray(np.random.default_rng(2).normal(size=(B, T, H, V)), jnp.float32)
    fwd_f, bwd_f = chunk_flops(C, K, V)
    n_chunks = B * H * (-(-T // C))
    repeats = 1 if args.smoke else 5
    results = {}
    for name, impl in implementations(args.smoke).items():

        def loss(q, k, v, g, beta, impl=impl):
            o, s = impl(q, k, v, g, beta, None, None, C=C)
            return jnp.sum(o * w) + jnp.sum(s)

        fwd = jax.jit(lambda *a, impl=impl: impl(*a, None, None, C=C))
        train = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
        inputs = (q, k, v, g, beta)
        med_fwd = attempt(
            f"kernel {name} fwd",
            _time_delta_rule,
            f"{name:11s} fwd    ",
            fwd,
            inputs,
            fwd_f * n_chunks,
            B * T,
            repeats,
        )
        med_train = attempt(
            f"kernel {name} fwd+bwd",
            _time_delta_rule,
            f"{name:11s} fwd+bwd",
            train,
            inputs,
            (fwd_f + bwd_f) * n_chunks,
            B * T,
            repeats,
            B * T * H,
        )
        results[name] = (med_fwd, med_train)
    jf, jt = results.get("jax", (None, None))
    for name, (pf, pt) in results.items():
        if name != "jax" and None not in (jf, jt, pf, pt):
            say(f"[kernel] speed-up {name} / jax: fwd {jf / pf:.2f}x, fwd+bwd {jt / pt:.2f}x (same run)")
    say("[kernel] TFLOP/s count this implementation's matmul FLOPs (chunk_flops), not the recurrence's")
    say(f"[kernel] device peak memory so far {gib(peak_bytes())}")


# ------------------------------------------------------------------------------------------------
def _attention_fn(kernels, B, T, block):
    """Causal self-attention over one packed row as the model runs it (masked_attention)."""
    from tmax_jax.models.qwen35.attention import masked_attention

    idx = jnp.arange(T, dtype=jnp.int32)

    def f(q, k, v, seg):
        return masked_attention(
            q,
            k,
            v,
            jnp.broadcast_to(idx, (B, T)),
            seg,
            idx,
            seg,
            block=block,
            causal_self=True,
            kernels=kernels,
        )

    return f


def _attention_inputs(seed, B, T, G, R, E):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, G, R, E)), jnp.bfloat16)
    k, v = (jnp.asarray(rng.normal(size=(B, T, G, E)), jnp.bfloat16) for _ in range(2))
    seg = np.ones((B, T), np.int32)
    seg[:, T // 2 - 37 :] = 2  # two packed sequences, then pads
    seg[:, T - T // 16 :] = 0
    return q, k, v, jnp.asarray(seg)


def _time_attention(name, kernels, B, T, G, R, E, block, smoke):
    """Forward+backward of one attention form at ``T`` tokens: ms, TFLOP/s, compiled temporaries."""
    q, k, v, seg = _attention_inputs(2, B, T, G, R, E)
    w = jnp.asarray(np.random.default_rng(3).normal(size=q.shape), jnp.bfloat16)
    fn = _attention_fn(kernels, B, T, block)
    train = jax.jit(
        jax.value_and_grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg).astype(jnp.float32) * w), (0, 1, 2))
    )
    compile_s, first, med, temp = compile_and_time(train, (q, k, v), 1 if smoke else 3)
    # Causal: forward 2 matmuls over half the T x T scores, backward 5 (scores again, dP, dQ, dK, dV).
    flops = 7 * B * G * R * E * T * T
    mem = f"n/a ({temp})" if isinstance(temp, str) else f"{temp / 2**20:9.1f} MiB"
    say(
        f"[attention] {name:6s} T={T:6d} fwd+bwd compile {compile_s:5.1f}s first {first:5.2f}s  {med * 1e3:9.2f} ms  "
        f"{flops / med / 1e12:7.1f} TFLOP/s (causal)  temporaries {mem}"
    )
    return med


def part_attention(args):
    """Causal self-attention at the Qwen 3.5 2B shape (8 query heads over 2 kv heads, head dim 256,
    bfloat16): the Triton kernel (``attention_kernels="pallas"``, JAX's Pallas GPU flash attention)
    against the JAX flash form on a packed row (values and the VJP), then forward+backward ms,
    TFLOP/s and XLA's compiled temporaries of each at long rows."""
    from tmax_jax.models.qwen35.attention import QUERY_BLOCK

    B, G, R, E = (1, 1, 2, 32) if args.smoke else (1, 2, 4, 256)
    T_check, lengths = (160, [256]) if args.smoke else (2048 + 64, [32768, 65536])
    block = 64 if args.smoke else QUERY_BLOCK  # past it both forms leave the unblocked softmax
    say(f"[attention] G={G} R={R} E={E} bf16 on {jax.devices()[0].device_kind}")

    def check():
        q, k, v, seg = _attention_inputs(0, B, T_check, G, R, E)
        dout = jnp.asarray(np.random.default_rng(1).normal(size=q.shape), jnp.bfloat16)
        got = {}
        for name, kernels in (("jax", "jax"), ("triton", "pallas")):
            t0 = time.perf_counter()
            out, vjp = jax.vjp(_attention_fn(kernels, B, T_check, block), q, k, v, seg)
            grads = vjp(dout)[:3]
            jax.block_until_ready(grads)
            got[name] = [np.asarray(x, np.float32) for x in (out, *grads)]
            say(
                f"[attention] {name:6s} T={T_check} values + VJP in {time.perf_counter() - t0:.1f}s (with compile)"
            )
        worst = 0.0
        for label, a, b in zip(("out", "dq", "dk", "dv"), got["jax"], got["triton"]):
            rel = float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30))
            worst = max(worst, rel)
            say(f"[attention] {label}: max |triton - jax| / max |jax| = {rel:.2e}")
        # bfloat16 outputs summed in different orders: a few ulps (2^-8 each) of the largest entry.
        say(
            f"[attention] {'PASS' if worst < 2**-5 else 'FAIL'} triton vs jax: worst {worst:.2e} (bound {2**-5:.2e})"
        )

    attempt("attention check", check)
    for T in lengths:
        times = {
            name: attempt(
                f"attention {name} T={T}", _time_attention, name, kernels, B, T, G, R, E, block, args.smoke
            )
            for name, kernels in (("jax", "jax"), ("triton", "pallas"))
        }
        if None not in times.values():
            say(f"[attention] T={T}: triton / jax speed-up {times['jax'] / times['triton']:.2f}x (same run)")
    say(f"[attention] device peak memory so far {gib(peak_bytes())}")


# ------------------------------------------------------------------------------------------------
def model_flops_per_token(cfg, n_matmul_params, seq):
    """6 N (N: parameters in matmuls; a tied embedding is the LM head) + causal attention
    6 * layers * heads * head_dim * T (PaLM's 12 L H Q T, halved for the causal mask)."""
    attn = 6 * cfg.num_full_layers * cfg.num_attention_heads * cfg.head_dim * seq
    return 6 * n_matmul_params, attn


def part_train(args):
    """One optimizer step (forward, float32 log-probs, DPPO loss, backward, AdamW), bf16 compute,
    float32 params, remat="full" (or ``--remat``), one row of ``tokens`` tokens, one device."""
    from tmax_jax.models.qwen35 import Qwen35Config
    from tmax_jax.rl import OptimizerConfig, RLConfig
    from tmax_jax.rl.train_step import TrainStep, make_model
    from tmax_jax.sharding import MeshConfig, make_mesh

    size = "tiny" if args.smoke else args.size
    token_counts = [128, 256] if args.smoke else [int(t) for t in args.tokens.split(",")]
    # The smoke run exercises the kernels (interpret mode) in the step, which "auto" would not on CPU.
    kernels = "pallas" if args.smoke and args.kernels == "auto" else args.kernels
    cfg = dataclasses.replace(Qwen35Config.preset(size), kernels=kernels, attention_kernels=args.attention)
    model = make_model(cfg, remat=args.remat, dtype=jnp.bfloat16)
    mesh_cfg = MeshConfig(data=1, fsdp=-1, tensor=1)
    step = TrainStep(
        model,
        RLConfig(optimizer=OptimizerConfig(learning_rate=1e-6)),
        make_mesh(mesh_cfg, jax.devices()[:1]),
        mesh_cfg,
    )
    holder = {"state": step.init_state()}
    n_params = sum(x.size for x in jax.tree.leaves(holder["state"].params))
    n_matmul = n_params - (0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.hidden_size)
    say(
        f"[train {size}] {n_params / 1e6:.1f}M params, kernels={cfg.kernels}, "
        f"attention_kernels={cfg.attention_kernels}, remat={args.remat}, precision={precision_setting()}, "
        f"{jax.devices()[0].device_kind}"
    )
    for tokens in token_counts:
        attempt(f"train {size} {tokens}", _train_one, args, cfg, step, holder, n_matmul, tokens, size)


def _train_one(args, cfg, step, holder, n_matmul, tokens, size):
    from bench_train_step import make_batch

    batch = step.put_batch(make_batch(cfg, 1, tokens))

    def run():
        holder["state"], metrics = step(holder["state"], batch)
        return metrics["loss"]

    first, med = timed(run, 1 if args.smoke else 2)
    dense, attn = model_flops_per_token(cfg, n_matmul, tokens)
    line = f"[train {size}] {tokens:6d} tokens  first {first:7.1f}s  step {med:7.3f}s  {tokens / med:10.0f} tok/s"
    if jax.default_backend() in ("gpu", "tpu"):
        peak = args.peak_tflops * 1e12
        line += f"  MFU(6N) {dense * tokens / med / peak:6.1%}  MFU(6N+attn) {(dense + attn) * tokens / med / peak:6.1%}"
    else:
        line += "  MFU n/a (no accelerator)"
    say(line + f"  peak memory so far {gib(peak_bytes())}")


def precision_setting() -> str:
    from tmax_jax.models.qwen35.numerics import precision_policy

    return precision_policy()


# ------------------------------------------------------------------------------------------------
def summarize_trace(trace_dir: str, top: int = 25) -> list[str]:
    """Lines: the busiest operations of a ``jax.profiler`` trace, by summed duration, per device (the
    GPU's kernels; on a CPU host, XLA's thunks), with their share of that device's busy time."""
    import gzip
    import json

    paths = sorted(glob_traces(trace_dir))
    if not paths:
        return [f"no perfetto trace under {trace_dir}"]
    doc = json.load(gzip.open(paths[-1]))
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    proc = {
        e["pid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    devices = {pid for pid, name in proc.items() if "/device:" in name}
    host_ops = {pid for pid, name in proc.items() if "/host:CPU" in name} if not devices else set()
    sums: dict[tuple[str, str], float] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("pid") not in devices | host_ops:
            continue
        name = e.get("name", "?")
        if not devices and (name.startswith("$") or "::" in name or name.startswith("Pjit")):
            continue  # host Python frames and runtime bookkeeping, not operations
        args = e.get("args") or {}
        label = args.get("hlo_op") or args.get("long_name") or name
        key = (proc[e["pid"]], str(label)[:90])
        sums[key] = sums.get(key, 0.0) + float(e.get("dur", 0.0))
    lines = []
    for dev in sorted({k[0] for k in sums}):
        total = sum(v for k, v in sums.items() if k[0] == dev)
        lines.append(f"{dev}: {total / 1e3:.1f} ms of operations")
        rows = sorted(((v, k[1]) for k, v in sums.items() if k[0] == dev), reverse=True)[:top]
        lines += [f"  {v / 1e3:9.2f} ms {v / total:6.1%}  {name}" for v, name in rows]
    return lines


def part_profile(args):
    """One ``--size`` train step at the first of ``--tokens`` under ``jax.profiler``: the operations
    that take its time (where the MFU goes). The trace is copied to $OUT when that is set."""
    import shutil
    import tempfile

    from bench_train_step import make_batch

    from tmax_jax.models.qwen35 import Qwen35Config
    from tmax_jax.rl import OptimizerConfig, RLConfig
    from tmax_jax.rl.train_step import TrainStep, make_model
    from tmax_jax.sharding import MeshConfig, make_mesh

    size = "tiny" if args.smoke else args.size
    tokens = 128 if args.smoke else int(args.tokens.split(",")[0])
    cfg = dataclasses.replace(
        Qwen35Config.preset(size), kernels=args.kernels, attention_kernels=args.attention
    )
    mesh_cfg = MeshConfig(data=1, fsdp=-1, tensor=1)
    step = TrainStep(
        make_model(cfg, remat=args.remat, dtype=jnp.bfloat16),
        RLConfig(optimizer=OptimizerConfig(learning_rate=1e-6)),
        make_mesh(mesh_cfg, jax.devices()[:1]),
        mesh_cfg,
    )
    state = step.init_state()
    batch = step.put_batch(make_batch(cfg, 1, tokens))
    state, m = step(state, batch)  # compile
    jax.block_until_ready(m["loss"])
    trace_dir = tempfile.mkdtemp(prefix="tmax-profile-")
    t0 = time.perf_counter()
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        state, m = step(state, batch)
        jax.block_until_ready(m["loss"])
    say(
        f"[profile {size}] {tokens} tokens, kernels={cfg.kernels}, precision={precision_setting()}, "
        f"remat={args.remat}: one traced step {time.perf_counter() - t0:.2f}s"
    )
    for line in summarize_trace(trace_dir):
        say(f"[profile {size}] {line}")
    out = os.environ.get("OUT")
    if out:
        for p in glob_traces(trace_dir):
            if os.path.getsize(p) < 15 << 20:
                name = f"profile-{size}-{tokens}-{precision_setting()}-{args.remat}.json.gz"
                shutil.copy(p, os.path.join(out, name))


def glob_traces(trace_dir):
    """The perfetto traces ``jax.profiler.trace(..., create_perfetto_trace=True)`` wrote under ``trace_dir``."""
    import glob

    return glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True)


# ------------------------------------------------------------------------------------------------
def part_engine(args):
    """The rollout engine's decode on the device: a ``--size`` model in bfloat16 (weights and KV
    cache), every slot holding the same 512-token prompt, ``decode_steps`` tokens per jitted block;
    tokens/s and ms per step at each slot count (issue 17's 64 and 256 slots)."""
    from tmax_jax.models.qwen35 import Qwen35Config
    from tmax_jax.rl.train_step import make_model

    size = "tiny" if args.smoke else args.size
    plen, blocks = (32, 2) if args.smoke else (512, 8)
    slot_counts = [4, 8] if args.smoke else [int(s) for s in args.slots.split(",")]
    cfg = Qwen35Config.preset(size)
    model = make_model(cfg, remat="none", dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    prompt = np.random.default_rng(0).integers(0, cfg.vocab_size, plen).astype(np.int32)
    say(f"[engine {size}] bf16 weights and cache, prompt {plen} tokens, {jax.devices()[0].device_kind}")
    if args.speculative:
        attempt(
            f"speculative {size}", _speculative, model, prompt, slot_counts[0], blocks, size, args.speculative
        )
        return
    for slots in slot_counts:
        attempt(f"engine {size} {slots}", _engine_one, model, prompt, slots, blocks, size)


def _speculative(model, prompt, slots, blocks, size, k):
    """Speculative decoding's cost and best case on the device: the plain engine and one drafting
    ``k`` tokens per step, both on ``bench_engine.right_draft``'s model (mixers and MLPs write
    nothing, so the draft is always right; the work per step is the real model's). Prints ms per
    model step of each, tokens per step and slot, and the acceptance rate at which the speculative
    step breaks even (its ms / the plain step's ms = 1 + acceptance * k)."""
    from bench_engine import right_draft

    oracle, mtp = right_draft(model)
    plain_ms, _ = _engine_one(oracle, prompt, slots, blocks, size)
    spec_ms, per_step = _engine_one(oracle, prompt, slots, blocks, size, mtp=mtp, k=k)
    say(
        f"[speculative {size}] {slots} slots, k={k}: verify step {spec_ms:.2f} ms = {spec_ms / plain_ms:.2f}x "
        f"the plain step; {per_step:.2f} tokens per step with a right draft ({per_step * plain_ms / spec_ms:.2f}x "
        f"the plain tok/s); breaks even at acceptance {(spec_ms / plain_ms - 1) / k:.2f}"
    )


def _engine_one(model, prompt, slots, blocks, size, mtp=None, k=0):
    """(ms per decode step, tokens per step and slot) of ``slots`` slots on one prompt; with ``mtp``,
    a speculative engine drafting ``k`` tokens per step."""
    from tmax_jax.engine import Engine

    plen = len(prompt)
    engine = Engine(
        model, max_concurrent_decodes=slots, max_cache_length=plen + 512 * (k + 1), max_prefill_length=plen,
        cache_dtype=jnp.bfloat16, eos_token_ids=(), mtp=mtp, speculative_tokens=k,
    )  # fmt: skip
    params, state = engine.params, engine.init_decode_state()
    t0 = time.perf_counter()
    prefix, _ = engine.prefill(params=params, padded_tokens=prompt, true_length=plen, max_tokens=10**6)
    state = engine.bulk_insert(prefix, state, list(range(slots)))
    steps, per = engine.decode_steps, engine.tokens_per_step  # the longest a slot can get per block
    # One attention length for every block (the longest a slot can reach): one compiled program.
    attend = plen + (blocks + 1) * steps * per + 1
    state, blk = engine.generate_block(params, state, steps, attend)  # compile
    jax.block_until_ready(blk.tokens)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    emitted = 0
    for _ in range(blocks):
        state, blk = engine.generate_block(params, state, steps, attend)
        emitted += blk.valid.sum()
    emitted = int(jax.device_get(emitted))
    step_s = (time.perf_counter() - t0) / (blocks * steps)
    per_step = emitted / (blocks * steps * slots)
    say(
        f"[engine {size}] {slots:4d} slots  first {first:6.1f}s  decode step {step_s * 1e3:7.2f} ms  "
        f"{per_step:.2f} tokens/step  {slots * per_step / step_s:9.0f} tok/s  peak memory so far {gib(peak_bytes())}"
    )
    return step_s * 1e3, per_step


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--part", required=True, choices=["check", "kernel", "attention", "train", "engine", "profile"]
    )
    ap.add_argument("--size", default="0.8b", help="train: a Qwen35Config preset")
    # 32K first: the aim is the 2B step's MFU at 32K tokens, so a timeout loses the others.
    ap.add_argument("--tokens", default="32768,8192,65536", help="train: tokens per step (one row each)")
    ap.add_argument("--slots", default="64,256", help="engine: slot counts")
    ap.add_argument(
        "--speculative",
        type=int,
        default=0,
        help="engine: draft this many tokens per step (first slot count)",
    )
    ap.add_argument(
        "--kernels", default="auto", choices=["auto", "jax", "pallas"], help="train: delta-rule path"
    )
    ap.add_argument(
        "--remat",
        default="full",
        choices=["full", "layers"],
        help="train/profile: the model's remat (layers: no period-level recompute, more memory)",
    )
    ap.add_argument(
        "--attention",
        default="auto",
        choices=["auto", "jax", "pallas"],
        help="train/profile: the model's attention_kernels (pallas: the Triton kernel on GPU)",
    )
    ap.add_argument(
        "--peak-tflops", type=float, default=H200_BF16_PEAK_TFLOPS, help="per-device peak for MFU"
    )
    ap.add_argument(
        "--f32-dot",
        default=None,
        help="TMAX_JAX_F32_DOT for this part (highest, bf16x6, bf16x3, tf32x3): the head's and the "
        "delta rule's float32 matmuls",
    )
    ap.add_argument(
        "--precision",
        default=None,
        choices=["mixed", "float32"],
        help="TMAX_JAX_PRECISION for this part: mixed (bf16 delta-rule operands, a three-pass head) or "
        "float32 (every delta-rule matmul and the head at TMAX_JAX_F32_DOT: the policy before)",
    )
    ap.add_argument(
        "--smoke", action="store_true", help="tiny sizes; runs on CPU (kernels in interpret mode)"
    )
    args = ap.parse_args()
    if args.f32_dot is not None:
        os.environ["TMAX_JAX_F32_DOT"] = args.f32_dot
    if args.precision is not None:
        os.environ["TMAX_JAX_PRECISION"] = args.precision
    from tmax_jax.models.qwen35.numerics import f32_dot_setting, head_dot_setting

    say(
        f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}, "
        f"TMAX_JAX_F32_DOT={f32_dot_setting()}, TMAX_JAX_PRECISION={precision_setting()}, "
        f"head={head_dot_setting()}"
    )
    {
        "check": part_check,
        "kernel": part_kernel,
        "attention": part_attention,
        "train": part_train,
        "engine": part_engine,
        "profile": part_profile,
    }[args.part](args)


if __name__ == "__main__":
    main()
