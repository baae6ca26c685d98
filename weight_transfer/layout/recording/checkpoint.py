"""The tensors of a safetensors checkpoint directory, read from the file headers only.

vLLM's ``load_weights`` is recorded with the names, shapes and dtypes of the
checkpoint the engine was started from::

    specs = checkpoint_specs("/models/qwen3")   # [TensorSpec(name, shape, dtype), ...]
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from weight_transfer.types import TensorSpec

# safetensors dtype codes -> torch attribute names
_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool"}


def _header(path: Path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def checkpoint_specs(model_dir: str) -> tuple[TensorSpec, ...]:
    """Every tensor of ``model_dir/*.safetensors`` (sorted by name); ValueError if none."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir}: no *.safetensors files; pass the checkpoint's tensors "
                         "in the setup request instead")
    out = {}
    for path in files:
        for name, entry in _header(path).items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ValueError(f"{path.name}: tensor {name} has unsupported dtype "
                                 f"{entry['dtype']}")
            out[name] = TensorSpec(name=name, shape=tuple(entry["shape"]), dtype=dtype)
    return tuple(out[n] for n in sorted(out))
