"""Name and layout mapping between transformers' Qwen 3.5 tensors and our stacked nnx parameters.

transformers stores Linear weights ``[out, in]`` per layer; we store ``[in, ...out]`` stacked over
pattern periods (``layers`` axis first). Each rule converts one HF tensor into one slice of ours and back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np

from tmax_jax.models.qwen35.config import FULL, Qwen35Config

TEXT_PREFIX = "model."
VLM_PREFIX = "model.language_model."


@dataclasses.dataclass(frozen=True)
class Rule:
    hf_suffix: str  # after "layers.{i}." (or the whole name for globals)
    ours: tuple[str, ...]  # nnx state path below blocks.layers[p] (or from the model root)
    to_ours: Callable[[np.ndarray, Qwen35Config], np.ndarray]
    to_hf: Callable[[np.ndarray, Qwen35Config], np.ndarray]


def _same(x, cfg):
    return x


def _t(x, cfg):
    return x.T


def _q_in(x, cfg):  # [Hq*2hd, D] -> [D, Hq, 2hd] (Qwen3, no output gate: [Hq*hd, D] -> [D, Hq, hd])
    width = (2 if cfg.attn_output_gate else 1) * cfg.head_dim
    return x.T.reshape(cfg.hidden_size, cfg.num_attention_heads, width)


def _q_out(x, cfg):
    return x.reshape(cfg.hidden_size, -1).T


def _kv_in(x, cfg):  # [Hkv*hd, D] -> [D, Hkv, hd]
    return x.T.reshape(cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim)


def _kv_out(x, cfg):
    return x.reshape(cfg.hidden_size, -1).T


def _o_in(x, cfg):  # [D, Hq*hd] -> [Hq, hd, D]
    return x.T.reshape(cfg.num_attention_heads, cfg.head_dim, cfg.hidden_size)


def _o_out(x, cfg):
    return x.reshape(-1, cfg.hidden_size).T


def _conv_in(x, cfg):  # [C, 1, K] -> [K, C]
    return x[:, 0, :].T


def _conv_out(x, cfg):
    return x.T[:, None, :]


ATTENTION_RULES = (
    Rule("self_attn.q_proj.weight", ("self_attn", "q_proj"), _q_in, _q_out),
    Rule("self_attn.k_proj.weight", ("self_attn", "k_proj"), _kv_in, _kv_out),
    Rule("self_attn.v_proj.weight", ("self_attn", "v_proj"), _kv_in, _kv_out),
    Rule("self_attn.o_proj.weight", ("self_attn", "o_proj"), _o_in, _o_out),
    Rule("self_attn.q_norm.weight", ("self_attn", "q_norm"), _same, _same),
    Rule("self_attn.k_norm.weight", ("self_attn", "k_norm"), _same, _same),
)
DELTANET_RULES = (
    Rule("linear_attn.in_proj_qkv.weight", ("linear_attn", "in_proj_qkv"), _t, _t),
    Rule("linear_attn.in_proj_z.weight", ("linear_attn", "in_proj_z"), _t, _t),
    Rule("linear_attn.in_proj_b.weight", ("linear_attn", "in_proj_b"), _t, _t),
    Rule("linear_attn.in_proj_a.weight", ("linear_attn", "in_proj_a"), _t, _t),
    Rule("linear_attn.conv1d.weight", ("linear_attn", "conv_weight"), _conv_in, _conv_out),
    Rule("linear_attn.dt_bias", ("linear_attn", "dt_bias"), _same, _same),
    Rule("linear_attn.A_log", ("linear_attn", "A_log"), _same, _same),
    Rule("linear_attn.norm.weight", ("linear_attn", "norm"), _same, _same),
    Rule("linear_attn.out_proj.weight", ("linear_attn", "out_proj"), _t, _t),
)


def _gate_up_in(x, cfg):  # fused [E, 2I, D] (gate rows, then up rows) -> [E, D, 2, I]
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    return x.reshape(E, 2, I, cfg.hidden_size).transpose(0, 3, 1, 2)


def _gate_up_out(x, cfg):
    E, I = cfg.num_experts, cfg.moe_intermediate_size
    return x.transpose(0, 2, 3, 1).reshape(E, 2 * I, cfg.hidden_size)


def _experts_t(x, cfg):  # [E, out, in] <-> [E, in, out]
    return x.transpose(0, 2, 1)


def _row_in(x, cfg):  # [1, D] -> [D]
    return x[0]


def _row_out(x, cfg):
    return x[None]


NORM_RULES = (
    Rule("input_layernorm.weight", ("input_layernorm",), _same, _same),
    Rule("post_attention_layernorm.weight", ("post_attention_layernorm",), _same, _same),
)
DENSE_MLP_RULES = (
    Rule("mlp.gate_proj.weight", ("mlp", "gate_proj"), _t, _t),
    Rule("mlp.up_proj.weight", ("mlp", "up_proj"), _t, _t),
    Rule("mlp.down_proj.weight", ("mlp", "down_proj"), _t, _t),
)
COMMON_RULES = NORM_RULES + DENSE_MLP_RULES
# Experts as transformers holds them (fused 3-D tensors); per-expert checkpoints
# (``mlp.experts.{e}.gate_proj.weight`` ...) are assembled into these by the loader.
GATE_UP = "mlp.experts.gate_up_proj"
DOWN = "mlp.experts.down_proj"
MOE_RULES = (
    Rule("mlp.gate.weight", ("mlp", "router"), _t, _t),
    Rule(GATE_UP, ("mlp", "gate_up_proj"), _gate_up_in, _gate_up_out),
    Rule(DOWN, ("mlp", "down_proj"), _experts_t, _experts_t),
)
SHARED_EXPERT_RULES = (
    Rule("mlp.shared_expert.gate_proj.weight", ("mlp", "shared_expert", "gate_proj"), _t, _t),
    Rule("mlp.shared_expert.up_proj.weight", ("mlp", "shared_expert", "up_proj"), _t, _t),
    Rule("mlp.shared_expert.down_proj.weight", ("mlp", "shared_expert", "down_proj"), _t, _t),
    Rule("mlp.shared_expert_gate.weight", ("mlp", "shared_expert_gate"), _row_in, _row_out),
)


def mlp_rules(cfg: Qwen35Config) -> tuple[Rule, ...]:
    if not cfg.is_moe:
        return DENSE_MLP_RULES
    return MOE_RULES + (SHARED_EXPERT_RULES if cfg.shared_expert_intermediate_size else ())


def per_expert_names(fused_name: str, num_experts: int) -> list[tuple[str, ...]] | None:
    """For a fused expert tensor name, the per-expert tensor names that hold the same values, one
    tuple per expert (gate_up: (gate, up), concatenated along rows; down: (down,)); else None."""
    for fused, parts in ((GATE_UP, ("gate_proj", "up_proj")), (DOWN, ("down_proj",))):
        if fused_name.endswith(fused):
            stem = fused_name[: -len(fused)] + "mlp.experts."
            return [tuple(f"{stem}{e}.{part}.weight" for part in parts) for e in range(num_experts)]
    return None


@dataclasses.dataclass(frozen=True)
class StackedParam:
    """One of our parameters and, per stacked slice, the HF tensor name that fills it."""

    path: tuple  # nnx state path from the model root
    rule: Rule
    hf_names: tuple[str, ...]  # one per slice (one entry for unstacked parameters)
    stacked: bool


def layer_params(cfg: Qwen35Config, prefix: str) -> Iterator[StackedParam]:
    pattern = cfg.layer_pattern
    P = len(pattern)
    for p, kind in enumerate(pattern):
        rules = NORM_RULES + mlp_rules(cfg) + (ATTENTION_RULES if kind == FULL else DELTANET_RULES)
        for rule in rules:
            names = tuple(f"{prefix}layers.{g * P + p}.{rule.hf_suffix}" for g in range(cfg.num_groups))
            yield StackedParam(("blocks", "layers", p, *rule.ours), rule, names, True)


def global_params(cfg: Qwen35Config, prefix: str) -> Iterator[StackedParam]:
    yield StackedParam(
        ("embed_tokens",),
        Rule("embed_tokens.weight", ("embed_tokens",), _same, _same),
        (f"{prefix}embed_tokens.weight",),
        False,
    )
    yield StackedParam(
        ("norm",), Rule("norm.weight", ("norm",), _same, _same), (f"{prefix}norm.weight",), False
    )
    if not cfg.tie_word_embeddings:
        yield StackedParam(
            ("lm_head",), Rule("lm_head.weight", ("lm_head",), _t, _t), ("lm_head.weight",), False
        )


def all_params(cfg: Qwen35Config, prefix: str = TEXT_PREFIX) -> list[StackedParam]:
    return [*global_params(cfg, prefix), *layer_params(cfg, prefix)]


# Tensors a published checkpoint may carry that the text decoder does not use (the MTP module's
# are read by ``load_mtp``).
IGNORED_PREFIXES = ("model.visual.", "mtp.", "model.mtp.")
MTP_PREFIXES = ("mtp.", "model.mtp.")


def mtp_params(cfg: Qwen35Config, prefix: str, num_layers: int) -> list[StackedParam]:
    """The MTP module's parameters (``models.qwen35.mtp``): its fc and three norms, and
    ``num_layers`` full-attention decoder layers stacked like the target's."""
    out = [
        StackedParam(("fc",), Rule("fc.weight", ("fc",), _t, _t), (f"{prefix}fc.weight",), False),
        *(
            StackedParam((n,), Rule(f"{n}.weight", (n,), _same, _same), (f"{prefix}{n}.weight",), False)
            for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")
        ),
    ]
    for rule in NORM_RULES + mlp_rules(cfg) + ATTENTION_RULES:
        names = tuple(f"{prefix}layers.{i}.{rule.hf_suffix}" for i in range(num_layers))
        out.append(StackedParam(("layers", *rule.ours), rule, names, True))
    return out
