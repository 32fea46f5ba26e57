"""Run metrics: one JSON line per step in ``metrics.jsonl``, TensorBoard event files and, when asked
for, a Weights & Biases run."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import secrets
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tmax_jax.errors import ConfigError

WANDB_MISSING = "logging.wandb is true but the wandb package is not installed: pip install 'tmax-jax[wandb]'"


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    """Where the per-step metrics go besides ``metrics.jsonl`` (the ``logging`` section of a run).

    ``wandb`` logs the same scalars to a Weights & Biases run whose files live in ``RUN_DIR/wandb``;
    the wandb package is optional (``pip install 'tmax-jax[wandb]'``) and imported only then.
    ``WANDB_MODE=offline`` keeps that run on disk (``wandb sync`` uploads it later).
    """

    tensorboard: bool = True  # event files in RUN_DIR/tb
    wandb: bool = False
    wandb_project: str = "tmax-jax"
    wandb_entity: str = ""  # "" = the logged-in account's default entity
    wandb_name: str = ""  # the W&B run's display name; "" = the run dir's name


def require_wandb(cfg: LoggingConfig) -> None:
    """Refuse a run that asks for W&B without the package, before any work (wandb is not imported)."""
    if cfg.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError(WANDB_MISSING)


class WandbSink:
    """One W&B run per run dir. Its id is kept in ``RUN_DIR/wandb_run_id``, so a resumed train logs
    into the same W&B run instead of starting a second one."""

    def __init__(self, run_dir: Path, cfg: LoggingConfig, run_config: Mapping[str, Any] | None):
        require_wandb(cfg)
        import wandb

        id_path = run_dir / "wandb_run_id"
        run_id = id_path.read_text().strip() if id_path.is_file() else secrets.token_hex(6)
        id_path.write_text(run_id + "\n")
        self.run = wandb.init(
            project=cfg.wandb_project,
            entity=cfg.wandb_entity or None,
            name=cfg.wandb_name or run_dir.resolve().name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=dict(run_config or {}),
            # The trainer's stdout is its result and stderr a redrawn progress bar: neither is a log.
            settings=wandb.Settings(console="off"),
        )

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        self.run.log(dict(scalars), step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsWriter:
    """``enabled=False`` (every process of a pod but process 0) writes nothing and still reads.

    ``logging`` picks the sinks besides ``metrics.jsonl``; ``run_config`` (the resolved run config as
    plain data) is recorded as the W&B run's config.
    """

    def __init__(
        self,
        run_dir: str | Path,
        *,
        logging: LoggingConfig | None = None,
        run_config: Mapping[str, Any] | None = None,
        enabled: bool = True,
    ):
        logging = logging or LoggingConfig()
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        self._wandb = None
        if logging.tensorboard and enabled:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))
        if logging.wandb and enabled:
            self._wandb = WandbSink(self.run_dir, logging, run_config)

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        clean, scalars = {}, {}
        for k, v in metrics.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                clean[k] = v if math.isfinite(v) else None
                if math.isfinite(v):
                    scalars[k] = v
            elif isinstance(v, (str, bool)) or v is None:
                clean[k] = v
        record = {"step": step, "time": time.time(), **clean}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(step, scalars)

    def truncate_after(self, step: int) -> None:
        """On resume, forget records of steps that the restored checkpoint had not reached."""
        if not self.enabled or not self.path.exists():
            return
        keep = [
            ln for ln in self.path.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step
        ]
        self.path.write_text("".join(ln + "\n" for ln in keep))

    def read(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(ln) for ln in self.path.read_text().splitlines() if ln.strip()]

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None


def progress_bar(total: int, desc: str, enabled: bool, initial: int = 0):
    """A tqdm bar on stderr (stdout stays for the command's result), or None when disabled."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=sys.stderr)
