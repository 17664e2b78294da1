"""One `.safetensors` file, memory-mapped: its header and each tensor as a numpy view.

Shared by the model loader (`loading.safetensors_dir`) and the published-drafter readers
(`formats.tensors`). bfloat16 tensors come back as `ml_dtypes.bfloat16` arrays.

    f = SafetensorsFile(Path("model.safetensors"))
    f.names()            # tensor names in the header
    f.tensor("lm_head.weight")  # np.ndarray view of the mapped file, no copy
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import ml_dtypes
import numpy as np

from jaxspec.errors import JaxspecError
from jaxspec import validate

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class SafetensorsFile:
    """The header is read on construction; the data is mapped on the first `tensor` call."""

    def __init__(self, file: Path):
        self.file = file
        size = validate.regular_file(file, "safetensors file", max_bytes=None)
        try:
            with open(file, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > min(size - 8, validate.MAX_SAFETENSORS_HEADER):
                    raise ValueError(f"header length {n} exceeds the file")
                header = json.loads(f.read(n), parse_constant=validate._no_constants)
        except (OSError, struct.error, ValueError, UnicodeDecodeError, RecursionError) as e:
            raise JaxspecError(
                f"{file} is not a readable safetensors file ({str(e)[:100]}): re-download it"
            ) from None
        self.offset = 8 + n
        self.header: dict[str, dict] = validate.check_safetensors_header(
            header, size - self.offset, file
        )
        self._mapped = None

    def names(self) -> list[str]:
        return list(self.header)

    def tensor(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info.get("dtype") not in DTYPES:
            raise JaxspecError(
                f"{self.file}: tensor {name} has dtype {info.get('dtype')}, which jaxspec does not "
                f"read: convert it to float32/bfloat16/float16 (int64/bool for index tensors)"
            )
        if self._mapped is None:
            self._mapped = np.memmap(self.file, dtype=np.uint8, mode="r")
        try:
            begin, end = info["data_offsets"]
            raw = self._mapped[self.offset + begin : self.offset + end]
            return raw.view(DTYPES[info["dtype"]]).reshape(info["shape"])
        except (KeyError, TypeError, ValueError) as e:
            raise JaxspecError(
                f"{self.file}: tensor {name} has a damaged header entry ({e}): re-download it"
            ) from None
