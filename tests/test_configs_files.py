"""Every shipped config is a TrainConfig: `tmax-jax train` and `tmax-jax plan` read the same file."""

import json
from pathlib import Path

import jax
import pytest

from tmax_jax.errors import ConfigError
from tmax_jax.memory_plan import GiB, make_plan
from tmax_jax.train.config import load_train_config
from tmax_jax.train.setup import policy_checkpoint

CONFIGS = sorted(p for p in Path("configs").glob("*.yaml") if p.name != "task_axes.yaml")
SCALE_OUT = [p for p in CONFIGS if p.name.startswith("qwen35-")]


def test_the_configs_are_there():
    assert {"tiny-cpu.yaml", "qwen35-9b-v5p-64.yaml", "qwen35-9b-8xh200.yaml"} <= {p.name for p in CONFIGS}
    assert len(SCALE_OUT) == 7


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_loads(path):
    cfg = load_train_config(path)
    assert cfg.group_size >= 2 and cfg.rows_per_step == cfg.prompts_per_step * cfg.group_size


@pytest.mark.parametrize("path", SCALE_OUT, ids=lambda p: p.name)
def test_scale_out_configs_carry_the_tmax_recipe(path):
    cfg = load_train_config(path)
    assert (cfg.prompts_per_step, cfg.group_size, cfg.async_steps, cfg.mode) == (8, 32, 4, "async")
    assert cfg.temperature == 1.0 and cfg.rl.loss.temperature == 1.0 and cfg.seq_len == 65536
    assert (cfg.rl.loss.name, cfg.rl.loss.divergence, cfg.rl.loss.delta) == ("dppo", "tv", 0.1)
    assert cfg.rl.optimizer.learning_rate == 1e-6 and cfg.rl.optimizer.schedule == "constant"
    assert cfg.agent.max_turns == 64 and cfg.engine.max_cache_length >= cfg.seq_len
    assert cfg.model.preset in ("9b", "27b", "35b-a3b") and cfg.model.checkpoint.startswith("/path/to/")
    sizes = cfg.mesh.resolve(cfg.plan.num_devices)
    # The trainer pads rows to a multiple of data * fsdp * micro_batches: the recipe's 256 is one.
    assert cfg.rows_per_step % (sizes[0] * sizes[1] * cfg.rl.train_step.micro_batches) == 0


def test_tiny_cpu_config_plans():
    plan = make_plan(load_train_config("configs/tiny-cpu.yaml"))  # plan.num_devices 0: the 8 test devices
    assert plan.mesh_shape["fsdp"] == jax.device_count()
    assert plan.local_rows == 4 * 8 // jax.device_count() and plan.seq_len == 1024 and plan.total > 0


def test_9b_v5p_64_plan_numbers():
    """Shapes only: the 9B at 64K is traced (a few seconds), nothing is allocated."""
    cfg = load_train_config("configs/qwen35-9b-v5p-64.yaml")
    plan = make_plan(cfg)
    assert plan.mesh_shape == {"data": 1, "fsdp": 32, "tensor": 1}
    assert plan.local_rows == 1 and plan.seq_len == 65536
    assert 8.9e9 < plan.num_params < 9.0e9
    # f32 params over 32 chips; grads twice (accumulator + one micro-batch); AdamW's two moments.
    assert plan.params / GiB == pytest.approx(1.05, abs=0.01)
    assert plan.grads == 2 * plan.params and plan.optimizer / GiB == pytest.approx(2.09, abs=0.01)
    assert plan.device_memory == int(88.5 * GiB)


def test_27b_v6e_256_fits_with_sequence_parallelism():
    """32 GB chips: the 27B's 64K-token rows fit only with the residual stream split over tensor=4
    by tokens (the sequence rule; 58.96 GiB planned without it)."""
    plan = make_plan(load_train_config("configs/qwen35-27b-v6e-256.yaml"))
    assert plan.mesh_shape == {"data": 4, "fsdp": 16, "tensor": 4}
    assert (plan.sequence_split, plan.internals_split) == (4, True)
    assert plan.fits and plan.total < 0.85 * plan.device_memory


def test_unknown_key_is_named(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("group_size: 4\nrl:\n  loss:\n    deltta: 0.2\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'rl\.loss\.deltta'"):
        load_train_config(bad)
    with pytest.raises(ConfigError, match=r"model\.dtype='bf16'"):
        load_train_config(None, {"model": {"dtype": "bf16"}})


def test_loss_temperature_must_match_the_sampling_temperature():
    # The engine's logprobs are taken at the sampling temperature; the loss must use the same one.
    with pytest.raises(
        ConfigError, match=r"rl.loss.temperature \(0.5\) must equal the sampling temperature \(0.7\)"
    ):
        load_train_config("configs/tiny-cpu.yaml", {"temperature": 0.7})
    cfg = load_train_config(
        "configs/tiny-cpu.yaml", {"temperature": 0.7, "rl": {"loss": {"temperature": 0.7}}}
    )
    assert cfg.temperature == cfg.rl.loss.temperature == 0.7


def test_a_large_preset_needs_a_checkpoint(tmp_path):
    cfg = load_train_config(None, {"model": {"preset": "9b"}})
    with pytest.raises(ConfigError, match="model.preset='9b' needs model.checkpoint"):
        policy_checkpoint(cfg, tmp_path)


@pytest.mark.parametrize(
    ("preset", "field", "want"), [("tiny-moe", "num_experts", 8), ("tiny-qwen3", "model_type", "qwen3")]
)
def test_tiny_presets_make_a_random_checkpoint_of_their_shape(tmp_path, preset, field, want):
    """The demo runs on the tiny MoE and Qwen3 shapes too (routing replay, other families): train
    writes a random checkpoint of the preset's shape that transformers' config reads back."""
    from transformers import AutoConfig

    cfg = load_train_config(None, {"model": {"preset": preset}})
    path = policy_checkpoint(cfg, tmp_path)
    hf = AutoConfig.from_pretrained(path)
    assert getattr(hf, field) == want
    assert hf.hidden_size == cfg.model.shape().hidden_size


def test_checkpoint_must_have_the_planned_shape(tmp_path):
    from tmax_jax.models.qwen35 import Qwen35Config

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(Qwen35Config.preset("tiny").to_hf_config()))
    same = load_train_config(None, {"model": {"checkpoint": str(ckpt), "preset": "tiny"}})
    assert policy_checkpoint(same, tmp_path) == ckpt
    assert same.model.shape() == load_train_config(None, {"model": {"checkpoint": str(ckpt)}}).model.shape()
    other = load_train_config(None, {"model": {"checkpoint": str(ckpt), "preset": "9b"}})
    with pytest.raises(ConfigError, match="hidden_size: 64 != 4096"):
        policy_checkpoint(other, tmp_path)
    deeper = load_train_config(
        None, {"model": {"checkpoint": str(ckpt), "overrides": {"num_hidden_layers": 8}}}
    )
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        policy_checkpoint(deeper, tmp_path)


def test_a_run_written_before_the_new_fields_resumes(tmp_path):
    import yaml

    from tmax_jax.config import to_dict
    from tmax_jax.train.setup import prepare_run_dir

    cfg = load_train_config("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path)})
    old = to_dict(cfg)
    for key in ("plan", "distributed"):
        del old[key]
    del old["model"]["preset"], old["model"]["overrides"]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    prepare_run_dir(cfg)  # the missing fields hold their defaults: same run
    moved = load_train_config("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path), "plan": {"num_devices": 4}})
    prepare_run_dir(moved)  # planning hardware is not part of the run
    with pytest.raises(ConfigError, match="changed: group_size"):
        prepare_run_dir(
            load_train_config("configs/tiny-cpu.yaml", {"run_dir": str(tmp_path), "group_size": 4})
        )
