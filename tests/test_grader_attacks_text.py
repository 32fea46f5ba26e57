"""Attack tests of the text and data families' graders: a solution that games the grader instead of
solving must earn (about) nothing, end to end in a bubblewrap sandbox. Each attack was measured
against the grader before its fix (the number in its docstring)."""

from __future__ import annotations

from pathlib import Path

import pytest
from family_helpers import dir_of, draft_dir

from tmax_jax.sandbox import SandboxConfig
from tmax_jax.tasks import load_task
from tmax_jax.tasks.runner import run_task


def _task(tmp_path: Path, family: str, seed: str, solve: str) -> Path:
    d = draft_dir(tmp_path, family, seed)
    (d / "solutions" / "solve.sh").write_text("#!/bin/bash\n" + solve)
    return d


@pytest.fixture
def cfg(tmp_path):
    return SandboxConfig(cache_dir=str(tmp_path / "cache"))


def test_audio_report_of_deleted_files_earns_nothing(tmp_path, cfg):
    """Deleting every .wav and writing an empty report scored 1.0 when the expected report was
    computed from the agent's own dir at grading time."""
    d = _task(tmp_path, "audio_metadata", "del", "")
    w = dir_of(d, "audio_report.txt")
    (d / "solutions" / "solve.sh").write_text(f"#!/bin/bash\ncd {w} && rm -f *.wav && : > audio_report.txt\n")
    res = run_task(load_task(d), "oracle", cfg)
    assert res.reward == 0.0, (res.reason, res.verifier_log[-800:])


def test_regression_predicting_the_mean_earns_nothing(tmp_path, cfg):
    """Predicting the training mean for every x earned up to 0.14 when partial credit ran out only
    at an RMSE of 30|a| (about the mean predictor's own)."""
    d = _task(tmp_path, "regression_predict", "mean", "")
    w = dir_of(d, "predictions.txt")
    (d / "solutions" / "solve.sh").write_text(
        "#!/bin/bash\npython3 - <<'EOF'\n"
        f"ys = [float(l.split(',')[1]) for l in open('{w}/train.csv').read().split()[1:]]\n"
        f"n = len(open('{w}/test.txt').read().split())\n"
        f"open('{w}/predictions.txt', 'w').write(f'{{sum(ys) / len(ys)}}\\n' * n)\nEOF\n"
    )
    res = run_task(load_task(d), "oracle", cfg)
    assert res.reward == 0.0, (res.reason, res.verifier_log[-800:])
