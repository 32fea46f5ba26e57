"""The decode block's compiled memory: does the loop over decode steps update the cache in place?

Compiles the rollout engine's ``generate_block`` (a tiny bfloat16 model, bfloat16 cache) for this
host, or ahead of time for a TPU (``--tpu v5p:2x2x1``: libtpu's compile-only devices, no TPU
needed), and prints ``memory_analysis()``'s temporaries against the size of one cache: a copy of
the cache into or out of the loop shows as temporaries of a cache's size or more.

    python3 benchmarks/bench_decode_memory.py --slots 16 --cache 8192
    python3 benchmarks/bench_decode_memory.py --slots 16 --cache 8192 --tpu v5p:2x2x1
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from tmax_jax.engine import Engine  # noqa: E402
from tmax_jax.models.qwen35 import Qwen35Config, Qwen35ForCausalLM  # noqa: E402


def tpu_device(topology: str):
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    bounds = tuple(int(x) for x in topology.split(":")[1].split("x"))
    topo = topologies.get_topology_desc(
        platform="tpu", topology_name=topology, chip_config_name="default", chips_per_host_bounds=bounds
    )
    return topo.devices[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--slots", type=int, default=16)
    p.add_argument("--cache", type=int, default=8192, help="max cache length (the block attends to all)")
    p.add_argument("--tpu", default="", help="compile for this TPU topology (e.g. v5p:2x2x1) instead")
    args = p.parse_args()
    bf16 = jnp.bfloat16
    model = Qwen35ForCausalLM(Qwen35Config.preset("tiny"), rngs=nnx.Rngs(0), dtype=bf16)
    engine = Engine(
        model,
        max_concurrent_decodes=args.slots,
        max_cache_length=args.cache,
        max_prefill_length=64,
        cache_dtype=bf16,
        decode_steps=8,
        min_attend_bucket=args.cache,
    )
    state = engine.init_decode_state()
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(state.cache))
    fn = jax.jit(engine._generate_block_impl, static_argnums=(3,), donate_argnums=(1,))
    if args.tpu:
        sharding = jax.sharding.SingleDeviceSharding(tpu_device(args.tpu))

        def spec(tree):
            return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree)

        lowered = fn.lower(spec(engine.params), spec(state), spec(jnp.int32(8)), args.cache)
        where = f"XLA:TPU {args.tpu} (ahead of time)"
    else:
        lowered = fn.lower(engine.params, state, jnp.int32(8), args.cache)
        where = f"XLA:{jax.default_backend().upper()}"
    mem = lowered.compile().memory_analysis()
    mib = 2**20
    print(
        f"{where}: tiny model, {args.slots} slots x {args.cache} tokens, bf16 cache {cache_bytes / mib:.1f} "
        f"MiB; decode block temporaries {mem.temp_size_in_bytes / mib:.1f} MiB "
        f"({mem.temp_size_in_bytes / cache_bytes:.2f} caches), arguments {mem.argument_size_in_bytes / mib:.1f} "
        f"MiB, aliased {mem.alias_size_in_bytes / mib:.1f} MiB"
    )


if __name__ == "__main__":
    main()
