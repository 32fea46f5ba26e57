"""Write a ``Qwen35ForCausalLM`` as a Hugging Face directory that transformers loads (text layout)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from tmax_jax.checkpoints.hf_layout import MTP_PREFIXES, TEXT_PREFIX, all_params, mtp_params
from tmax_jax.checkpoints.safetensors_io import write_safetensors
from tmax_jax.errors import CheckpointError

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?I?B?)\s*", str(size).upper())
    if not m:
        raise CheckpointError(f"max_shard_size {size!r} is not a size like '5GB' or 1000000")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def save_hf(
    model, out_dir: str | Path, *, max_shard_size: int | str = "5GB", tokenizer=None, mtp=None
) -> Path:
    """Writes safetensors (sharded with an index past ``max_shard_size``), config.json,
    generation_config.json and, when given, the tokenizer (an HF tokenizer or a directory to copy
    from). ``mtp``: a multi-token-prediction module (``load_mtp``) written beside the model as the
    ``mtp.*`` tensors published Qwen 3.5 checkpoints carry (transformers skips them)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    limit = parse_size(max_shard_size)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    modules = [(flat, all_params(cfg, TEXT_PREFIX))]
    if mtp is not None:
        mtp_flat = dict(nnx.to_flat_state(nnx.state(mtp, nnx.Param)))
        modules.append((mtp_flat, mtp_params(cfg, MTP_PREFIXES[0], mtp.num_layers)))

    # Plan shards from shapes alone, then materialise one shard at a time on the host.
    entries = []  # (hf_name, param, its module's flat state, slice index or None, nbytes)
    for tree, params in modules:
        for p in params:
            arr = tree[p.path].get_value()
            per = arr.dtype.itemsize * int(np.prod(arr.shape[1:] if p.stacked else arr.shape))
            for g, name in enumerate(p.hf_names):
                entries.append((name, p, tree, g if p.stacked else None, per))
    shards, cur, cur_size = [], [], 0
    for e in entries:
        if cur and cur_size + e[4] > limit:
            shards.append(cur)
            cur, cur_size = [], 0
        cur.append(e)
        cur_size += e[4]
    if cur:
        shards.append(cur)

    for old in out.glob("model*.safetensors*"):
        old.unlink()
    n = len(shards)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"

        def tensors(shard=shard):
            for name, p, tree, g, _ in shard:
                value = tree[p.path].get_value()
                host = np.asarray(jax.device_get(value if g is None else value[g]))
                yield name, p.rule.to_hf(host, cfg)

        write_safetensors(out / fname, tensors())
        weight_map.update({name: fname for name, *_ in shard})
    if n > 1:
        total = sum(e[4] for e in entries)
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

    hf_cfg = cfg.to_hf_config()
    hf_cfg["dtype"] = (
        str(np.dtype(model.param_dtype)) if model.param_dtype != np.dtype("bfloat16") else "bfloat16"
    )
    (out / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    gen = {
        k: v
        for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id))
        if v is not None
    }
    gen.update({"pad_token_id": cfg.pad_token_id} if cfg.pad_token_id is not None else {})
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))

    if tokenizer is not None:
        if isinstance(tokenizer, (str, Path)):
            src = Path(tokenizer)
            for f in _TOKENIZER_FILES:
                if (src / f).is_file() and (src / f).resolve() != (out / f).resolve():
                    shutil.copy2(src / f, out / f)
        else:
            tokenizer.save_pretrained(str(out))
    return out
