"""TMAX_JAX_F32_DOT: how the float32 matmuls that must stay float32 (LM head, delta-rule state) run
on accelerators; CPU's exact float32 dot whatever the setting; a bad name is a ConfigError."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tmax_jax.errors import ConfigError
from tmax_jax.models.qwen35 import numerics
from tmax_jax.rl.logprobs import head_logits, head_precision


def test_default_is_exact_float32_on_accelerators(monkeypatch):
    monkeypatch.delenv(numerics.F32_DOT_ENV, raising=False)
    assert numerics.f32_dot_setting() == "highest"
    assert numerics.f32_matmul_precision("gpu") == jax.lax.Precision.HIGHEST
    assert numerics.f32_matmul_precision("tpu") == jax.lax.Precision.HIGHEST
    assert numerics.f32_matmul_precision("cpu") is None
    assert head_precision() is None  # this host is a CPU


@pytest.mark.parametrize(
    "name,preset",
    [
        ("bf16x6", jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X6),
        ("BF16X3", jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3),
        (" tf32x3 ", jax.lax.DotAlgorithmPreset.TF32_TF32_F32_X3),
    ],
)
def test_named_algorithms_on_accelerators_and_cpu_unchanged(monkeypatch, name, preset):
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((3, 5, 16)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((16, 40)), jnp.float32)
    monkeypatch.delenv(numerics.F32_DOT_ENV, raising=False)
    before = np.asarray(jax.jit(head_logits)(h, w))
    monkeypatch.setenv(numerics.F32_DOT_ENV, name)
    assert numerics.f32_matmul_precision("gpu") == preset
    assert numerics.f32_matmul_precision("cpu") is None
    after = np.asarray(jax.jit(head_logits)(h, w))  # traced again: the setting is read at trace time
    np.testing.assert_array_equal(after, before)
    ref = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    np.testing.assert_allclose(after, ref, rtol=1e-5, atol=1e-5)


def test_a_bad_name_is_a_config_error_on_any_backend(monkeypatch):
    monkeypatch.setenv(numerics.F32_DOT_ENV, "fp32")
    with pytest.raises(ConfigError, match=r"TMAX_JAX_F32_DOT='fp32'; expected one of"):
        numerics.f32_matmul_precision("cpu")
    with pytest.raises(ConfigError, match="TMAX_JAX_F32_DOT"):
        head_logits(jnp.ones((2, 4)), jnp.ones((4, 3)))
