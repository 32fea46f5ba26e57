"""What the train step asks of the matrix units, from the HLO of a small config on CPU: its matmuls
by operand dtype and precision, their work against the model's 6 N T, and the compiled memory.

* Dots by class, from the program as lowered (StableHLO, before XLA's CPU passes rewrite 16-bit
  dots): ``f32/highest`` is a float32 matmul at full precision (six bfloat16 passes on a TPU's MXU),
  ``f32/bf16x3`` three passes, ``bf16`` one. Counted once per dot in the program text. The
  accelerator's precision is put in (``numerics.f32_matmul_precision`` on CPU gives the default) and
  the delta rule runs its accelerator form (``delta_rule._FORM_OVERRIDE``), so the program is the one
  a TPU or GPU would be given.
* Matmul work, from the compiled program: every dot's 2 * output elements * contracted size,
  weighted by how often it runs (the known trip count of each while loop around it), against
  6 N T with N the weights the tokens multiply (every matrix but the embedding table, which the
  tied head counts once). The backward's recompute of the forward is what lifts it past 1.
* Memory: ``compiled.memory_analysis()`` (temporaries and arguments).

    python3 benchmarks/bench_precision.py                       # mixed vs float32 policy, remat full
    python3 benchmarks/bench_precision.py --remat full,layer --policies mixed
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.bench_train_step import make_batch  # noqa: E402
from benchmarks.hlo_report import analyze as analyze_hlo  # noqa: E402
from tmax_jax.models.qwen35 import Qwen35Config, numerics  # noqa: E402
from tmax_jax.models.qwen35 import delta_rule as delta_rule_mod  # noqa: E402
from tmax_jax.rl.config import OptimizerConfig, RLConfig  # noqa: E402
from tmax_jax.rl.train_step import TrainStep, make_model  # noqa: E402
from tmax_jax.sharding import MeshConfig, make_mesh  # noqa: E402


def small_config(layers: int, preset: str = "") -> Qwen35Config:
    """Qwen 3.5's shape (3 DeltaNet : 1 attention, GQA, gated heads) at a size CPUs compile quickly,
    or ``preset``'s with ``layers`` layers (the program is only compiled: the widths cost nothing)."""
    if preset:
        return dataclasses.replace(Qwen35Config.preset(preset), num_hidden_layers=layers, layer_types=())
    return dataclasses.replace(
        Qwen35Config.preset("tiny"),
        vocab_size=2048,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=layers,
        layer_types=(),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
    )


# --------------------------------------------------------------------------- StableHLO dot classes
_SHLO_DOT = re.compile(r"stablehlo\.dot_general (.*?) : \(tensor<(?:\d+x)*(\w+)>, tensor<(?:\d+x)*(\w+)>\)")


_NOISE = r"jit\(\w+\)/|transpose\(|jvp\(\)\)?/|while/body/"


def dot_classes(stablehlo: str, show: str = "") -> Counter:
    """Dots of the lowered program by ``lhs dtype x rhs dtype/precision`` (``highest``, an algorithm,
    default). ``show``: a class whose dots are also counted by source op (``as_text(debug_info=True)``)."""
    out = Counter()
    locs = dict(re.findall(r'^(#loc\d+) = loc\("([^"]*)"', stablehlo, re.M))
    for line in stablehlo.splitlines():
        m = _SHLO_DOT.search(line)
        if not m:
            continue
        if show:
            cls = dot_classes(line.split(" loc(")[0])
            if show in cls:
                ref = re.search(r"loc\((#loc\d+)\)", line)
                name = locs.get(ref.group(1), "?") if ref else "?"
                out[f"{show} at {re.sub(_NOISE, '', name)}"] += 1
        attrs, lhs, rhs = m.groups()
        if "algorithm" in attrs:
            a = re.search(r"lhs_precision_type = (\w+).*?num_primitive_operations = (\d+)", attrs)
            prec = f"{a.group(1)}x{a.group(2)}" if a else "algorithm"
        elif "HIGHEST" in attrs:
            prec = "highest"
        elif "HIGH" in attrs:
            prec = "high"
        else:
            prec = "default"
        out[f"{lhs}x{rhs}/{prec}"] += 1
    return out


def matmul_params(state_params) -> int:
    """Weights the tokens multiply: every parameter of rank >= 2 except the (tied) embedding table's
    lookup, which the head's matmul counts once."""
    return sum(int(x.size) for x in jax.tree.leaves(state_params) if x.ndim >= 2 and x.shape[-1] > 4)


# --------------------------------------------------------------------------- one configuration
def analyse(cfg, rows, seq, remat, policy, accelerator, show: str = "", dump: str = "") -> dict:
    os.environ[numerics.PRECISION_ENV] = policy
    real = numerics.f32_matmul_precision
    numerics.f32_matmul_precision = lambda backend=None: real(accelerator)
    delta_rule_mod.f32_matmul_precision = numerics.f32_matmul_precision
    delta_rule_mod._FORM_OVERRIDE = (8, True)
    try:
        mesh_cfg = MeshConfig(data=1, fsdp=-1, tensor=1)
        rl = RLConfig(optimizer=OptimizerConfig(learning_rate=1e-5))
        model = make_model(cfg, remat=remat, dtype=jnp.bfloat16)
        step = TrainStep(model, rl, make_mesh(mesh_cfg, jax.devices()[:1]), mesh_cfg)
        state = step.abstract_state()
        batch = step.put_batch(make_batch(cfg, rows, seq))
        fn = jax.jit(
            step._step,
            in_shardings=(step.state_shardings, step.batch_shardings),
            out_shardings=(step.state_shardings, None),
            donate_argnums=(0,),
        )
        with jax.set_mesh(step.mesh):
            lowered = fn.lower(state, batch)
        classes = dot_classes(lowered.as_text(debug_info=bool(show)), show)
        compiled = lowered.compile()
        hlo = compiled.as_text()
        # The one loop whose trip count XLA cannot know is the head's, over the response's chunks
        # (it stops at the last response token); the benchmark's responses run to the end.
        flops = analyze_hlo(hlo, unknown_trips=-(-seq // rl.loss.logprob_chunk))["dot_flops"]
        if dump:
            Path(dump).mkdir(parents=True, exist_ok=True)
            (Path(dump) / f"train_step-{remat}-{policy}.hlo.txt").write_text(hlo)
        mem = compiled.memory_analysis()
        n = matmul_params(state.params)
    finally:
        numerics.f32_matmul_precision = real
        delta_rule_mod.f32_matmul_precision = real
        delta_rule_mod._FORM_OVERRIDE = None
    return dict(
        classes=classes,
        flops=flops,
        model_flops=6.0 * n * rows * seq,
        n=n,
        temp=mem.temp_size_in_bytes,
        args=mem.argument_size_in_bytes,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--preset", default="", help="a Qwen35Config preset's widths (default: a small config)")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--remat", default="full", help="comma-separated remat settings")
    p.add_argument("--policies", default="float32,mixed", help="comma-separated TMAX_JAX_PRECISION values")
    p.add_argument("--accelerator", default="tpu", help="whose float32-matmul precision to put in")
    p.add_argument("--dump", default="", help="a directory for the compiled HLO of each configuration")
    p.add_argument("--show", default="", help="a dot class (e.g. f32xf32/highest) to count by source op")
    args = p.parse_args()
    cfg = small_config(args.layers, args.preset)
    print(
        f"config: D={cfg.hidden_size} layers={cfg.num_hidden_layers} V={cfg.vocab_size}; "
        f"{args.rows} x {args.seq} tokens; bf16 compute, f32 params; {args.accelerator} precision"
    )
    for remat in args.remat.split(","):
        for policy in args.policies.split(","):
            r = analyse(cfg, args.rows, args.seq, remat, policy, args.accelerator, args.show, args.dump)
            f32_highest = r["classes"]["f32xf32/highest"]
            print(
                f"remat={remat:7s} policy={policy:8s} f32-highest dots {f32_highest:4d}; all dots "
                f"{dict(sorted(r['classes'].items()))}; matmul work {r['flops'] / 1e9:.2f} GFLOP = "
                f"{r['flops'] / r['model_flops']:.2f} x 6NT (N={r['n'] / 1e6:.2f}M); temp "
                f"{r['temp'] / 2**20:.1f} MiB, args {r['args'] / 2**20:.1f} MiB",
                flush=True,
            )


if __name__ == "__main__":
    main()
