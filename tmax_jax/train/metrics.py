"""Run metrics: one JSON line per step in ``metrics.jsonl`` and TensorBoard event files."""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path


class MetricsWriter:
    """``enabled=False`` (every process of a pod but process 0) writes nothing and still reads."""

    def __init__(self, run_dir: str | Path, *, tensorboard: bool = True, enabled: bool = True):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / "metrics.jsonl"
        self.enabled = enabled
        self._tb = None
        if tensorboard and enabled:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.run_dir / "tb"))

    def write(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        clean = {}
        for k, v in metrics.items():
            if hasattr(v, "item"):
                v = v.item()
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                clean[k] = v if math.isfinite(v) else None
                if self._tb is not None and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
            elif isinstance(v, (str, bool)) or v is None:
                clean[k] = v
        record = {"step": step, "time": time.time(), **clean}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self._tb is not None:
            self._tb.flush()

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


def progress_bar(total: int, desc: str, enabled: bool, initial: int = 0):
    """A tqdm bar on stderr (stdout stays for the command's result), or None when disabled."""
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, dynamic_ncols=True, file=sys.stderr)
