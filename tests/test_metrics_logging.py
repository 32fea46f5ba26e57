"""Where train metrics go: the optional Weights & Biases run (offline here, read back from the run's own
files), its config section, and the promise that neither wandb nor matplotlib is imported unasked."""

import json
import struct
import subprocess
import sys
import time

import pytest

from tmax_jax.config import to_dict
from tmax_jax.errors import ConfigError
from tmax_jax.train.config import TrainConfig, load_train_config
from tmax_jax.train.metrics import WANDB_MISSING, LoggingConfig, MetricsWriter, require_wandb


def test_logging_section_parses_and_rejects_unknown_keys():
    cfg = load_train_config(None, {"logging": {"wandb": True, "wandb_project": "p", "tensorboard": False}})
    assert cfg.logging == LoggingConfig(tensorboard=False, wandb=True, wandb_project="p")
    assert TrainConfig().logging == LoggingConfig(tensorboard=True, wandb=False)
    with pytest.raises(ConfigError, match="unknown config key 'logging.wandb_projekt'"):
        load_train_config(None, {"logging": {"wandb_projekt": "p"}})


def test_asking_for_wandb_without_the_package_is_a_clear_error(tmp_path, monkeypatch):
    # A None entry in sys.modules is how Python marks a module as not importable.
    monkeypatch.setitem(sys.modules, "wandb", None)
    require_wandb(LoggingConfig())  # not asked for: fine
    with pytest.raises(ConfigError) as e:
        MetricsWriter(tmp_path, logging=LoggingConfig(tensorboard=False, wandb=True))
    assert str(e.value) == (
        "logging.wandb is true but the wandb package is not installed: pip install 'tmax-jax[wandb]'"
    )
    assert str(e.value) == WANDB_MISSING
    # A writer on another process of a pod logs nothing, so it needs no wandb either.
    MetricsWriter(tmp_path / "other", logging=LoggingConfig(tensorboard=False, wandb=True), enabled=False)


def test_train_refuses_wandb_without_the_package_before_any_work(tmp_path, monkeypatch):
    from tmax_jax.train.run import build_run

    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = load_train_config(None, {"run_dir": str(tmp_path / "run"), "logging": {"wandb": True}})
    with pytest.raises(ConfigError, match="pip install 'tmax-jax\\[wandb\\]'"):
        build_run(cfg, progress=False)
    assert not (tmp_path / "run").exists()


def test_a_run_without_wandb_never_imports_it_nor_matplotlib(tmp_path):
    """In a fresh interpreter: the package, the train run and report modules, and a default metrics
    writer writing and closing, leave both optional heavy imports out of sys.modules."""
    code = f"""
import json, sys
import tmax_jax, tmax_jax.train.run, tmax_jax.train.report, tmax_jax.eval.html_report, tmax_jax.tasks.stats
from tmax_jax.config import to_dict
from tmax_jax.train.config import TrainConfig
from tmax_jax.train.metrics import MetricsWriter
cfg = TrainConfig()
m = MetricsWriter({str(tmp_path)!r}, logging=cfg.logging, run_config=to_dict(cfg))
m.write(1, {{"pass_rate": 0.5}})
m.close()
print(json.dumps({{name: name in sys.modules for name in ("wandb", "matplotlib", "tensorboardX")}}))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    # tensorboardX: proof that the writer did run its default sinks.
    assert json.loads(r.stdout.splitlines()[-1]) == {
        "wandb": False,
        "matplotlib": False,
        "tensorboardX": True,
    }
    assert [json.loads(ln)["pass_rate"] for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        0.5
    ]


def _wandb_records(path):
    """The records of a ``.wandb`` file: a 7-byte W&B header, then the LevelDB log format (32 KiB
    blocks of chunks, each a 7-byte header of crc32, little-endian length and type: 1 full, 2 first,
    3 middle, 4 last), each record a serialized ``wandb_internal.Record``."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks, records = 7, 32768, b"", []
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            rec = wandb_internal_pb2.Record()
            rec.ParseFromString(chunks)
            records.append(rec)
            chunks = b""
    return records


def _finished_run(run_dir, run_id, n):
    """The records of the ``n``-th offline session of W&B run ``run_id``, once complete: wandb-core (a
    process of its own) writes the file, and ``finish()`` can return before its last records land."""
    deadline = time.monotonic() + 60
    while True:
        files = sorted((run_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
        if len(files) >= n:
            records = _wandb_records(files[n - 1])
            if any(r.WhichOneof("record_type") == "exit" for r in records):
                return records
        assert time.monotonic() < deadline, f"no complete W&B session {n} of {run_id} in {run_dir}"
        time.sleep(0.2)


def _offline_env(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))


def test_wandb_offline_run_holds_the_logged_metrics_and_resumes_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the optional wandb package is not installed")
    _offline_env(monkeypatch, tmp_path)
    run_dir = tmp_path / "run"
    cfg = load_train_config(None, {"run_dir": str(run_dir), "steps": 3})
    logging = LoggingConfig(tensorboard=False, wandb=True, wandb_project="tmax-test", wandb_name="tiny")
    m = MetricsWriter(run_dir, logging=logging, run_config=to_dict(cfg))
    written = {1: {"pass_rate": 0.25, "loss": 1.5}, 2: {"pass_rate": 0.5, "loss": float("nan")}}
    for step, metrics in written.items():
        m.write(step, {**metrics, "note": "text is not a scalar"})
    m.close()

    run_id = (run_dir / "wandb_run_id").read_text().strip()
    records = _finished_run(run_dir, run_id, 1)
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (run.run_id, run.project, run.display_name) == (run_id, "tmax-test", "tiny")
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["steps"] == 3 and config["logging"]["wandb"] is False  # the run's own config
    history = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    logged = [{k: v for k, v in h.items() if not k.startswith("_")} for h in history]
    # Finite scalars only (as TensorBoard gets them): NaN and strings stay in metrics.jsonl.
    assert logged == [{"pass_rate": 0.25, "loss": 1.5}, {"pass_rate": 0.5}]
    assert [h["_step"] for h in history] == [1, 2]

    # A resumed train logs into the same W&B run (wandb names offline run dirs by the second).
    time.sleep(1.1)
    again = MetricsWriter(run_dir, logging=logging, run_config=to_dict(cfg))
    again.write(3, {"pass_rate": 0.75})
    again.close()
    assert (run_dir / "wandb_run_id").read_text().strip() == run_id
    assert len(list((run_dir / "wandb").glob(f"offline-run-*-{run_id}"))) == 2
    steps = [
        {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}["_step"]
        for r in _finished_run(run_dir, run_id, 2)
        if r.WhichOneof("record_type") == "history"
    ]
    assert steps == [3]


def test_a_run_resumes_with_other_logging_but_not_with_another_config(tmp_path):
    from tmax_jax.train.setup import prepare_run_dir

    run_dir = str(tmp_path / "run")
    prepare_run_dir(load_train_config(None, {"run_dir": run_dir}))
    prepare_run_dir(load_train_config(None, {"run_dir": run_dir, "logging": {"wandb": True}}))
    with pytest.raises(ConfigError, match="changed: seed"):
        prepare_run_dir(load_train_config(None, {"run_dir": run_dir, "seed": 1}))
