"""HF checkpoints in and out: save_hf round trip through transformers, sharded writes, placement on a
mesh of 8 fake CPU devices, and a named error for each kind of broken checkpoint."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers_hf import hf_logits, make_tiny_hf_checkpoint, random_ids

from tmax_jax.checkpoints import load_hf, save_hf
from tmax_jax.checkpoints.safetensors_io import SafetensorsFile, write_safetensors
from tmax_jax.errors import CheckpointError

pytest.importorskip("torch")
forward = nnx.jit(lambda model, ids: model(ids))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_hf_checkpoint(tmp_path_factory.mktemp("ckpt"), seed=11, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def model(ckpt):
    return load_hf(ckpt)


def test_save_hf_round_trip_loads_in_transformers_with_the_same_logits(model, tmp_path):
    from transformers import AutoModelForCausalLM

    out = save_hf(model, tmp_path / "export")
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text"
    hf = AutoModelForCausalLM.from_pretrained(str(out), dtype="float32").eval()
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    ids = random_ids(np.random.default_rng(0), 2, 77, 256)
    ours = np.asarray(forward(model, jnp.asarray(ids)))
    np.testing.assert_allclose(hf_logits(hf, ids), ours, atol=2e-5, rtol=2e-4)
    again = load_hf(out)
    np.testing.assert_array_equal(np.asarray(forward(again, jnp.asarray(ids))), ours)


def test_sharded_save_writes_an_index_and_reloads(model, ckpt, tmp_path):
    out = save_hf(model, tmp_path / "sharded", max_shard_size="40KB", tokenizer=None)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((out / f).is_file() for f in files)
    assert not (out / "model.safetensors").exists()
    for f in files:
        assert (out / f).stat().st_size < 40_000 + 70_000  # one over-size tensor may exceed the limit alone
    ids = random_ids(np.random.default_rng(1), 1, 30, 256)
    np.testing.assert_allclose(hf_logits(out, ids), hf_logits(ckpt, ids), atol=1e-6)
    np.testing.assert_array_equal(
        np.asarray(forward(load_hf(out), jnp.asarray(ids))), np.asarray(forward(model, jnp.asarray(ids)))
    )


def test_bfloat16_checkpoint_is_read_and_written_in_bfloat16(model, tmp_path):
    m16 = load_hf(save_hf(model, tmp_path / "f32"), dtype="bfloat16")
    out = save_hf(m16, tmp_path / "bf16")
    f = SafetensorsFile(out / "model.safetensors")
    assert f.get("model.embed_tokens.weight").dtype.name == "bfloat16"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    back = load_hf(out, dtype="float32")
    np.testing.assert_array_equal(
        np.asarray(back.embed_tokens[...]), np.asarray(m16.embed_tokens[...].astype(jnp.float32))
    )


def test_load_with_a_mesh_places_every_parameter_with_its_logical_sharding(ckpt):
    assert len(jax.devices()) == 8
    # Auto axes: XLA propagates shardings through the model's ops (GSPMD).
    mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rules = {"embed": "fsdp", "mlp": "tensor", "q_heads": "tensor", "kv_heads": "tensor", "vocab": "tensor"}
    model = load_hf(ckpt, mesh=mesh, rules=rules)
    state = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(state)
    for (path, var), (_, spec_var) in zip(nnx.to_flat_state(state), nnx.to_flat_state(specs)):
        names = var.get_metadata()["out_sharding"]
        assert names and len(names) == var[...].ndim, path
        expected = jax.sharding.PartitionSpec(*(rules.get(n) for n in names))
        assert var[...].sharding.spec == expected, path
        assert spec_var.get_value() == jax.sharding.PartitionSpec(*names), path
    assert model.blocks.layers[0].mlp.gate_proj[...].sharding.spec == jax.sharding.PartitionSpec(
        None, "fsdp", "tensor"
    )
    ids = jnp.asarray(random_ids(np.random.default_rng(2), 2, 16, 256))
    np.testing.assert_allclose(
        np.asarray(forward(model, ids)), hf_logits(ckpt, np.asarray(ids)), atol=2e-5, rtol=2e-4
    )


# --- broken checkpoints -------------------------------------------------------------------------


def _copy(ckpt, tmp_path, name="broken"):
    dst = tmp_path / name
    shutil.copytree(ckpt, dst)
    return dst


def _rewrite(path, edit):
    f = SafetensorsFile(path / "model.safetensors")
    tensors = {k: np.array(f.get(k)) for k in f.keys()}
    del f
    edit(tensors)
    write_safetensors(path / "model.safetensors", tensors.items())


def test_missing_directory_config_and_weights_are_named(ckpt, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        load_hf(tmp_path / "nowhere")
    d = _copy(ckpt, tmp_path, "noconfig")
    (d / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_hf(d)
    d = _copy(ckpt, tmp_path, "noweights")
    (d / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="missing model.safetensors"):
        load_hf(d)


def test_index_pointing_at_a_missing_shard_is_named(model, tmp_path):
    out = save_hf(model, tmp_path / "sh", max_shard_size="40KB")
    victim = sorted(out.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"missing file {victim.name}"):
        load_hf(out)


def test_missing_extra_and_misshapen_tensors_are_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path, "missing")
    _rewrite(d, lambda t: t.pop("model.layers.2.linear_attn.A_log"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.2\.linear_attn\.A_log"):
        load_hf(d)
    d = _copy(ckpt, tmp_path, "extra")
    _rewrite(d, lambda t: t.update({"model.layers.0.mystery.weight": np.zeros((2, 2), np.float32)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.0\.mystery\.weight"):
        load_hf(d)
    d = _copy(ckpt, tmp_path, "shape")
    _rewrite(
        d, lambda t: t.update({"model.layers.3.self_attn.k_proj.weight": np.zeros((16, 32), np.float32)})
    )
    with pytest.raises(
        CheckpointError,
        match=r"model\.layers\.3\.self_attn\.k_proj\.weight has shape \(16, 32\), expected \(32, 32\)",
    ):
        load_hf(d)


def test_unsupported_model_type_is_named(ckpt, tmp_path):
    d = _copy(ckpt, tmp_path, "llama")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unsupported model_type 'llama'"):
        load_hf(d)
