"""A GGUF header read straight from the mapped file, fast enough for a 262k-token vocabulary.

`gguf.GGUFReader` builds numpy views for every element of every array field, which takes
seconds to tens of seconds on a Gemma-sized tokenizer. Here the header is walked once with
`struct` (string arrays decoded in one pass), the architecture is known after the first fields
(`peek_architecture` stops there, so an unsupported model is refused before its vocabulary is
read), and tensors are raw byte views of the mapped file, dequantized by `gguf.quants`.

Layout (GGUF v2/v3): magic b"GGUF", u32 version, u64 tensor count, u64 kv count, the kv pairs
(string key, u32 type, value), the tensor infos (string name, u32 n_dims, u64 dims fastest-first,
u32 type, u64 offset), then the tensor data from the next `general.alignment` boundary.
"""

from __future__ import annotations

import dataclasses
import mmap
import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from jaxspec import validate
from jaxspec.errors import JaxspecError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
            10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class _Field:
    """One metadata value with the `contents()` accessor of gguf's ReaderField."""

    def __init__(self, value):
        self.value = value

    def contents(self):
        v = self.value
        return v.tolist() if isinstance(v, np.ndarray) else v


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order (slowest first): [out, in] for a linear weight
    tensor_type: GGMLQuantizationType
    data: np.ndarray  # the raw bytes, uint8

    def dequantize(self) -> np.ndarray:
        from gguf.quants import dequantize

        rows = int(np.prod(self.shape[:-1], dtype=np.int64))
        return dequantize(self.data.reshape(rows, -1), self.tensor_type).reshape(self.shape)


class GGUFHeader:
    """`fields` (key -> object with `contents()`, as gguf's reader) and `tensors`."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except OSError as e:
            raise JaxspecError(f"cannot read {path} ({e}): check the path") from None
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, ValueError, KeyError, IndexError) as e:
            raise JaxspecError(f"{path} is not a readable GGUF file ({e}): re-download it") from None

    def _parse(self) -> None:
        buf, pos = self._map, 0
        if buf[:4] != b"GGUF":
            raise ValueError("bad magic")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ValueError(f"GGUF version {version}")
        pos = 24
        self.fields: dict[str, _Field] = {}
        for _ in range(n_kv):
            key, pos = _string(buf, pos)
            (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            value, pos = _value(buf, pos, vtype)
            self.fields[key] = _Field(value)
        infos = []
        for _ in range(n_tensors):
            name, pos = _string(buf, pos)
            (n_dims,), pos = struct.unpack_from("<I", buf, pos), pos + 4
            dims = struct.unpack_from(f"<{n_dims}Q", buf, pos)
            pos += 8 * n_dims
            ttype, offset = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            infos.append((name, dims, ttype, offset))
        align = int(self.fields.get("general.alignment", _Field(32)).value)
        start = -(-pos // align) * align
        data = np.frombuffer(buf, dtype=np.uint8)
        self.tensors: list[TensorInfo] = []
        for name, dims, ttype, offset in infos:
            qtype = GGMLQuantizationType(ttype)
            block, size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims, dtype=np.int64))
            nbytes = n // block * size
            begin = start + offset
            if begin + nbytes > len(data):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated?)")
            shape = tuple(int(d) for d in reversed(dims))
            self.tensors.append(TensorInfo(name, shape, qtype, data[begin : begin + nbytes]))


def peek_architecture(path: Path) -> str | None:
    """`general.architecture` from the first metadata fields, reading no arrays (None if the file
    does not declare one before its first array)."""
    validate.regular_file(path, "GGUF file", max_bytes=None)  # a FIFO or device would block here
    try:
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError as e:
        raise JaxspecError(f"cannot read {path} ({e}): check the path") from None
    if head[:4] != b"GGUF":
        raise JaxspecError(f"{path} is not a GGUF file (bad magic): re-download it")
    try:
        (n_kv,) = struct.unpack_from("<Q", head, 16)
        pos = 24
        for _ in range(n_kv):
            key, pos = _string(head, pos)
            (vtype,), pos = struct.unpack_from("<I", head, pos), pos + 4
            if vtype == _ARRAY:
                return None
            value, pos = _value(head, pos, vtype)
            if key == "general.architecture":
                return str(value)
    except (struct.error, UnicodeDecodeError, ValueError):
        return None
    return None


def _string(buf, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    pos += 8
    return bytes(buf[pos : pos + n]).decode("utf-8"), pos + n


def _value(buf, pos: int, vtype: int):
    if vtype in _SCALARS:
        fmt = _SCALARS[vtype]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype == _ARRAY:
        itype, count = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if itype in _NUMPY:
            dt = np.dtype(_NUMPY[itype])
            arr = np.frombuffer(buf, dtype=dt, count=count, offset=pos).copy()
            return arr, pos + count * dt.itemsize
        if itype == _STRING:
            out = []
            unpack = struct.unpack_from
            for _ in range(count):
                (n,) = unpack("<Q", buf, pos)
                pos += 8
                out.append(bytes(buf[pos : pos + n]).decode("utf-8"))
                pos += n
            return out, pos
        items = []
        for _ in range(count):
            v, pos = _value(buf, pos, itype)
            items.append(v)
        return items, pos
    raise ValueError(f"unknown GGUF value type {vtype}")
