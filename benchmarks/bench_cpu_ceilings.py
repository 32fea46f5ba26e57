"""What this CPU host's XLA allows: the ceilings behind the CPU ratios of bench_model and bench_engine.

Three properties of XLA's CPU backend, measured in this run, and the bounds they set:

1. **Batched small matmuls run on one thread.** A ``[2048, 2048] @ [2048, 2048]`` matmul is split
   over all cores; a batch of 16 ``[128, 128] @ [128, 128]`` (one chunk's state product for 16
   heads) is not. The chunked delta rule is made of the latter, so its time is at least its matmul
   FLOPs at the batched rate, against the recurrent form's measured time: the ratio's ceiling.
2. **Every op in a loop body costs a few microseconds**, however small (thunk dispatch).
3. **Weights stream from memory** at the rate of a chain of ``[8, D] @ [D, N]`` matmuls over
   distinct weights (the decode step's pattern at 8 slots).

With the engine's compiled decode step (ops per step counted in its HLO) and the benchmark model's
weight bytes, 2 and 3 give an estimate of one decode step: weights / bandwidth + ops x overhead. It
is not a strict bound: the chain streams 63 MB, more than the L3 cache, while a smaller model partly
stays in it, and some of a step's ops overlap.

    python3 benchmarks/bench_cpu_ceilings.py
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def best(fn, *args, repeats: int = 10) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return min(times)


def matmul_rates() -> tuple[float, float]:
    """(GFLOP/s of one large matmul, GFLOP/s of 16 batched 128x128x128 matmuls)."""
    mm = jax.jit(lambda a, b: jnp.einsum("...ij,...jk->...ik", a, b))
    big = jnp.ones((2048, 2048), jnp.float32)
    small = jnp.ones((16, 128, 128), jnp.float32)
    return 2 * 2048**3 / best(mm, big, big) / 1e9, 2 * 16 * 128**3 / best(mm, small, small, repeats=50) / 1e9


def chunked_flops(T: int, H: int, dk: int, dv: int, C: int) -> float:
    """Matmul FLOPs of delta_rule's chunked forward (the UT inverse left out: a lower bound).

    Per chunk and head: the scores [k_beta; q] k^T (4 C^2 dk), the state reads [k_read; q_read] S
    (4 C dk dv), T r and P v_new (2 C^2 dv each), the state update k_write^T v_new (2 C dk dv)."""
    per_chunk = 4 * C * C * dk + 6 * C * dk * dv + 4 * C * C * dv
    return -(-T // C) * H * per_chunk


def delta_rule_ceiling(batched_gflops: float, T: int = 2048, H: int = 16, d: int = 128, C: int = 64) -> None:
    from bench_model import best_of_interleaved
    from device_check import delta_rule_inputs

    from tmax_jax.models.qwen35.delta_rule import chunked_gated_delta_rule, recurrent_gated_delta_rule

    inputs = delta_rule_inputs(1, 1, T, H, d, d, jnp.float32, jnp.float32)[:5]  # no initial state
    chunked = jax.jit(lambda *a: chunked_gated_delta_rule(*a, chunk_size=C)[0])
    recurrent = jax.jit(lambda *a: recurrent_gated_delta_rule(*a)[0])
    c_s, r_s = best_of_interleaved(
        [lambda: chunked(*inputs).block_until_ready(), lambda: recurrent(*inputs).block_until_ready()], 3
    )
    flops = chunked_flops(T, H, d, d, C)
    floor_s = flops / (batched_gflops * 1e9)
    print(
        f"delta rule T={T} H={H} dk=dv={d} C={C}: chunked {c_s * 1e3:.1f} ms ({flops / 1e9:.2f} GFLOP in matmuls, "
        f"{flops / c_s / 1e9:.0f} GFLOP/s), recurrent {r_s * 1e3:.1f} ms; ratio {r_s / c_s:.2f}x, "
        f"ceiling at the batched rate {r_s / floor_s:.2f}x (chunked >= {floor_s * 1e3:.1f} ms)"
    )


def per_op_overhead_us(ops: int = 200, steps: int = 20) -> float:
    """Microseconds per op of a loop body of ``ops`` small ops that XLA cannot fuse together."""
    x = jnp.ones((8, 256), jnp.float32)
    w = jnp.full((256, 256), 1e-3, jnp.float32)

    def body(c, _):
        for i in range(ops // 2):
            c = jnp.tanh(c)
            c = c @ w if i % 2 else jnp.cumsum(c, axis=1) * 1e-3
        return c, None

    f = jax.jit(lambda x, w: jax.lax.scan(body, x, None, length=steps)[0])
    return best(f, x, w) / steps / ops * 1e6


def weight_stream_gbps(rows: int = 8, d: int = 256, n: int = 768, layers: int = 40) -> float:
    """GB/s of a chain of ``[rows, d] @ [d, n] @ [n, d]`` matmuls over distinct weights (~63 MB)."""
    keys = jax.random.split(jax.random.key(0), 2 * layers)
    ws = [jax.random.normal(keys[i], (d, n) if i % 2 == 0 else (n, d)) * 0.02 for i in range(2 * layers)]

    def chain(x, ws):
        for a, b in zip(ws[::2], ws[1::2]):
            x = x + jnp.tanh(x @ a) @ b
        return x

    s = best(jax.jit(chain), jnp.ones((rows, d), jnp.float32), ws)
    return sum(w.size for w in ws) * 4 / s / 1e9


def decode_estimate(gbps: float, op_us: float, slots: int = 8) -> None:
    from bench_engine import SMALL, hf_model, jax_model

    from tmax_jax.engine import Engine

    model = jax_model(hf_model(SMALL))
    plen, new = 64, 64
    engine = Engine(
        model, max_concurrent_decodes=slots, max_cache_length=plen + new + 8, max_prefill_length=plen,
        eos_token_ids=(),
    )  # fmt: skip
    params, state = engine.params, engine.init_decode_state()
    prompt = np.random.default_rng(0).integers(0, SMALL["vocab_size"], size=plen)
    prefix, _ = engine.prefill(params=params, padded_tokens=prompt, true_length=plen, max_tokens=10**6)
    for s in range(slots):
        state = engine.insert(prefix, state, s)
    K = engine.decode_steps
    attend = engine.attend_length(plen + 1 + K)
    hlo = (
        jax.jit(engine._generate_block_impl, static_argnums=(3,))
        .lower(params, state, jnp.int32(K), attend)
        .compile()
        .as_text()
    )
    ops = max(_loop_body_ops(hlo).values())
    weight_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    times = []
    for _ in range(6):
        fresh = jax.tree.map(jnp.copy, state)  # the block donates its state
        jax.block_until_ready(fresh)
        t = time.perf_counter()
        _, blk = engine.generate_block(params, fresh, K, plen + 1 + K)
        blk.tokens.block_until_ready()
        times.append(time.perf_counter() - t)
    step_ms = min(times[1:]) / K * 1e3
    stream_ms = weight_bytes / (gbps * 1e9) * 1e3
    ops_ms = ops * op_us / 1e3
    print(
        f"decode step, {slots} slots, {weight_bytes / 1e6:.1f} MB of weights, {ops} ops per step: measured "
        f"{step_ms:.2f} ms; estimate {stream_ms + ops_ms:.2f} ms = weights {stream_ms:.2f} ms + ops {ops_ms:.2f} ms"
    )


def hlo_computations(hlo: str) -> dict[str, str]:
    """Each computation of a compiled module's HLO text: its name -> its body's lines."""
    return {
        m.group(1): m.group(2)
        for m in re.finditer(r"^%?([\w.\-]+) \(.*?\) -> .*? \{\n(.*?)\n\}", hlo, re.M | re.S)
    }


def _loop_body_ops(hlo: str) -> dict[str, int]:
    """Executable instructions (not parameters, tuples, bitcasts, constants) of each while body."""
    bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
    skip = {"parameter", "get-tuple-element", "bitcast", "constant", "tuple"}
    counts = {}
    for name, body in hlo_computations(hlo).items():
        if name in bodies:
            kinds = re.findall(r"^\s*(?:ROOT )?%[\w.\-]+ = \S+ ([\w\-]+)\(", body, re.M)
            counts[name] = sum(k not in skip for k in kinds)
    return counts


def main() -> None:
    print(f"devices: {jax.devices()}")
    big, batched = matmul_rates()
    print(f"matmul: one 2048^3 {big:.0f} GFLOP/s; 16 x 128^3 batched {batched:.0f} GFLOP/s")
    delta_rule_ceiling(batched)
    op_us = per_op_overhead_us()
    gbps = weight_stream_gbps()
    print(f"loop body: {op_us:.1f} us per small op; weights streamed at {gbps:.1f} GB/s (8-row matmuls)")
    decode_estimate(gbps, op_us)


if __name__ == "__main__":
    main()
