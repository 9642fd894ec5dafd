"""The safetensors dtype names symgraph reads and writes, and their torch dtypes (one table
for checkpoints, output shards and alignment files)."""
from __future__ import annotations

import torch

__all__ = ["SAFETENSORS_DTYPES", "SAFETENSORS_NAMES"]

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
SAFETENSORS_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}
