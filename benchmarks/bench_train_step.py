"""Train-step throughput: our sharded JAX step vs the same step written plainly in PyTorch + transformers.

Both sides run forward, float32 log-softmax at the targets, the DPPO loss, backward and AdamW on the
same Qwen 3.5 shape and batch; the ratio is measured in this run. JAX runs on 1 and on 8 fake CPU
devices (fsdp=8); on an accelerator host it also reports MFU (``--mfu-peak-tflops``). On CPU each
device count other than this process's runs in a child process started with that many devices:
a process split into 8 fake devices runs a 1-device step ~7% slower than a 1-device process (the
75M step, 8 x 64 tokens: 1.82 vs 1.65-1.69 s), and a 1-device user runs the latter. PyTorch runs in a
child process too: the JAX processes set glibc's malloc as ``tmax-jax`` does on a CPU-only host
(``tmax_jax/hostmem.py``; ``--host-malloc``), and PyTorch runs with glibc's defaults, as a plain
PyTorch script does, unless ``--torch-host-malloc reuse`` gives it the same setting.

    python benchmarks/bench_train_step.py --sizes tiny,100m --rows 8 --seq 128 --steps 3
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from tmax_jax import hostmem  # noqa: E402
from tmax_jax.models.qwen35 import Qwen35Config  # noqa: E402
from tmax_jax.rl import OptimizerConfig, RLConfig  # noqa: E402
from tmax_jax.rl.packing import empty_batch  # noqa: E402
from tmax_jax.rl.train_step import TrainStep, make_model  # noqa: E402
from tmax_jax.sharding import MeshConfig, make_mesh  # noqa: E402


def model_config(size: str) -> Qwen35Config:
    if size == "100m":
        # ~100M parameters with Qwen 3.5's 3:1 DeltaNet / attention pattern.
        return dataclasses.replace(
            Qwen35Config.preset("tiny"),
            vocab_size=32768,
            hidden_size=768,
            intermediate_size=2048,
            num_hidden_layers=8,
            layer_types=(),
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=4,
            linear_num_value_heads=8,
        )
    return Qwen35Config.preset(size)


def make_batch(cfg: Qwen35Config, rows: int, seq: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    b = empty_batch(rows, seq)
    b["input_ids"][:] = rng.integers(0, cfg.vocab_size, (rows, seq))
    b["targets"][:] = rng.integers(0, cfg.vocab_size, (rows, seq))
    b["segment_ids"][:] = 1
    b["positions"][:] = np.arange(seq)
    b["response_mask"][:, seq // 4 :] = 1
    b["rollout_logprobs"][:] = np.where(b["response_mask"] > 0, -np.log(cfg.vocab_size) + 0.05, 0.0)
    b["advantages"][:] = rng.choice([-1.0, 1.0], rows)[:, None]
    return b


def time_steps(fn, steps: int) -> dict[str, float]:
    """Seconds of the first call (compile included), and the median and best of ``steps`` more."""
    t0 = time.perf_counter()
    fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return dict(first=first, med=statistics.median(times), best=min(times))


def bench_jax(cfg, batch, devices, steps, dtype, remat):
    mesh_cfg = MeshConfig(data=1, fsdp=-1, tensor=1)
    rl = RLConfig(optimizer=OptimizerConfig(learning_rate=1e-5))
    model = make_model(cfg, remat=remat, dtype=dtype)
    step = TrainStep(model, rl, make_mesh(mesh_cfg, devices), mesh_cfg)
    holder = {"state": step.init_state()}
    gbatch = step.put_batch(batch)

    def run():
        holder["state"], metrics = step(holder["state"], gbatch)
        jax.block_until_ready(metrics["loss"])

    n_params = sum(x.size for x in jax.tree.leaves(holder["state"].params))
    return time_steps(run, steps) | dict(n_params=n_params)


def bench_torch(cfg, batch, steps, delta=0.1):
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    hf = cfg.to_hf_config()
    hf.pop("architectures", None)
    hf.pop("model_type", None)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hf)).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
    ids = torch.from_numpy(batch["input_ids"]).long()
    tgt = torch.from_numpy(batch["targets"]).long()
    mask = torch.from_numpy(batch["response_mask"])
    mu_lp = torch.from_numpy(batch["rollout_logprobs"])
    adv = torch.from_numpy(batch["advantages"])

    def run():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits.float()
        lp = torch.log_softmax(logits, -1).gather(-1, tgt[..., None])[..., 0]
        r = torch.exp(lp - mu_lp)
        with torch.no_grad():
            d = (lp.exp() - mu_lp.exp()).abs()
            bad = (d > delta) & (((adv > 0) & (r > 1)) | ((adv < 0) & (r < 1)))
            keep = (~bad).float() * mask
        loss = (-adv * r * keep).sum() / mask.sum().clamp(min=1)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return time_steps(run, steps)


def bench_in_child(args, size: str, devices: int) -> dict[str, float]:
    """The JAX step on ``devices`` CPU devices, measured in a process that has exactly that many."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}".strip())
    cmd = [
        sys.executable, __file__, "--child", "--no-torch", "--sizes", size, "--device-counts", str(devices),
        "--rows", str(args.rows), "--seq", str(args.seq), "--steps", str(args.steps),
        "--dtype", args.dtype, "--remat", args.remat,
    ]  # fmt: skip
    return _child_result(cmd, env, f"the {devices}-device child run")


def torch_in_child(args, size: str) -> dict[str, float]:
    """The PyTorch step in its own process, with glibc's malloc as ``--torch-host-malloc`` says."""
    env = dict(os.environ, **{hostmem.ENV: args.torch_host_malloc})
    cmd = [
        sys.executable, __file__, "--child", "--torch-only", "--sizes", size,
        "--rows", str(args.rows), "--seq", str(args.seq), "--steps", str(args.steps),
    ]  # fmt: skip
    return _child_result(cmd, env, "the PyTorch child run")


def _child_result(cmd, env, what: str):
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    for line in out.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise SystemExit(f"{what} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")


def _times(r: dict, tokens: int) -> str:
    return (
        f"first {r['first']:7.2f}s  step {r['med']:7.3f}s median, {r['best']:7.3f}s best  "
        f"{tokens / r['med']:10.1f} tok/s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="tiny,100m")
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--remat", default="none", choices=["none", "full", "layers", "dots"])
    ap.add_argument("--device-counts", default="", help="comma list, default: 1 and all devices")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--host-malloc",
        choices=hostmem.MODES,
        default=None,
        help="glibc malloc for the JAX processes (tmax_jax/hostmem.py); default: as the CLI does it",
    )
    ap.add_argument(
        "--torch-host-malloc",
        choices=("system", "reuse"),
        default="system",
        help="glibc malloc for the PyTorch process: system (a plain PyTorch run, default) or reuse",
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument(
        "--mfu-peak-tflops", type=float, default=None, help="per-device peak, e.g. 989 for H200 bf16"
    )
    args = ap.parse_args()
    if args.host_malloc:
        os.environ[hostmem.ENV] = args.host_malloc  # the JAX children inherit it
    malloc = hostmem.configure(args.torch_host_malloc if args.torch_only else None)
    if args.torch_only:
        cfg = model_config(args.sizes)
        r = bench_torch(cfg, make_batch(cfg, args.rows, args.seq), args.steps)
        print("RESULT " + json.dumps(r), flush=True)
        return
    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    tokens = args.rows * args.seq
    print(
        f"devices: {len(jax.devices())} x {jax.devices()[0].device_kind}; batch {args.rows} x {args.seq}; "
        f"host malloc: jax {malloc}, torch {args.torch_host_malloc}"
    )
    for size in args.sizes.split(","):
        cfg = model_config(size)
        batch = make_batch(cfg, args.rows, args.seq)
        counts = (
            [int(c) for c in args.device_counts.split(",")] if args.device_counts else [1, len(jax.devices())]
        )
        device_sets = []
        for n in dict.fromkeys(counts):
            if n > len(jax.devices()):
                raise SystemExit(f"--device-counts asks for {n} devices; {len(jax.devices())} are present")
            device_sets.append((f"jax {n} device{'s' * (n > 1)}", jax.devices()[:n]))
        results = {}
        for name, devs in device_sets:
            if args.child:
                r = bench_jax(cfg, batch, devs, args.steps, dtype, args.remat)
                print("RESULT " + json.dumps(r), flush=True)
                return
            if jax.default_backend() == "cpu" and len(devs) != len(jax.devices()):
                r = bench_in_child(args, size, len(devs))
            else:
                r = bench_jax(cfg, batch, devs, args.steps, dtype, args.remat)
            results[name] = r
            line = f"[{size} {r['n_params'] / 1e6:.1f}M] {name:14s} {_times(r, tokens)}"
            if args.mfu_peak_tflops:
                flops = 6 * r["n_params"] * tokens  # + attention, ignored: a lower bound on MFU
                line += f"  MFU {flops / r['med'] / (args.mfu_peak_tflops * 1e12 * len(devs)):.1%}"
            print(line, flush=True)
        if not args.no_torch:
            if jax.default_backend() == "cpu":
                t = torch_in_child(args, size)
            else:
                t = bench_torch(cfg, batch, args.steps)
            print(f"[{size}] {'torch+hf':14s} {_times(t, tokens)}")
            for name, r in results.items():
                print(
                    f"[{size}] ratio {name} / torch: {t['med'] / r['med']:.2f}x tokens/s (medians), "
                    f"{t['best'] / r['best']:.2f}x (bests)"
                )


if __name__ == "__main__":
    main()
