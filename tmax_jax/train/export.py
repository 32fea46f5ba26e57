"""Export the policy of any checkpointed step of a run to a Hugging Face directory."""

from __future__ import annotations

from pathlib import Path

from tmax_jax.config import load_yaml, override
from tmax_jax.errors import CheckpointError
from tmax_jax.train.config import TrainConfig


def export_step(run_dir: str | Path, step: int | None, out_dir: str | Path) -> tuple[int, Path]:
    """Restore ``step`` (default: the newest) of ``run_dir`` and write it with ``save_hf``."""
    from tmax_jax.checkpoints import load_hf, load_mtp, save_hf
    from tmax_jax.rl.state import TrainCheckpointer
    from tmax_jax.rl.train_step import TrainStep
    from tmax_jax.sharding import make_mesh

    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = override(TrainConfig(), load_yaml(run_dir / "config.yaml"))
    init = (
        run_dir / "sft"
        if (run_dir / "sft" / "DONE").is_file()
        else Path(cfg.model.checkpoint or run_dir / "init")
    )
    model = load_hf(init, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype)
    step_fn = TrainStep(model, cfg.rl, make_mesh(cfg.mesh), cfg.mesh)
    ckpt = TrainCheckpointer(
        run_dir / "checkpoints", save_every=1, keep=cfg.keep_checkpoints, async_save=False
    )
    try:
        steps = ckpt.steps()
        if not steps:
            raise CheckpointError(f"{run_dir}/checkpoints holds no checkpoint")
        if step is None:
            step = steps[-1]
        if step not in steps:
            raise CheckpointError(f"{run_dir} has no checkpoint for step {step} (have: {steps})")
        state, _ = ckpt.restore(step, step_fn.abstract_state())
        policy = step_fn.model(state)
        # The checkpoint's MTP module (speculative decoding's draft) goes along: RL does not train it.
        # An SFT directory written before SFT kept it leaves it in model.checkpoint.
        mtp = load_mtp(init)
        if mtp is None and cfg.model.checkpoint and init != Path(cfg.model.checkpoint):
            mtp = load_mtp(cfg.model.checkpoint)
        # A run with engine.draft_fit_steps saved the draft it fitted to this step's policy: that one.
        if ckpt.has_draft(step):
            mtp = _fitted_draft(cfg, ckpt, step, policy, mtp, init)
    finally:
        ckpt.close()
    out = save_hf(policy, out_dir, tokenizer=init, mtp=mtp)
    return step, out


def _fitted_draft(cfg: TrainConfig, ckpt, step: int, policy, mtp, init: Path):
    """The MTP module checkpointed with ``step`` (in the structure of ``mtp``, or of a new module
    like the one the run started from when the checkpoints hold none)."""
    from tmax_jax.train.mtp_fit import config_draft_fitter, new_draft

    fitter = config_draft_fitter(cfg, policy, new_draft(cfg, init) if mtp is None else mtp)
    fitter.load_state(ckpt.restore_draft(step, fitter.abstract_state()))
    return fitter.module()
