"""A GGUF file opened with gguf-py's `GGUFReader` (memory-mapped), every size it declares checked
against the file before anything is read or allocated for it.

A GGUF file (ggml's `docs/gguf.md`): the magic "GGUF", a version, the tensor and metadata counts;
the metadata (key, value type, value; arrays of any type, nested); the tensor table (name, dims
fastest-moving first, ggml type, offset into the data); then the aligned tensor data. The file is
untrusted: `GGUFReader` loops over whatever counts it declares, so `_CheckedReader` refuses a read
past the end of the file and any count whose items could not fit in the bytes left (an array of
2⁶⁰ items, a tensor larger than the file) before the loop starts. Every refusal is a one-line
`DecoderLMError` naming the file.

The file is mapped copy-on-write: tensors are views of the mapping (no copy; pages are read when
first touched), writable without ever writing the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from decoderlm.errors import DecoderLMError
from decoderlm.files import require_file

GGML_MAX_DIMS = 4
_TENSOR_ENTRY_BYTES = (
    8 + 4 + 8 + 4 + 8
)  # a one-dimension entry: name length, n_dims, dim, type, offset
_KV_ENTRY_BYTES = 8 + 4 + 1  # key length, value type, the smallest value
# The fewest bytes one array item of a value type takes: a scalar its width, a string its length
# field, an array its type and count.
_ITEM_BYTES = {
    **{t: np.dtype(d).itemsize for t, d in gguf.GGUFReader.gguf_scalar_to_np.items()},
    gguf.GGUFValueType.STRING: 8,
    gguf.GGUFValueType.ARRAY: 12,
}


class _Refused(Exception):
    """A declared size the file cannot hold (the message says which)."""


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader whose reads stop at the end of the file and whose loops are bounded by it."""

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        """GGUFReader's `_get` on a plain ndarray view of the mapping (slicing the np.memmap
        itself costs most of the time of reading a vocabulary), refusing to read past its end."""
        offset, count = int(offset), int(count)
        end = offset + np.dtype(dtype).itemsize * count
        if count < 0 or end > len(self.data):
            raise _Refused(f"it ends at byte {len(self.data)}, inside data that runs to byte {end}")
        if getattr(self, "_bytes", None) is None or self._bytes.base is not self.data:
            self._bytes = self.data.view(np.ndarray)
        arr = self._bytes[offset:end].view(dtype)[:count]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))

    def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
        if raw_type == gguf.GGUFValueType.ARRAY:
            item_type = int(self._get(orig_offs, np.uint32)[0])
            count = int(self._get(orig_offs + 4, np.uint64)[0])
            least = _ITEM_BYTES.get(item_type, 1)
            self._fits(count * least, orig_offs + 12, f"an array of {count} items")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_fields(self, offs: int, count: int) -> int:
        self._fits(int(count) * _KV_ENTRY_BYTES, offs, f"{int(count)} metadata entries")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs: int, count: int) -> Any:
        self._fits(int(count) * _TENSOR_ENTRY_BYTES, offs, f"{int(count)} tensors")
        end, fields = super()._build_tensor_info(offs, count)
        for field in fields:
            self._check_tensor(field, end)
        return end, fields

    def _check_tensor(self, field: Any, data_start: int) -> None:
        """A tensor's dims, type and bytes within bounds, before GGUFReader maps it."""
        _, name, n_dims, dims, raw_type, offset = field.parts
        name = bytes(name).decode("utf-8", errors="replace")
        if int(n_dims[0]) > GGML_MAX_DIMS:
            raise _Refused(f"tensor {name!r} declares {int(n_dims[0])} dimensions (at most 4)")
        try:
            ggml_type = gguf.GGMLQuantizationType(int(raw_type[0]))
        except ValueError:
            raise _Refused(f"tensor {name!r} has an unknown ggml type {int(raw_type[0])}") from None
        block, nbytes = gguf.GGML_QUANT_SIZES[ggml_type]
        shape = [int(d) for d in dims]
        if shape and shape[0] % block:
            raise _Refused(
                f"tensor {name!r} has rows of {shape[0]}, not a multiple of {ggml_type.name}'s "
                f"block of {block}"
            )
        size = math.prod(shape) // block * nbytes
        self._fits(size, data_start + int(offset[0]), f"tensor {name!r} of {size} bytes")

    def _fits(self, size: int, offset: int, what: str) -> None:
        left = len(self.data) - int(offset)
        if size > left:
            raise _Refused(f"it declares {what} where {max(left, 0)} bytes are left")


@dataclass
class GGUFFile:
    """An open GGUF file: its metadata and its tensors (views of the mapped file) by name."""

    path: Path
    reader: gguf.GGUFReader

    @property
    def architecture(self) -> str:
        return self.require("general.architecture")

    @property
    def tensors(self) -> dict[str, Any]:
        """name → gguf ReaderTensor (`.tensor_type`, `.shape` fastest-moving first, `.data`)."""
        return {t.name: t for t in self.reader.tensors}

    def get(self, key: str, default: Any = None) -> Any:
        """The value of a metadata key (a scalar, a string or a list), `default` if absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except UnicodeDecodeError:
            raise DecoderLMError(f"{self.path}: metadata {key!r} is not valid UTF-8") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise DecoderLMError(f"{self.path} has no metadata {key!r}")
        return value


def open_gguf(path: str | Path) -> GGUFFile:
    """The GGUF file at `path`, or a one-line DecoderLMError saying why it is not one."""
    path = require_file(path)
    if path.stat().st_size == 0:
        raise DecoderLMError(f"{path} is empty, not a GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise DecoderLMError(f"{path} is not a GGUF file: it starts with {magic!r}, not b'GGUF'")
    try:
        reader = _CheckedReader(path, "c")
    except _Refused as exc:
        raise DecoderLMError(f"{path} is truncated or corrupt: {exc}") from None
    except (ValueError, KeyError, OverflowError, UnicodeDecodeError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise DecoderLMError(f"{path} is not a valid GGUF file: {reason}") from None
    return GGUFFile(path, reader)
