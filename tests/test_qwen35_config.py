"""Qwen35Config: presets of the published dense shapes, HF config conversion both ways, named errors."""

import dataclasses

import jax
import pytest
from flax import nnx

from tmax_jax.errors import ConfigError
from tmax_jax.models.qwen35 import Qwen35Config, Qwen35ForCausalLM


def count_params(cfg: Qwen35Config) -> int:
    abstract = nnx.eval_shape(lambda: Qwen35ForCausalLM(cfg, rngs=nnx.Rngs(0)))
    return sum(x.size for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))


@pytest.mark.parametrize(
    "name,low,high",
    [
        ("0.8b", 0.70e9, 0.90e9),
        ("2b", 1.7e9, 2.3e9),
        ("4b", 3.8e9, 4.6e9),
        ("9b", 8.5e9, 9.8e9),
        ("27b", 25e9, 28e9),
    ],
)
def test_presets_have_the_published_sizes(name, low, high):
    cfg = Qwen35Config.preset(name)
    assert cfg.layer_pattern == ("linear_attention",) * 3 + ("full_attention",)
    assert low < count_params(cfg) < high


def test_hf_config_round_trip_and_transformers_agrees():
    from transformers import Qwen3_5TextConfig

    cfg = Qwen35Config.preset("tiny", tie_word_embeddings=False, eos_token_id=3)
    hf = cfg.to_hf_config()
    assert Qwen35Config.from_hf_config(hf) == cfg
    tcfg = Qwen3_5TextConfig(**{k: v for k, v in hf.items() if k not in ("architectures", "model_type")})
    assert list(tcfg.layer_types) == list(cfg.layer_types)
    assert Qwen35Config.from_hf_config(tcfg) == cfg
    vlm = {
        "model_type": "qwen3_5",
        "tie_word_embeddings": True,
        "text_config": {**hf, "tie_word_embeddings": None},
    }
    vlm["text_config"].pop("tie_word_embeddings")
    assert Qwen35Config.from_hf_config(vlm).tie_word_embeddings is True


def test_default_layer_types_follow_full_attention_interval():
    cfg = Qwen35Config.preset("tiny", num_hidden_layers=6, full_attention_interval=3)
    assert cfg.layer_types == ("linear_attention", "linear_attention", "full_attention") * 2
    assert cfg.num_groups == 2 and cfg.num_full_layers == 2 and cfg.num_linear_layers == 4


def test_an_aperiodic_layer_pattern_runs_as_one_period():
    kinds = ("linear_attention", "full_attention", "full_attention")
    cfg = Qwen35Config.preset("tiny", num_hidden_layers=3, layer_types=kinds)
    assert cfg.layer_pattern == kinds and cfg.num_groups == 1


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(layer_types=("linear_attention",) * 3), "layer_types has 3 entries but num_hidden_layers is 4"),
        (dict(layer_types=("linear_attention", "sliding", "x", "full_attention")), "unsupported layer type"),
        (dict(num_key_value_heads=3), "not a multiple of num_key_value_heads=3"),
        (dict(linear_num_key_heads=3), "not a multiple of linear_num_key_heads=3"),
        (dict(hidden_act="gelu"), "hidden_act='gelu' is not supported"),
    ],
)
def test_bad_configs_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        dataclasses.replace(Qwen35Config.preset("tiny"), **overrides)


def test_unknown_preset_and_model_type_and_moe_are_named():
    with pytest.raises(ConfigError, match="unknown Qwen 3.5 preset '70b'"):
        Qwen35Config.preset("70b")
    with pytest.raises(ConfigError, match="unsupported model_type 'qwen2'"):
        Qwen35Config.from_hf_config({"model_type": "qwen2"})
    with pytest.raises(ConfigError, match="MoE"):
        Qwen35Config.from_hf_config(
            {"model_type": "qwen3_5_text", "num_experts": 256, "num_experts_per_tok": 8}
        )
