"""Qwen 3.5 text-decoder config: a frozen dataclass with presets and HF config conversion."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from tmax_jax.errors import ConfigError
from tmax_jax.kernels.dispatch import KERNEL_CHOICES

LINEAR = "linear_attention"
FULL = "full_attention"
_LAYER_KINDS = (LINEAR, FULL)

# HF model_types whose text decoder this config describes: the text CausalLM and the published VLM.
TEXT_MODEL_TYPE = "qwen3_5_text"
VLM_MODEL_TYPE = "qwen3_5"
MOE_TEXT_MODEL_TYPE = "qwen3_5_moe_text"
MOE_VLM_MODEL_TYPE = "qwen3_5_moe"
QWEN3_MODEL_TYPE = "qwen3"  # Qwen3 dense: plain attention in every layer (tmax_jax.models.qwen3)
VLM_MODEL_TYPES = (VLM_MODEL_TYPE, MOE_VLM_MODEL_TYPE)
SUPPORTED_MODEL_TYPES = (
    TEXT_MODEL_TYPE,
    VLM_MODEL_TYPE,
    MOE_TEXT_MODEL_TYPE,
    MOE_VLM_MODEL_TYPE,
    QWEN3_MODEL_TYPE,
)

# Architecture families this decoder implements. "qwen3_5": gated attention (sigmoid output gate,
# partial RoPE), zero-centred RMSNorms, Gated DeltaNet layers. "qwen3": plain GQA attention with
# q/k RMSNorm, ordinary weight-scaled RMSNorms, full attention in every layer.
QWEN35 = "qwen3_5"
QWEN3 = "qwen3"
FAMILIES = (QWEN35, QWEN3)


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # Empty means "one full-attention layer every full_attention_interval", as transformers does.
    layer_types: tuple[str, ...] = ()
    full_attention_interval: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    chunk_size: int = 64
    # Runtime choice, not an HF field: the delta rule's implementation (tmax_jax.kernels.dispatch).
    # "jax" by default: "auto" picks the Pallas kernels on TPU, which have passed interpret-mode and
    # lowering checks only (on an H200 the Triton ones failed device_check, so "auto" is JAX on GPU).
    kernels: str = "jax"
    # Runtime choice: causal self-attention past one block (attention.attention_kernel). "auto": the
    # splash kernel on TPU, the JAX flash form elsewhere; "pallas" adds the Triton kernel on GPU.
    attention_kernels: str = "auto"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    family: str = QWEN35
    # Mixture of experts (Qwen 3.5 MoE): 0 experts = the dense SwiGLU MLP in every layer. Otherwise
    # every layer's MLP is a sparse block: softmax router, top-k experts of moe_intermediate_size,
    # plus a shared expert of shared_expert_intermediate_size behind a sigmoid gate.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k router probabilities to sum to 1
    # Train-time coefficient of the load-balancing loss (HF field; tmax-jax's RL keeps it off unless
    # the loss asks for it: see Qwen35ForCausalLM.router_aux_loss).
    router_aux_loss_coef: float = 0.001
    # YaRN context extension (Qwen3: rope_scaling {"rope_type": "yarn", "factor", ...}); factor 0 = off.
    # Positions up to yarn_factor * yarn_original_max_position_embeddings.
    yarn_factor: float = 0.0
    yarn_original_max_position_embeddings: int = 0

    def __post_init__(self):
        if not self.layer_types:
            interval = 1 if self.family == QWEN3 else self.full_attention_interval
            kinds = tuple(LINEAR if (i + 1) % interval else FULL for i in range(self.num_hidden_layers))
            object.__setattr__(self, "layer_types", kinds)
        else:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self.validate()

    def validate(self) -> None:
        if len(self.layer_types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}"
            )
        bad = sorted({t for t in self.layer_types if t not in _LAYER_KINDS})
        if bad:
            raise ConfigError(
                f"layer_types: unsupported layer type(s) {bad}; expected one of {list(_LAYER_KINDS)}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ConfigError(
                f"linear_num_value_heads={self.linear_num_value_heads} is not a multiple of "
                f"linear_num_key_heads={self.linear_num_key_heads}"
            )
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported (only 'silu')")
        if self.attention_bias:
            raise ConfigError("attention_bias=True is not supported (Qwen 3.5 has no attention biases)")
        if self.rotary_dim % 2 or self.rotary_dim > self.head_dim:
            raise ConfigError(
                f"head_dim * partial_rotary_factor = {self.rotary_dim} must be even and <= head_dim={self.head_dim}"
            )
        if self.kernels not in KERNEL_CHOICES:
            raise ConfigError(f"kernels={self.kernels!r}; expected one of {list(KERNEL_CHOICES)}")
        if self.attention_kernels not in KERNEL_CHOICES:
            raise ConfigError(
                f"attention_kernels={self.attention_kernels!r}; expected one of {list(KERNEL_CHOICES)}"
            )
        if self.family not in FAMILIES:
            raise ConfigError(f"family={self.family!r}; expected one of {list(FAMILIES)}")
        if self.family == QWEN3 and self.num_linear_layers:
            raise ConfigError("family='qwen3' has full attention in every layer; layer_types has linear ones")
        if self.num_experts < 0:
            raise ConfigError(f"num_experts={self.num_experts} must be >= 0")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0:
                raise ConfigError(
                    f"moe_intermediate_size={self.moe_intermediate_size} must be > 0 with experts"
                )
            if self.shared_expert_intermediate_size < 0:
                raise ConfigError(
                    f"shared_expert_intermediate_size={self.shared_expert_intermediate_size} must be >= 0"
                )
        if self.yarn_factor:
            if self.yarn_factor <= 1 or self.yarn_original_max_position_embeddings <= 0:
                raise ConfigError(
                    f"yarn_factor={self.yarn_factor} must be > 1 with yarn_original_max_position_embeddings "
                    f"> 0 (got {self.yarn_original_max_position_embeddings})"
                )
            if self.family != QWEN3:
                raise ConfigError("YaRN rope scaling is supported for family='qwen3' only")
        _ = self.layer_pattern  # raises when layer_types is not periodic

    # Derived sizes -------------------------------------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def lin_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def lin_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.lin_key_dim + self.lin_value_dim

    @property
    def yarn(self) -> tuple[float, int] | None:
        """(factor, original max positions) when YaRN is on, else None (rope_cos_sin's argument)."""
        return (self.yarn_factor, self.yarn_original_max_position_embeddings) if self.yarn_factor else None

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attn_output_gate(self) -> bool:
        """Qwen 3.5 attention gates its output per head with a sigmoid (q_proj is twice as wide)."""
        return self.family == QWEN35

    @property
    def zero_centred_norms(self) -> bool:
        """Qwen 3.5 RMSNorms scale by (1 + w), weights stored around 0; Qwen3's by w, around 1."""
        return self.family == QWEN35

    @property
    def layer_pattern(self) -> tuple[str, ...]:
        """The shortest period of layer_types; layers are stacked and scanned one period at a time."""
        n = self.num_hidden_layers
        for p in range(1, n + 1):
            if n % p == 0 and all(self.layer_types[i] == self.layer_types[i % p] for i in range(n)):
                return self.layer_types[:p]
        raise ConfigError(
            f"layer_types is not periodic: {list(self.layer_types)}"
        )  # unreachable: p=n matches

    @property
    def num_groups(self) -> int:
        return self.num_hidden_layers // len(self.layer_pattern)

    @property
    def num_full_layers(self) -> int:
        return sum(t == FULL for t in self.layer_types)

    @property
    def num_linear_layers(self) -> int:
        return sum(t == LINEAR for t in self.layer_types)

    # Presets -------------------------------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> Qwen35Config:
        key = name.lower()
        if key not in PRESETS:
            raise ConfigError(f"unknown Qwen 3.5 preset {name!r}; known: {sorted(PRESETS)}")
        if (
            "num_hidden_layers" in overrides or "full_attention_interval" in overrides
        ) and "layer_types" not in overrides:
            overrides["layer_types"] = ()  # re-derive the pattern for the new depth / interval
        return dataclasses.replace(PRESETS[key], **overrides)

    # HF conversion -------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: Any) -> Qwen35Config:
        """From a transformers config object or a config.json dict (text or VLM layout)."""
        d = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf)
        model_type = d.get("model_type", TEXT_MODEL_TYPE)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; tmax-jax loads {list(SUPPORTED_MODEL_TYPES)}"
            )
        if model_type == QWEN3_MODEL_TYPE:
            from tmax_jax.models.qwen3.config import qwen3_from_hf_config

            return qwen3_from_hf_config(d)
        # Tying follows the config transformers' model class reads for this layout:
        # Qwen3_5ForConditionalGeneration (VLM) reads the top level's tie_word_embeddings and never
        # text_config's; Qwen3_5ForCausalLM (text) reads its own. Both default to False. A checkpoint
        # that also holds lm_head.weight is never tied (load_hf; transformers keeps both tensors too).
        tie = bool(d.get("tie_word_embeddings", False))
        if model_type in VLM_MODEL_TYPES:
            text = d.get("text_config")
            if not isinstance(text, Mapping):
                raise ConfigError(f"model_type {model_type!r} config has no text_config mapping")
            d = dict(text)
        moe = model_type in (MOE_TEXT_MODEL_TYPE, MOE_VLM_MODEL_TYPE)
        if moe and not d.get("num_experts"):
            raise ConfigError(f"model_type {model_type!r} config has no num_experts")
        if not moe and (d.get("num_experts") or d.get("num_experts_per_tok")):
            raise ConfigError(
                f"model_type {model_type!r} has num_experts set; Qwen 3.5 MoE checkpoints are "
                f"model_type {MOE_TEXT_MODEL_TYPE!r} or {MOE_VLM_MODEL_TYPE!r}"
            )
        rope = dict(d.get("rope_parameters") or d.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"rope_type {rope_type!r} is not supported (only 'default')")
        fields = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in d.items() if k in fields and v is not None}
        if "layer_types" in kwargs:
            kwargs["layer_types"] = tuple(kwargs["layer_types"])
        kwargs["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", cls.rope_theta)))
        kwargs["partial_rotary_factor"] = float(
            rope.get("partial_rotary_factor", d.get("partial_rotary_factor", cls.partial_rotary_factor))
        )
        for key in ("eos_token_id", "bos_token_id", "pad_token_id"):
            if isinstance(kwargs.get(key), list):
                kwargs[key] = kwargs[key][0] if kwargs[key] else None
        kwargs["tie_word_embeddings"] = tie
        kwargs.pop("chunk_size", None)
        kwargs.pop("kernels", None)  # runtime choices are never read from a checkpoint
        kwargs.pop("attention_kernels", None)
        kwargs.pop("family", None)
        if moe:
            kwargs["intermediate_size"] = 0  # no dense MLP in a MoE decoder
        return cls(**kwargs)

    def to_hf_config(self) -> dict[str, Any]:
        """A config.json dict for transformers' Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM (text
        layout) or Qwen3ForCausalLM."""
        if self.family == QWEN3:
            from tmax_jax.models.qwen3.config import qwen3_to_hf_config

            return qwen3_to_hf_config(self)
        if self.is_moe:
            sizes = {
                "moe_intermediate_size": self.moe_intermediate_size,
                "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
                "num_experts": self.num_experts,
                "num_experts_per_tok": self.num_experts_per_tok,
                "router_aux_loss_coef": self.router_aux_loss_coef,
            }
            if not self.norm_topk_prob:
                raise ConfigError("Qwen3_5MoeForCausalLM always renormalises top-k weights (norm_topk_prob)")
        else:
            sizes = {"intermediate_size": self.intermediate_size}
        return {
            "architectures": ["Qwen3_5MoeForCausalLM" if self.is_moe else "Qwen3_5ForCausalLM"],
            "model_type": MOE_TEXT_MODEL_TYPE if self.is_moe else TEXT_MODEL_TYPE,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            **sizes,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "layer_types": list(self.layer_types),
            "full_attention_interval": self.full_attention_interval,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": self.rope_theta,
                "partial_rotary_factor": self.partial_rotary_factor,
            },
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "attention_dropout": 0.0,
            "hidden_act": self.hidden_act,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
        }


def _dense(**kw: Any) -> Qwen35Config:
    base = dict(vocab_size=248320, head_dim=256, linear_key_head_dim=128, linear_value_head_dim=128)
    base.update(kw)
    return Qwen35Config(**base)


# Published dense shapes (Qwen/Qwen3.5-*), text decoder only.
PRESETS: dict[str, Qwen35Config] = {
    "0.8b": _dense(
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
        eos_token_id=248044,
    ),
    "2b": _dense(
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=24,
        num_attention_heads=8,
        num_key_value_heads=2,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        tie_word_embeddings=True,
        eos_token_id=248044,
    ),
    "4b": _dense(
        hidden_size=2560,
        intermediate_size=9216,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        tie_word_embeddings=True,
        eos_token_id=248044,
    ),
    "9b": _dense(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=32,
        num_attention_heads=16,
        num_key_value_heads=4,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        tie_word_embeddings=False,
        eos_token_id=248044,
    ),
    "27b": _dense(
        hidden_size=5120,
        intermediate_size=17408,
        num_hidden_layers=64,
        num_attention_heads=24,
        num_key_value_heads=4,
        linear_num_key_heads=16,
        linear_num_value_heads=48,
        tie_word_embeddings=False,
        eos_token_id=248044,
    ),
    # Published MoE shapes (Qwen/Qwen3.5-*-A*B), text decoder only: 256 experts, 8 routed per token
    # plus one gated shared expert in every layer, 3 Gated DeltaNet + 1 gated attention per period.
    "35b-a3b": _dense(
        hidden_size=2048,
        intermediate_size=0,
        num_hidden_layers=40,
        num_attention_heads=16,
        num_key_value_heads=2,
        linear_num_key_heads=16,
        linear_num_value_heads=32,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        eos_token_id=248044,
    ),
    "122b-a10b": _dense(
        hidden_size=3072,
        intermediate_size=0,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=2,
        linear_num_key_heads=16,
        linear_num_value_heads=64,
        num_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=1024,
        shared_expert_intermediate_size=1024,
        eos_token_id=248044,
    ),
    # Qwen3 dense (Qwen/Qwen3-8B): full attention with q/k RMSNorm in every layer, full-width RoPE.
    "qwen3-8b": Qwen35Config(
        family=QWEN3,
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        partial_rotary_factor=1.0,
        rope_theta=1_000_000.0,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
        bos_token_id=151643,
        eos_token_id=151645,
    ),
    # A few seconds to compile on a laptop CPU; same structure as the real ones (3 linear + 1 full).
    "tiny": Qwen35Config(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_theta=10_000.0,
    ),
}
# Tiny MoE and Qwen3 shapes for CPU tests and demos: the tiny preset with one thing changed.
PRESETS["tiny-moe"] = dataclasses.replace(
    PRESETS["tiny"],
    intermediate_size=0,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    layer_types=(),
)
PRESETS["tiny-qwen3"] = dataclasses.replace(
    PRESETS["tiny"], family=QWEN3, num_hidden_layers=2, partial_rotary_factor=1.0, layer_types=()
)
