"""Load a local Hugging Face checkpoint directory (Qwen 3.5 dense or MoE, text or VLM layout; Qwen3
dense) into ``Qwen35ForCausalLM``.

Streams one parameter at a time (the stacked slices of one parameter, then its device placement),
so host RAM never holds much more than the largest stacked parameter.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tmax_jax.checkpoints.hf_layout import (
    IGNORED_PREFIXES,
    MTP_PREFIXES,
    TEXT_PREFIX,
    VLM_PREFIX,
    StackedParam,
    all_params,
    mtp_params,
    per_expert_names,
)
from tmax_jax.checkpoints.safetensors_io import SafetensorsFile
from tmax_jax.errors import CheckpointError, ConfigError
from tmax_jax.models.qwen35 import Qwen35Config, Qwen35ForCausalLM
from tmax_jax.models.qwen35.mtp import MultiTokenPredictor

Rules = Mapping[str, str | tuple[str, ...] | None] | Sequence[tuple[str, str | tuple[str, ...] | None]]


def read_hf_config(path: str | Path) -> Qwen35Config:
    path = Path(path)
    cfg_file = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not cfg_file.is_file():
        raise CheckpointError(f"{path}: missing config.json")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: invalid JSON ({e})") from e
    try:
        return Qwen35Config.from_hf_config(raw)
    except ConfigError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e


def _weight_files(path: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {}
        for name, fname in weight_map.items():
            f = path / fname
            if not f.is_file():
                raise CheckpointError(f"{path}: missing file {fname} (listed in {index.name} for {name})")
            files[name] = f
        return files
    shards = sorted(path.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{path}: missing model.safetensors (no *.safetensors files)")
    files = {}
    for f in shards:
        for name in SafetensorsFile(f).keys():
            files[name] = f
    return files


def logical_to_spec(names: Sequence[str | None], rules: Rules | None) -> jax.sharding.PartitionSpec:
    table = dict(rules or {})
    return jax.sharding.PartitionSpec(*(table.get(n) if n is not None else None for n in names))


def _np_dtype(dtype) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


def load_hf(
    path: str | Path,
    dtype="float32",
    *,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules | None = None,
    remat: str = "none",
    kernels: str | None = None,
    attention_kernels: str | None = None,
) -> Qwen35ForCausalLM:
    """``dtype``: compute dtype (and parameter dtype unless ``param_dtype`` is given).

    With ``mesh``, each parameter is placed with ``NamedSharding(mesh, spec)`` where spec maps its
    logical axis names through ``rules`` (names absent from rules are replicated).
    ``kernels`` / ``attention_kernels``: the runtime choices of Qwen35Config (None: its defaults).
    """
    path = Path(path)
    cfg = read_hf_config(path)
    choices = {"kernels": kernels, "attention_kernels": attention_kernels}
    cfg = dataclasses.replace(cfg, **{k: v for k, v in choices.items() if v})
    files = _weight_files(path)
    prefix = VLM_PREFIX if any(n.startswith(VLM_PREFIX) for n in files) else TEXT_PREFIX
    if cfg.tie_word_embeddings and "lm_head.weight" in files:
        # transformers ties only a head the checkpoint lacks (a stored head equal to the embedding
        # gives the same logits untied); a stored head is never dropped.
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    params = all_params(cfg, prefix)

    expected = {n for p in params for n in p.hf_names}
    available, assembled = _with_assembled(
        cfg, expected, {n for n in files if not n.startswith(IGNORED_PREFIXES)}
    )
    missing = sorted(expected - available)
    if missing:
        hint = (
            " (tie_word_embeddings is False: for model_type 'qwen3_5' transformers reads the top-level"
            " value, not text_config's)"
            if "lm_head.weight" in missing
            else ""
        )
        raise CheckpointError(
            f"{path}: missing tensor(s) {missing[:8]}" + (" ..." if len(missing) > 8 else "") + hint
        )
    extra = sorted(available - expected)
    if extra:
        raise CheckpointError(
            f"{path}: unexpected tensor(s) {extra[:8]}" + (" ..." if len(extra) > 8 else "")
        )

    compute_dtype = jnp.dtype(dtype)
    pdtype = jnp.dtype(param_dtype if param_dtype is not None else dtype)
    abstract = nnx.eval_shape(
        lambda: Qwen35ForCausalLM(cfg, dtype=compute_dtype, param_dtype=pdtype, rngs=nnx.Rngs(0), remat=remat)
    )
    return _filled(abstract, params, _tensor_reader(files, assembled), cfg, pdtype, mesh, rules)


def _filled(abstract, params, read, cfg: Qwen35Config, pdtype, mesh, rules):
    """``abstract`` (an ``nnx.eval_shape`` module) with every parameter of ``params`` read from the
    checkpoint, one at a time: on the default device, or with ``mesh`` sharded by the parameter's
    logical axis names through ``rules``."""
    graphdef, state = nnx.split(abstract)
    flat = dict(nnx.to_flat_state(state))
    for p in params:
        var = flat[p.path]
        value = _read_param(p, var.shape, read, cfg, pdtype)
        if mesh is None:
            var.set_value(jax.device_put(value))
        else:
            spec = logical_to_spec(var.get_metadata().get("out_sharding"), rules)
            sharding = jax.sharding.NamedSharding(mesh, spec)
            var.set_value(jax.make_array_from_callback(value.shape, sharding, lambda idx, v=value: v[idx]))
        del value
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def load_mtp(
    path: str | Path,
    dtype="float32",
    *,
    param_dtype=None,
    mesh: jax.sharding.Mesh | None = None,
    rules: Rules | None = None,
) -> MultiTokenPredictor | None:
    """The checkpoint's multi-token-prediction module (``mtp.*`` tensors; the draft model of
    ``Engine(speculative_tokens=...)``), or None when it holds none. Its layer count is the number of
    ``mtp.layers.{i}`` the checkpoint holds. ``mesh`` and ``rules`` place it as ``load_hf`` does."""
    path = Path(path)
    cfg = read_hf_config(path)
    files = _weight_files(path)
    prefix = next((p for p in MTP_PREFIXES if any(n.startswith(p) for n in files)), None)
    if prefix is None:
        return None
    ids = {int(n[len(prefix) + 7 :].split(".")[0]) for n in files if n.startswith(prefix + "layers.")}
    if not ids or ids != set(range(len(ids))):
        raise CheckpointError(f"{path}: MTP layers must be numbered 0..n-1, got {sorted(ids)}")
    params = mtp_params(cfg, prefix, len(ids))
    expected = {n for p in params for n in p.hf_names}
    available, assembled = _with_assembled(cfg, expected, {n for n in files if n.startswith(prefix)})
    missing, extra = sorted(expected - available), sorted(available - expected)
    if missing or extra:
        raise CheckpointError(
            f"{path}: MTP tensors do not match a {len(ids)}-layer MTP module: missing {missing[:8]}, "
            f"unexpected {extra[:8]}"
        )
    pdtype = jnp.dtype(param_dtype if param_dtype is not None else dtype)
    abstract = nnx.eval_shape(
        lambda: MultiTokenPredictor(
            cfg, len(ids), dtype=jnp.dtype(dtype), param_dtype=pdtype, rngs=nnx.Rngs(0)
        )
    )
    return _filled(abstract, params, _tensor_reader(files, assembled), cfg, pdtype, mesh, rules)


def _with_assembled(cfg: Qwen35Config, expected: set[str], available: set[str]):
    """(available names, {fused name: per-expert name groups}): experts stored one tensor per expert
    (the older layout) stand in for the fused 3-D tensors ``expected`` names."""
    assembled: dict[str, list[tuple[str, ...]]] = {}
    for name in expected - available:
        parts = per_expert_names(name, cfg.num_experts) if cfg.is_moe else None
        if parts and all(n in available for group in parts for n in group):
            assembled[name] = parts
    available = (available - {n for parts in assembled.values() for g in parts for n in g}) | set(assembled)
    return available, assembled


def _tensor_reader(files: dict[str, Path], assembled: dict[str, list[tuple[str, ...]]]):
    """``read(name)``: one tensor from the checkpoint's files (each file opened once), a fused expert
    tensor assembled from its per-expert ones ([E, rows, in], each expert's concatenated along rows)."""
    opened: dict[Path, SafetensorsFile] = {}

    def read(name: str) -> np.ndarray:
        if name in assembled:
            return np.stack([np.concatenate([read(n) for n in group], axis=0) for group in assembled[name]])
        f = files[name]
        if f not in opened:
            opened[f] = SafetensorsFile(f)
        return opened[f].get(name)

    return read


def _read_param(p: StackedParam, shape: tuple[int, ...], read, cfg: Qwen35Config, pdtype) -> np.ndarray:
    slice_shape = shape[1:] if p.stacked else shape
    zeros = np.broadcast_to(np.zeros((), np.int8), slice_shape)  # zero-memory proxy for the shape
    hf_shape = p.rule.to_hf(zeros, cfg).shape
    out = np.empty(shape, _np_dtype(pdtype))
    for g, name in enumerate(p.hf_names):
        tensor = read(name)
        if tuple(tensor.shape) != tuple(hf_shape):
            raise CheckpointError(
                f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(hf_shape)}"
            )
        converted = p.rule.to_ours(tensor, cfg)
        if p.stacked:
            out[g] = converted
        else:
            out[...] = converted
    return out
