"""benchmarks/hlo_report.py on programs whose matmul work is known by construction."""

import importlib.util
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "hlo_report.py"
_spec = importlib.util.spec_from_file_location("hlo_report", _PATH)
hlo_report = importlib.util.module_from_spec(_spec)
sys.modules["hlo_report"] = hlo_report  # dataclasses look their module up
_spec.loader.exec_module(hlo_report)


def _compiled_text(fn, *shapes):
    args = [jax.ShapeDtypeStruct(s, d) for s, d in shapes]
    return jax.jit(fn).lower(*args).compile().as_text()


@pytest.mark.parametrize("n", [3, 7])
def test_scan_of_matmuls_is_weighted_by_its_trip_count(n):
    m, k, p = 16, 32, 24

    def f(x_MxK, ws_NxKxK, w_KxP):
        def body(x, w):
            return jnp.tanh(x @ w), None

        x, _ = jax.lax.scan(body, x_MxK, ws_NxKxK)
        return x @ w_KxP

    text = _compiled_text(f, ((m, k), jnp.float32), ((n, k, k), jnp.float32), ((k, p), jnp.float32))
    r = hlo_report.analyze(text)
    assert r["loops_without_trip_count"] == []
    assert r["dot_flops"] == n * 2 * m * k * k + 2 * m * k * p
    assert r["f32_dots"] == r["dots"] == 2
    # The scanned dot runs n times; its source line is this file's.
    runs = sorted(d["runs"] for d in r["f32_dot_list"])
    assert runs == [1, n]
    assert all("test_hlo_report.py" in d["source"] for d in r["f32_dot_list"])


def test_fori_loop_bound_and_nested_loops():
    """A fori_loop inside a scan: the inner body runs outer x inner times."""
    outer, inner, d = 4, 5, 8

    def f(x_DxD, w_DxD):
        def step(x, _):
            x = jax.lax.fori_loop(0, inner, lambda i, y: y @ w_DxD, x)
            return x, None

        return jax.lax.scan(step, x_DxD, None, length=outer)[0]

    text = _compiled_text(f, ((d, d), jnp.float32), ((d, d), jnp.float32))
    r = hlo_report.analyze(text)
    assert r["loops_without_trip_count"] == []
    assert r["dot_flops"] == outer * inner * 2 * d * d * d


def test_mxu_passes_by_precision_and_dtype():
    d = 16

    def f(a, b, c, e):
        hi = jnp.dot(a, b, precision=jax.lax.Precision.HIGHEST)
        mid = jnp.dot(a, b, precision=jax.lax.Precision.HIGH)
        lo = jnp.dot(c, e, preferred_element_type=jnp.float32)
        return hi + mid + lo

    shapes = [((d, d), jnp.float32)] * 2 + [((d, d), jnp.bfloat16)] * 2
    text = _compiled_text(f, *shapes)
    r = hlo_report.analyze(text)
    one = 2 * d * d * d
    assert r["dot_flops"] == 3 * one
    # XLA:CPU keeps the precision attribute; bf16 operands are one pass whatever it says.
    assert r["mxu_flops"] == (6 + 3 + 1) * one
    assert r["f32_dots"] == 2


def test_parses_tpu_convolution_dots_and_stack_frames():
    """XLA:TPU's form: dots as convolutions (a batched dot with dilated batch dims), sources in the
    module's StackFrames table, loops bounded by a loop-carried constant."""
    text = """HloModule m

FileNames
1 "/x/tmax_jax/models/qwen35/delta_rule.py"

FunctionNames
1 "f"

FileLocations
1 {file_name_id=1 function_name_id=1 line=77 end_line=77 column=1 end_column=2}

StackFrames
1 {file_location_id=1 parent_frame_id=1}

%cond (p: (s32[], s32[], f32[8,4,64,16])) -> pred[] {
  %p = (s32[], s32[], f32[8,4,64,16]{3,2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=1
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], s32[], f32[8,4,64,16])) -> (s32[], s32[], f32[8,4,64,16]) {
  %p = (s32[], s32[], f32[8,4,64,16]{3,2,1,0}) parameter(0)
  %a = f32[8,4,64,16]{3,2,1,0} get-tuple-element(%p), index=2
  %w = f32[8,4,16,16]{3,2,1,0} constant({...})
  %conv = f32[8,4,64,16]{3,2,1,0} convolution(%a, %w), window={size=8x4 stride=7x3 lhs_dilate=8x4}, dim_labels=01bf_01io->01bf, operand_precision={highest,highest}, metadata={op_name="dot" stack_frame_id=1}
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] get-tuple-element(%p), index=1
  ROOT %t = (s32[], s32[], f32[8,4,64,16]) tuple(%i, %n, %conv)
}

ENTRY %main (x: f32[8,4,64,16]) -> f32[8,4,64,16] {
  %x = f32[8,4,64,16]{3,2,1,0} parameter(0)
  %zero = s32[] constant(0)
  %ten = s32[] constant(10)
  %init = (s32[], s32[], f32[8,4,64,16]) tuple(%zero, /*index=1*/%ten, %x)
  %loop = (s32[], s32[], f32[8,4,64,16]) while(%init), condition=%cond, body=%body
  ROOT %out = f32[8,4,64,16]{3,2,1,0} get-tuple-element(%loop), index=2
}
"""
    r = hlo_report.analyze(text)
    # Each of the 8 x 4 batch entries: a [64, 16] x [16, 16] matmul; 10 trips.
    assert r["dot_flops"] == 10 * 8 * 4 * 2 * 64 * 16 * 16
    assert r["mxu_flops"] == 6 * r["dot_flops"]
    (d,) = r["f32_dot_list"]
    assert d["source"] == "delta_rule.py:77" and d["runs"] == 10 and d["precision"] == "highest"
