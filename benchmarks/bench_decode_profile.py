"""Where the engine's decode step spends its time, op by op, and which XLA CPU library serves it best.

1. **Trace.** A few blocks of ``bench_engine.py``'s model decoding (sampled, T=1) run under
   ``jax.profiler`` with XLA's per-op trace events on. Printed per slot count: the wall time per
   step, the op time per step (summed over threads), the share of the matmul fusions (a fusion whose
   computation holds a ``dot``) and the largest ops with the JAX op they come from.
2. **Libraries** (CPU only). The same block program compiled once per XLA CPU library setting
   (``compiler_options`` of that one program: YNNPACK, the default; YNNPACK for dots only; Eigen;
   Eigen with oneDNN), timed in turns in one process, best of ``--rounds`` blocks; every setting must
   give the same tokens.

    python3 benchmarks/bench_decode_profile.py                  # 8 and 32 slots
    python3 benchmarks/bench_decode_profile.py --slots 8 --no-libraries
"""

from __future__ import annotations

import os

# Per-op trace events of XLA's CPU runtime; read when the backend starts, so set before jax is used.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_enable_xprof_traceme=true").strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

LIBRARIES = {
    "ynnpack": {},
    "ynnpack-dots": {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT"},
    "eigen": {"xla_cpu_experimental_ynn_fusion_type": ""},
    "eigen+onednn": {
        "xla_cpu_experimental_ynn_fusion_type": "",
        "xla_cpu_use_onednn": True,
        "xla_cpu_experimental_onednn_custom_call": True,
    },
}
PLEN = 64


class Block:
    """The engine's block program for ``slots`` slots, compiled with ``options``, and a state whose
    slots all decode a sampled request; its attention reads a cache bucket that holds ``blocks``
    blocks' tokens after the prompt."""

    def __init__(self, model, slots: int, options: dict, blocks: int):
        from tmax_jax.engine import Engine
        from tmax_jax.engine.engine import PrefillRequest
        from tmax_jax.engine.sampling import SamplingParams

        steps = 8
        longest = PLEN + 1 + blocks * steps
        eng = Engine(model, max_concurrent_decodes=slots, max_cache_length=max(256, longest),
                     max_prefill_length=PLEN, decode_steps=steps, eos_token_ids=())  # fmt: skip
        self.params, self.steps, self.blocks_left = eng.params, steps, blocks
        rng = np.random.default_rng(0)
        state = eng.init_decode_state()
        for s in range(slots):
            req = PrefillRequest(
                rng.integers(0, eng.vocab_size, size=PLEN).tolist(),
                sampling_params=SamplingParams(temperature=1.0, seed=s),
                max_tokens=10**6,
            )
            state = eng.insert(eng.prefill_many(self.params, [req])[0], state, s)
        self.args = (jnp.int32(self.steps),)
        self.kwargs = dict(mtp=None, speculate=jnp.bool_(True))
        lowered = jax.jit(eng._generate_block_impl, static_argnums=(3,), donate_argnums=(1,)).lower(
            self.params, state, *self.args, eng.attend_length(longest), **self.kwargs
        )
        self.compiled = lowered.compile(compiler_options=options)
        self.hlo = self.compiled.as_text()
        self.state = state

    def run(self) -> tuple[float, np.ndarray]:
        """(seconds per step, tokens) of one block."""
        if self.blocks_left == 0:
            raise RuntimeError("Block: more blocks than its attention bucket holds")
        self.blocks_left -= 1
        t = time.perf_counter()
        self.state, blk = self.compiled(self.params, self.state, *self.args, **self.kwargs)
        tokens = np.asarray(blk.tokens)
        return (time.perf_counter() - t) / self.steps, tokens


CONTAINERS = ("conditional", "while", "call")  # their trace events enclose their ops' events


def instructions(hlo: str) -> dict[str, tuple[bool, str, str]]:
    """Per instruction name that runs as an op (not a conditional, loop or call, whose events hold
    their ops'): (whether it is a matmul, its shape, the JAX op it comes from)."""
    from bench_cpu_ceilings import hlo_computations

    comps = hlo_computations(hlo)
    out = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%([\w.\-]+) = (\S+) ([\w\-]+)\((.*)$", hlo, re.M):
        name, shape, kind, rest = m.groups()
        if kind in CONTAINERS:
            continue
        called = re.search(r"calls=%([\w.\-]+)", rest)
        body = comps.get(called.group(1), "") if called else ""
        is_dot = kind in ("dot", "convolution") or bool(re.search(r"= \S+ (dot|convolution)\(", body))
        op = re.search(r'op_name="([^"]+)"', rest)
        out[name] = (is_dot, shape, op.group(1).split("/body/")[-1] if op else "")
    return out


def trace(model, slots: int, blocks: int, warm: int = 2) -> None:
    block = Block(model, slots, {}, warm + blocks)
    for _ in range(warm):
        block.run()
    with tempfile.TemporaryDirectory() as d:
        jax.profiler.start_trace(d, create_perfetto_trace=True)
        t = time.perf_counter()
        for _ in range(blocks):
            block.run()
        wall = time.perf_counter() - t
        jax.profiler.stop_trace()
        files = glob.glob(f"{d}/**/*.json.gz", recursive=True)
        if not files:
            raise SystemExit(f"bench_decode_profile: the profiler wrote no trace under {d}")
        with gzip.open(files[0]) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    steps = blocks * block.steps
    known = instructions(block.hlo)
    per_op = collections.defaultdict(float)
    for e in events:
        if e["name"] in known:
            per_op[e["name"]] += e["dur"] / steps  # us per step
    mm = {k: v for k, v in per_op.items() if known[k][0]}
    total, mm_total = sum(per_op.values()), sum(mm.values())
    print(
        f"{slots} slots: {wall / steps * 1e3:.2f} ms per step (wall, traced); op time {total / 1e3:.2f} ms: "
        f"{len(mm)} matmul fusions {mm_total / 1e3:.2f} ms ({mm_total / max(total, 1e-9):.0%}), "
        f"{len(per_op) - len(mm)} other ops {(total - mm_total) / 1e3:.2f} ms"
    )
    for label, ops in (("matmuls", mm), ("other ops", {k: v for k, v in per_op.items() if k not in mm})):
        print(f"  largest {label}:")
        for name, us in sorted(ops.items(), key=lambda kv: -kv[1])[:5]:
            _, shape, op = known[name]
            print(f"    {us:7.1f} us  {name:<26} {shape:<22} {op[-60:]}")


def libraries(model, slots: int, rounds: int) -> None:
    blocks = {name: Block(model, slots, opts, rounds + 1) for name, opts in LIBRARIES.items()}
    times = collections.defaultdict(list)
    tokens = collections.defaultdict(list)
    for b in blocks.values():  # warm-up
        b.run()
    for _ in range(rounds):
        for name, b in blocks.items():
            s, t = b.run()
            times[name].append(s)
            tokens[name].append(t)
    ref = tokens["ynnpack"]
    same = all(all(np.array_equal(a, r) for a, r in zip(tokens[n], ref)) for n in blocks)
    cells = "  ".join(f"{n} {min(times[n]) * 1e3:.2f}" for n in blocks)
    print(
        f"{slots} slots, ms per step by library (best of {rounds} blocks, in turns): {cells}; same tokens: {same}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--blocks", type=int, default=4, help="traced blocks per slot count")
    ap.add_argument("--rounds", type=int, default=12, help="timed blocks per library")
    ap.add_argument("--no-libraries", action="store_true", help="skip the library comparison")
    args = ap.parse_args()

    from bench_engine import SMALL, hf_model, jax_model

    model = jax_model(hf_model(SMALL))
    print(f"devices: {jax.devices()}; bench_engine's model, sampled at T=1, {PLEN}-token prompts")
    for slots in args.slots:
        trace(model, slots, args.blocks)
    if not args.no_libraries and jax.default_backend() == "cpu":
        for slots in args.slots:
            libraries(model, slots, args.rounds)


if __name__ == "__main__":
    main()
