"""SFT warm start: next-token NLL on the policy tokens of demonstration trajectories.

SFT is the RL ``TrainStep`` (mesh, shardings, accumulation, AdamW, the float32 policy head) with the
registered ``sft`` loss: the negative log-likelihood of the masked tokens, normalised by their count,
at temperature 1 (SFT fits the model's own distribution, whatever the rollout temperature). ``run_sft``
is the one SFT loop: the trainer's warm start and ``tmax-jax sft`` both call it.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from flax import nnx

from tmax_jax.agent.trajectory import Trajectory, iter_jsonl, write_jsonl
from tmax_jax.errors import ConfigError, TmaxError
from tmax_jax.rl.config import LossConfig
from tmax_jax.rl.train_step import TrainStep
from tmax_jax.train.metrics import progress_bar

SUMMARY_FILE = "sft_summary.json"
EXAMPLES_FILE = "sft_examples.jsonl"  # the trajectories trained on, so a run can be inspected or redone


def run_sft(
    init: str | Path,
    examples: Sequence[Trajectory],
    out: str | Path,
    cfg,
    *,
    mesh=None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> dict:
    """Fine-tune the HF checkpoint ``init`` on the policy tokens of ``examples``; write the result
    (weights, config, ``init``'s tokenizer), the examples used (``sft_examples.jsonl``) and, last,
    ``sft_summary.json`` to ``out``; return the summary.

    ``cfg`` is a ``TrainConfig``: ``cfg.sft`` (steps, batch_size, learning_rate, seq_len), ``cfg.rl``
    (optimizer, micro-batches, remat), ``cfg.model`` (dtypes), ``cfg.mesh`` (or ``mesh``) and
    ``cfg.seed``. Each step trains on ``batch_size`` examples drawn without replacement. Examples
    longer than ``seq_len`` or without policy tokens are skipped (counted in the summary).

    Several JAX processes (a pod) all call it with the same ``examples``: each feeds its share of
    every step's picks, process 0 writes ``out``, and nobody returns before it is written.
    """
    import jax

    from tmax_jax.checkpoints import load_hf, load_mtp, read_hf_config, save_hf
    from tmax_jax.distributed import barrier, is_primary
    from tmax_jax.rl.packing import pack_trajectories, pad_rows_across_processes
    from tmax_jax.sharding import ProcessReplicas, make_mesh

    sc = cfg.sft
    if sc.steps < 1:
        raise ConfigError(f"SFT needs sft.steps >= 1, got {sc.steps}")
    init, out = Path(init), Path(out)
    if out.resolve() == init.resolve():
        raise ConfigError(f"SFT output {out} is the input checkpoint; choose another directory")
    vocab = read_hf_config(init).vocab_size
    for i, t in enumerate(examples):
        bad = out_of_vocab(t, vocab)
        if bad is not None:
            raise ConfigError(
                f"SFT example {i} (task {t.task_id}) has token id {bad}, outside the vocabulary of "
                f"{init} ({vocab} ids)"
            )
    too_long = sum(len(t.tokens) - 1 > sc.seq_len for t in examples)
    no_policy = sum(t.num_generated == 0 for t in examples)
    data = [t for t in examples if 2 <= len(t.tokens) <= sc.seq_len + 1 and t.num_generated]
    if too_long or no_policy:
        log(
            f"SFT: skipping {too_long} example(s) longer than seq_len {sc.seq_len}, {no_policy} without policy tokens"
        )
    if not data:
        raise TmaxError(f"SFT: none of the {len(examples)} example(s) is usable (see above)")

    # A constant learning rate and the token NLL (untruncated, temperature 1, no corrections).
    rl = dataclasses.replace(
        cfg.rl,
        optimizer=dataclasses.replace(cfg.rl.optimizer, learning_rate=sc.learning_rate, schedule="constant"),
        loss=LossConfig(name="sft", logprob_chunk=cfg.rl.loss.logprob_chunk),
    )
    model = load_hf(init, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype, remat=rl.train_step.remat)
    step = TrainStep(model, rl, mesh if mesh is not None else make_mesh(cfg.mesh), cfg.mesh)
    state = step.init_state(seed=cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    nll: list[float] = []
    t0 = time.monotonic()
    pid, nproc = jax.process_index(), jax.process_count()
    bar = progress_bar(sc.steps, "sft", progress and is_primary())
    try:
        for _ in range(sc.steps):
            # Every process holds the same examples and draws the same picks; each feeds its share.
            pick = rng.choice(len(data), size=min(sc.batch_size, len(data)), replace=False)[pid::nproc]
            batch, _ = pack_trajectories([data[j] for j in pick], [1.0] * len(pick), seq_len=sc.seq_len)
            state, m = step(state, pad_rows_across_processes(batch, step.rows_multiple))
            nll.append(float(m["loss"]))
            if bar is not None:
                bar.update(1)
                bar.set_postfix(nll=f"{nll[-1]:.3f}", p=f"{float(m['token_prob_mean']):.3f}")
    finally:
        if bar is not None:
            bar.close()
    if nproc > 1:  # the params span every process: gather a full copy onto each (a collective)
        tuned = nnx.merge(
            step.graphdef, ProcessReplicas(state.params, step.mesh_cfg)(state.params), step.rest
        )
    else:
        tuned = step.model(state)
    summary = {
        "init": str(init),
        "steps": sc.steps,
        "examples": len(data),
        "skipped_too_long": too_long,
        "skipped_no_policy_tokens": no_policy,
        "batch_size": sc.batch_size,
        "seq_len": sc.seq_len,
        "learning_rate": sc.learning_rate,
        # Batch NLL per policy token at the first and last step, each before its update.
        "first_nll": nll[0],
        "final_nll": nll[-1],
        "train_s": round(time.monotonic() - t0, 3),
    }
    if is_primary():
        (out / SUMMARY_FILE).unlink(missing_ok=True)  # an earlier run's marker must not vouch for these files
        save_hf(tuned, out, tokenizer=init, mtp=load_mtp(init))  # the draft module passes through
        (out / EXAMPLES_FILE).unlink(missing_ok=True)
        write_jsonl(out / EXAMPLES_FILE, data)
        # Written last: its presence says the checkpoint beside it is complete.
        (out / SUMMARY_FILE).write_text(json.dumps(summary, indent=2))
    barrier("tmax-jax sft: checkpoint written")  # no process reads ``out`` before process 0 wrote it
    log(f"SFT: {sc.steps} steps on {len(data)} examples, NLL {nll[0]:.3f} -> {nll[-1]:.3f}; saved to {out}")
    return summary


def out_of_vocab(traj: Trajectory, vocab_size: int) -> int | None:
    """The first token id of ``traj`` outside ``[0, vocab_size)``, or None (JAX clamps such ids
    silently in the embedding lookup, so they must be caught before training)."""
    return next((t for t in traj.tokens if not 0 <= t < vocab_size), None)


def successful_trajectories(
    paths: Sequence[str | Path], *, min_reward: float, vocab_size: int
) -> tuple[list[Trajectory], dict[str, tuple[int, int]]]:
    """Trajectories with ``reward >= min_reward`` from trainer-written JSONL files, and per file
    (records read, records kept). Raises naming the file and line of a record whose tokens the
    model cannot embed, or when no file has a trajectory good enough."""
    kept: list[Trajectory] = []
    counts: dict[str, tuple[int, int]] = {}
    for path in map(Path, paths):
        if not path.is_file():
            raise ConfigError(f"trajectory file {path} does not exist")
        read, before = 0, len(kept)
        for lineno, traj in iter_jsonl(path):
            read += 1
            bad = out_of_vocab(traj, vocab_size)
            if bad is not None:
                raise ConfigError(
                    f"{path}:{lineno}: token id {bad} is outside the checkpoint's vocabulary "
                    f"({vocab_size} ids); were these trajectories made with another tokenizer?"
                )
            if traj.reward >= min_reward:
                kept.append(traj)
        counts[str(path)] = (read, len(kept) - before)
    if not kept:
        raise TmaxError(f"no trajectory with reward >= {min_reward} in {', '.join(map(str, paths))}")
    return kept, counts
