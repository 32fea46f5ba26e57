"""Ahead-of-time XLA:TPU compiles on a CPU host (``tmax-jax plan --compile``), and the target
platform deciding kernels and precision instead of the host.

The compile tests need libtpu (the ``[tpu]`` extra, installed by scripts/setup.sh) and no TPU: they
compile a tiny config's train step, prefill and decode block for a 4-chip v5p slice with the Pallas
delta-rule kernels (Mosaic) and check XLA:TPU's memory analysis and HLO.
"""

import importlib.util
import json
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tmax_jax import aot
from tmax_jax.config import parse_dotted
from tmax_jax.kernels.dispatch import resolve_kernels
from tmax_jax.models.qwen35.attention import attention_kernel
from tmax_jax.models.qwen35.numerics import f32_matmul_precision
from tmax_jax.target import compiling_for, mesh_platform, target_platform
from tmax_jax.train.config import load_train_config

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("hlo_report", ROOT / "benchmarks" / "hlo_report.py")
hlo_report = importlib.util.module_from_spec(_spec)
sys.modules["hlo_report"] = hlo_report
_spec.loader.exec_module(hlo_report)

needs_libtpu = pytest.mark.skipif(
    not aot.libtpu_available(), reason="libtpu is not installed (the [tpu] extra): no XLA:TPU to compile with"
)
JSON_KEYS = {
    "program",
    "platform",
    "topology",
    "devices",
    "bytes",
    "hbm_bytes",
    "fits",
    "compile_s",
    "hlo_path",
}
# A tiny run on one 4-chip v5p host: FSDP over the 4 chips, the Pallas delta-rule kernels.
TINY = [
    "plan.topology=v5p:2x2x1",
    "model.dtype=bfloat16",
    "model.kernels=pallas",
    "seq_len=256",
    "prompts_per_step=2",
    "group_size=2",
    "engine.slots=4",
    "engine.max_cache_length=256",
    "engine.max_prefill_length=128",
]


def test_target_platform_follows_compiling_for_then_the_mesh():
    assert target_platform() == jax.default_backend() == "cpu"
    mesh = jax.make_mesh((1,), ("data",))
    assert mesh_platform(mesh) == "cpu"
    with jax.set_mesh(mesh):
        assert target_platform() == "cpu"
        with compiling_for("tpu"):
            assert target_platform() == "tpu"
    with compiling_for("cuda"):
        assert target_platform() == "gpu"
    assert target_platform() == "cpu"


def test_the_target_not_the_host_picks_kernels_and_precision():
    assert resolve_kernels("auto") == ("jax", None, False)
    assert f32_matmul_precision() is None
    assert attention_kernel("auto", 1024) == ("flash", False)
    with compiling_for("tpu"):
        assert resolve_kernels("auto") == ("pallas", "tpu", False)  # Mosaic, not interpret mode
        assert resolve_kernels("pallas") == ("pallas", "tpu", False)
        assert f32_matmul_precision() == jax.lax.Precision.HIGHEST
        assert attention_kernel("auto", 1024) == ("splash", False)
    with compiling_for("gpu"):
        assert resolve_kernels("auto") == ("jax", None, False)


def test_engine_lowers_from_an_abstract_model_on_cpu():
    """An engine over an ``nnx.eval_shape`` model allocates nothing and still compiles its programs."""
    from tmax_jax.engine.engine import Engine
    from tmax_jax.models.qwen35 import Qwen35Config
    from tmax_jax.rl.train_step import make_model

    model = nnx.eval_shape(lambda: make_model(Qwen35Config.preset("tiny"), remat="full"))
    engine = Engine(model, max_concurrent_decodes=2, max_cache_length=64, max_prefill_length=32)
    assert all(isinstance(a, jax.ShapeDtypeStruct) for a in jax.tree.leaves(engine.params))
    prefill = engine.lower_prefill(rows=2).compile()
    assert prefill.memory_analysis().argument_size_in_bytes > 0
    state = engine.abstract_decode_state()
    assert state.cache.lengths.shape == (2,)


def test_plan_compile_without_libtpu_prints_the_labelled_estimate(monkeypatch, capsys):
    from tmax_jax.cli import main

    monkeypatch.setattr(aot, "libtpu_available", lambda: False)
    args = ["plan", str(ROOT / "configs/tiny-cpu.yaml"), "--compile", "--json", "--set", *TINY]
    assert main(args) == 0
    out, err = capsys.readouterr()
    assert "not installed" in err and "ESTIMATE" in err
    (obj,) = [json.loads(line) for line in out.splitlines()]
    assert obj["estimate"] is True and obj["program"] == "train_step" and obj["bytes"]["total"] > 0


def _local_bytes(tree) -> int:
    """Bytes one device holds of ``tree``'s arrays (ShapeDtypeStructs with NamedShardings), unpadded."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += math.prod(shape) * np.dtype(a.dtype).itemsize
    return total


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The CLI's --json lines and the dumped HLO directory of the tiny config's three programs."""
    import contextlib
    import io

    from tmax_jax.cli import main

    hlo_dir = tmp_path_factory.mktemp("hlo")
    args = ["plan", str(ROOT / "configs/tiny-cpu.yaml"), "--compile", "--json", "--dump-hlo", str(hlo_dir)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main([*args, "--set", *TINY]) == 0
    return [json.loads(line) for line in out.getvalue().splitlines()], hlo_dir


@needs_libtpu
def test_plan_compile_json_reports_xla_tpu_memory(compiled):
    reports, hlo_dir = compiled
    assert [r["program"] for r in reports] == ["train_step", "prefill", "decode"]
    for r in reports:
        assert set(r) == JSON_KEYS
        assert r["platform"] == "tpu" and r["topology"] == "v5p:2x2x1" and r["devices"] == 4
        b = r["bytes"]
        assert set(b) == {"argument", "output", "alias", "temp", "total"}
        assert b["argument"] > 0 and b["output"] > 0 and b["temp"] > 0
        assert b["total"] == b["argument"] + b["output"] - b["alias"] + b["temp"]
        assert r["hbm_bytes"] == int(95.74 * 1024**3) and r["fits"] is True
        assert r["compile_s"] > 0 and Path(r["hlo_path"]).parent == hlo_dir
        assert Path(r["hlo_path"]).read_text().startswith("HloModule")
    train, _, decode = reports
    # Donated inputs come back in place: the train state, and the decode state.
    assert 0 < train["bytes"]["alias"] <= min(train["bytes"]["argument"], train["bytes"]["output"])
    assert decode["bytes"]["alias"] > 0


@needs_libtpu
def test_train_step_arguments_are_the_sharded_state_and_batch(compiled):
    """XLA's argument bytes per chip hold one FSDP shard of the state and of the batch (TPU tiles
    pad small arrays, so at least that), and far less than the whole state."""
    from tmax_jax.rl.train_step import TrainStep, make_model

    reports, _ = compiled
    cfg = load_train_config(ROOT / "configs/tiny-cpu.yaml", parse_dotted(TINY))
    devices = aot.topology_devices(cfg)
    mesh = aot.topology_mesh(cfg, devices)
    model = nnx.eval_shape(lambda: make_model(cfg.model.shape(), dtype=jnp.bfloat16))
    step = TrainStep(model, cfg.rl, mesh, cfg.mesh)
    state = step.abstract_state()
    batch = step.abstract_batch(aot.train_rows(cfg, step.rows_multiple), cfg.seq_len)
    local = _local_bytes((state, batch))
    whole = sum(math.prod(a.shape) * np.dtype(a.dtype).itemsize for a in jax.tree.leaves((state, batch)))
    argument = reports[0]["bytes"]["argument"]
    assert local <= argument < whole
    assert _local_bytes(state) <= reports[0]["bytes"]["alias"]


@needs_libtpu
def test_pallas_kernels_compile_through_mosaic(compiled):
    """kernels=pallas: the train step and the prefill run the delta rule as Mosaic custom calls."""
    _, hlo_dir = compiled
    for name in ("train_step", "prefill"):
        text = (hlo_dir / f"{name}.hlo.txt").read_text()
        assert 'custom_call_target="tpu_custom_call"' in text
        r = hlo_report.analyze(text)
        assert r["pallas_kernel_calls"] > 0 and r["dot_flops"] > 0


def test_a_program_xla_refuses_for_lack_of_hbm_is_reported_as_not_fitting():
    """XLA:TPU refuses (RESOURCE_EXHAUSTED) a program whose temporaries exceed HBM: the plan reports
    it as not fitting, with what XLA said it needs, instead of crashing."""

    class Device:
        platform = "tpu"

    cfg = load_train_config(ROOT / "configs/qwen35-9b-v5p-64.yaml")
    message = (
        "RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO temporaries "
        "(131.10G) exceeds available HBM (95.74G)."
    )
    r = aot._refused("decode", message, 1.5, cfg, [Device()] * 32)
    assert r.fits is False and r.total is None and r.error.startswith("RESOURCE_EXHAUSTED")
    assert r.temp == int(131.10 * 1024**3)
    obj = r.to_json()
    assert set(obj) == JSON_KEYS and obj["fits"] is False and obj["bytes"]["total"] is None
    assert "does NOT fit" in aot.format_report(r)
