"""Zero-copy loading of a bundle's safetensors files through memory maps.

The file is mapped copy-on-write: tensors are views of the mapping (pages are
read on first touch, nothing is copied up front, and nothing a caller does
can write back to the bundle).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import torch

from deepinfer.bundles.manifest import BundleError

# safetensors dtype -> (numpy storage dtype, torch dtype to view it as)
_DTYPES = {
    "F32": (np.float32, torch.float32), "F16": (np.float16, torch.float16), "BF16": (np.int16, torch.bfloat16),
    "U8": (np.uint8, torch.uint8), "I8": (np.int8, torch.int8), "I64": (np.int64, torch.int64),
    "I32": (np.int32, torch.int32), "BOOL": (np.bool_, torch.bool),
    "F8_E4M3": (np.uint8, torch.float8_e4m3fn), "F8_E8M0": (np.uint8, torch.float8_e8m0fnu),
}


def load_mmap(path: Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
    except (OSError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BundleError(f"{path}: unreadable weight file ({e})") from None
    data = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + n)
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        np_dtype, torch_dtype = _DTYPES[entry["dtype"]]
        if end > data.shape[0]:
            raise BundleError(f"{path}: tensor {name} lies past the end of the file (truncated)")
        array = data[start:end].view(np_dtype).reshape(entry["shape"])
        t = torch.from_numpy(array)
        out[name] = t.view(torch_dtype) if t.dtype != torch_dtype else t
    return out
