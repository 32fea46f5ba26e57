"""Minimal safetensors reader/writer on numpy (bfloat16 included, via ml_dtypes).

Reading memory-maps the file, so a tensor costs host RAM only while it is being converted; the
format is the public one (8-byte little-endian header size, JSON header, raw little-endian data).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path

import ml_dtypes
import numpy as np

from tmax_jax.errors import CheckpointError

_DTYPES = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
_CODES = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """Lazy access to the tensors of one ``.safetensors`` file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
        except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{self.path}: not a readable safetensors file ({e})") from e
        self._data_start = 8 + n
        header.pop("__metadata__", None)
        self._entries = header
        self._mmap: np.memmap | None = None

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entries[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        code = entry["dtype"]
        if code not in _DTYPES:
            raise CheckpointError(f"{self.path}: tensor {name!r} has unsupported dtype {code}")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        start, end = entry["data_offsets"]
        raw = self._mmap[self._data_start + start : self._data_start + end]
        return raw.view(_DTYPES[code]).reshape(entry["shape"])


def write_safetensors(path: str | Path, tensors: Iterable[tuple[str, np.ndarray]], metadata=None) -> None:
    """Writes (name, array) pairs; arrays are consumed one at a time."""
    items = [(name, np.ascontiguousarray(arr)) for name, arr in tensors]
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, arr in items:
        if arr.dtype not in _CODES:
            raise CheckpointError(f"cannot write tensor {name!r} of dtype {arr.dtype} to safetensors")
        header[name] = {
            "dtype": _CODES[arr.dtype],
            "shape": list(arr.shape),
            "data_offsets": [offset, offset + arr.nbytes],
        }
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)  # keeps the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for _, arr in items:
            f.write(arr.tobytes())
