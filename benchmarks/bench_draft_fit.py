"""Fitting the speculative draft to the policy (``engine.draft_fit_steps``): ``DraftFitter`` against
fitting step by step as the loss is written, measured in one run on the same rows and draws.

The reference is one compiled AdamW step that runs the frozen policy's forward on the step's rows
padded to ``seq_len`` and then the MTP module (what ``DraftFitter`` did before it cached the policy's
hidden states per run of steps and padded rows to a length bucket). The defaults are the CPU demo's
fit after an RL step: the ``tiny`` model, 4 prompts x 8 samples of 150-450 tokens, ``seq_len`` 1024,
20 steps of 8 rows.

    python benchmarks/bench_draft_fit.py
    python benchmarks/bench_draft_fit.py --preset 0.8b --seq-len 8192 --min-len 2000 --max-len 8000   # accelerator
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from tmax_jax.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
from tmax_jax.models.qwen35.mtp import MultiTokenPredictor
from tmax_jax.train.mtp_fit import DraftFitter, mtp_distill_loss, pad_rows


class StepByStep:
    """The reference: every step runs the policy on its rows padded to ``seq_len``."""

    def __init__(self, model, mtp, *, learning_rate: float, batch_size: int, seq_len: int):
        self.batch_size, self.seq_len = batch_size, seq_len
        model_def = nnx.graphdef(model)
        mtp_def, self.params, rest = nnx.split(mtp, nnx.Param, ...)
        opt = optax.adamw(learning_rate, weight_decay=0.0)
        self.opt_state = opt.init(self.params)

        def step(params, opt_state, model_state, ids, seg, sampled):
            def loss_fn(p):
                mtp = nnx.merge(mtp_def, p, rest)
                return mtp_distill_loss(mtp, nnx.merge(model_def, model_state), ids, seg, sampled)[0]

            loss, grads = jax.value_and_grad(loss_fn)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        self._step = jax.jit(step)

    def fit(self, model, rows, steps: int, masks, seed) -> list[float]:
        keep = [i for i, r in enumerate(rows) if min(len(r), self.seq_len) >= 3]
        ids, seg, sampled = pad_rows([rows[i] for i in keep], self.seq_len, [masks[i] for i in keep])
        rng, state, losses = np.random.default_rng(seed), nnx.state(model), []
        for _ in range(steps):
            pick = rng.choice(len(keep), size=self.batch_size, replace=len(keep) < self.batch_size)
            self.params, self.opt_state, loss = self._step(
                self.params, self.opt_state, state, ids[pick], seg[pick], sampled[pick]
            )
            losses.append(float(loss))
        return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", help="a Qwen35Config preset (random weights)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--rows", type=int, default=32, help="rollouts of one RL step")
    ap.add_argument("--min-len", type=int, default=150)
    ap.add_argument("--max-len", type=int, default=450)
    ap.add_argument("--prompt-len", type=int, default=100, help="leading tokens of each row not sampled")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    cfg = Qwen35Config.preset(args.preset)
    dt = jnp.dtype(args.dtype)
    model = Qwen35ForCausalLM(cfg, dtype=dt, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    rows = [
        [int(t) for t in rng.integers(0, cfg.vocab_size, int(rng.integers(args.min_len, args.max_len + 1)))]
        for _ in range(args.rows)
    ]
    masks = [[0] * min(args.prompt_len, len(r)) + [1] * max(0, len(r) - args.prompt_len) for r in rows]
    kw = dict(learning_rate=1e-3, batch_size=args.batch_size, seq_len=args.seq_len)

    def new_mtp():
        return MultiTokenPredictor(cfg, 1, dtype=dt, param_dtype=jnp.float32, rngs=nnx.Rngs(1))

    fitters = {
        "step by step": StepByStep(model, new_mtp(), **kw),
        "DraftFitter": DraftFitter(model, new_mtp(), **kw),
    }
    print(
        f"model: {args.preset}, {args.dtype}, devices: {jax.devices()[0].platform} x{jax.device_count()}; "
        f"{args.rows} rows of {args.min_len}-{args.max_len} tokens, seq_len {args.seq_len}, "
        f"{args.steps} steps of {args.batch_size} rows"
    )
    times: dict[str, list[float]] = {name: [] for name in fitters}
    losses: dict[str, list[list[float]]] = {name: [] for name in fitters}
    for r in range(args.repeats + 1):  # the first fit compiles
        for name, fitter in fitters.items():
            t0 = time.perf_counter()
            out = fitter.fit(model, rows, args.steps, masks=masks, seed=(0, r))
            jax.block_until_ready(fitter.params)
            if r:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(out)
    ref, new = (statistics.median(times[n]) for n in fitters)
    diff = max(
        abs(a - b) / max(abs(a), 1e-12)
        for la, lb in zip(losses["step by step"], losses["DraftFitter"])
        for a, b in zip(la, lb)
    )
    policy_rows = fitters["DraftFitter"].counts["policy_rows"]
    print(
        f"  step by step  {ref:7.3f} s per fit  ({args.steps * args.batch_size} policy rows at {args.seq_len})"
    )
    print(f"  DraftFitter   {new:7.3f} s per fit  ({policy_rows} policy rows, length buckets)")
    print(
        f"  speedup {ref / new:.2f}x  (median of {args.repeats}); largest relative loss difference {diff:.1e}"
    )


if __name__ == "__main__":
    main()
