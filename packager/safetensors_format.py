"""Reading and writing the safetensors container, strictly and without loading tensor data.

Headers are validated before anything is allocated from them (as huggingface/safetensors does): a sane
header length, UTF-8 JSON (no duplicate names, no deep nesting, no non-finite numbers), known dtypes,
shapes that match byte lengths, and data offsets that are sorted, contiguous, non-overlapping and inside
the file. Whatever the bytes, :func:`parse_header` returns a header or raises
:class:`SafetensorsFormatError` (the fuzz tests hold it to that).
"""

import json
import os
import stat
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from packager.errors import PackageError, SafetensorsFormatError
from pipecast.core.strictjson import JSONInputError, describe
from pipecast.core.strictjson import loads as strict_loads

MAX_HEADER_BYTES = 100_000_000
# Every safetensors dtype: its itemsize in bits (sub-byte float formats exist, so sizes are computed in bits) and
# the torch dtype a reader views it as, None where torch has none (no reader loads such a tensor: pack refuses it).
# Names, not torch objects: importing torch takes seconds, and the packager reads headers without it.
_DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "bool"), "U8": (8, "uint8"), "I8": (8, "int8"), "F8_E5M2": (8, "float8_e5m2"),
    "F8_E4M3": (8, "float8_e4m3fn"), "F8_E8M0": (8, "float8_e8m0fnu"), "F4": (4, None),
    "I16": (16, "int16"), "U16": (16, "uint16"), "F16": (16, "float16"), "BF16": (16, "bfloat16"),
    "I32": (32, "int32"), "U32": (32, "uint32"), "F32": (32, "float32"),
    "I64": (64, "int64"), "U64": (64, "uint64"), "F64": (64, "float64"),
}
DTYPE_BITS = {dtype: bits for dtype, (bits, _) in _DTYPES.items()}
TORCH_DTYPES = {dtype: torch_name for dtype, (_, torch_name) in _DTYPES.items() if torch_name is not None}
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor's bytes are, relative to the start of the data section."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class Header:
    """A parsed and validated safetensors header."""

    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int       # file offset of the data section
    data_bytes: int       # length of the data section

    @property
    def file_bytes(self) -> int:
        return self.data_start + self.data_bytes


#: The largest dimension a tensor may have: an int64, what torch and numpy take (huggingface/safetensors refuses a
#: shape whose element count overflows too).
MAX_DIM = 2**63 - 1
#: More elements than this no file holds (offsets are uint64): the product stops there, whatever the shape's length.
_MAX_ELEMENTS = 2**64


def _expected_nbytes(dtype: str, shape: tuple[int, ...]) -> int | None:
    """The bytes a tensor of ``dtype`` and ``shape`` takes; None if it has more elements than any file holds."""
    count = 0 if 0 in shape else 1
    for dim in shape if count else ():
        count *= dim
        if count > _MAX_ELEMENTS:
            return None
    return (DTYPE_BITS[dtype] * count + 7) // 8


def parse_header(prefix: bytes | memoryview, file_bytes: int, where: Path | str) -> Header:
    """Validate the header at the start of a safetensors file of ``file_bytes`` bytes.

    ``prefix`` must hold at least the first 8 + header-length bytes (``read_header`` handles files).
    """
    if file_bytes < 8 or len(prefix) < 8:
        raise SafetensorsFormatError(where, f"file is {file_bytes} bytes, too short for a header length")
    (header_len,) = struct.unpack("<Q", bytes(prefix[:8]))
    if header_len > MAX_HEADER_BYTES:
        raise SafetensorsFormatError(where, f"header length {header_len} exceeds {MAX_HEADER_BYTES}")
    if 8 + header_len > file_bytes:
        raise SafetensorsFormatError(where, f"truncated: header length {header_len} runs past the end "
                                            f"of the {file_bytes}-byte file")
    if len(prefix) < 8 + header_len:
        raise ValueError("prefix shorter than the header")
    try:
        raw = strict_loads(prefix[8:8 + header_len])
    except JSONInputError as exc:
        raise SafetensorsFormatError(where, f"header is not valid UTF-8 JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise SafetensorsFormatError(where, "header is not a JSON object")
    metadata = raw.pop(METADATA_KEY, None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsFormatError(where, "__metadata__ must map strings to strings")
    data_start = 8 + header_len
    data_bytes = file_bytes - data_start
    tensors = {name: _parse_entry(name, entry, where) for name, entry in raw.items()}
    cursor = 0
    for info in sorted(tensors.values(), key=lambda t: (t.begin, t.end)):
        if info.begin < cursor:
            raise SafetensorsFormatError(where, f"tensor {describe(info.name)} overlaps the previous "
                                                f"tensor (offset {info.begin} < {cursor})")
        if info.begin > cursor:
            raise SafetensorsFormatError(where, f"gap before tensor {describe(info.name)} (offset "
                                                f"{info.begin}, expected {cursor})")
        if info.end > data_bytes:
            raise SafetensorsFormatError(where, f"truncated: tensor {describe(info.name)} ends at data "
                                                f"offset {info.end}, past the data section's {data_bytes} "
                                                "bytes")
        cursor = info.end
    if cursor != data_bytes:
        raise SafetensorsFormatError(where, f"{data_bytes - cursor} trailing bytes after the last tensor")
    return Header(tensors=tensors, metadata=dict(metadata), data_start=data_start, data_bytes=data_bytes)


def _parse_entry(name: str, entry: Any, where: Path | str) -> TensorInfo:
    if not isinstance(entry, dict):
        raise SafetensorsFormatError(where, f"entry for {describe(name)} is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise SafetensorsFormatError(where, f"tensor {describe(name)} has unknown dtype {describe(dtype)}")
    if not (isinstance(shape, list) and all(type(d) is int and 0 <= d <= MAX_DIM for d in shape)):
        raise SafetensorsFormatError(where, f"tensor {describe(name)} has an invalid shape {describe(shape)}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0
                                                                      for o in offsets)):
        raise SafetensorsFormatError(where, f"tensor {describe(name)} has invalid data_offsets "
                                            f"{describe(offsets)}")
    begin, end = offsets
    if end < begin:
        raise SafetensorsFormatError(where, f"tensor {describe(name)} has data_offsets {offsets} that end "
                                            "before they begin")
    expected = _expected_nbytes(dtype, tuple(shape))
    if expected is None:
        raise SafetensorsFormatError(where, f"tensor {describe(name)} of shape {describe(shape)} has more "
                                            f"elements than any file holds")
    if end - begin != expected:
        raise SafetensorsFormatError(where, f"tensor {describe(name)}: data_offsets span {end - begin} "
                                            f"bytes but {dtype}{describe(shape)} needs {expected}")
    return TensorInfo(name=name, dtype=dtype, shape=tuple(shape), begin=begin, end=end)


def torch_view_problem(name: str, dtype: str) -> str | None:
    """Why no reader can load tensor ``name`` of ``dtype`` (torch has no such dtype to view it as); None if one can."""
    return None if dtype in TORCH_DTYPES else f"tensor {name!r} has dtype {dtype}, which torch cannot view"


@contextmanager
def open_regular_file(path: Path, refuse: Callable[[Path, str], PackageError]) -> Iterator[tuple[BinaryIO, int]]:
    """``path`` open for reading, with its size, if it is a regular file; else ``refuse(path, "not a regular
    file")`` is raised before any read. O_NONBLOCK: a FIFO under the name does not hang the open, and neither a
    FIFO nor a device (/dev/zero behind a symlink, which never ends) is read. An OSError goes to the caller."""
    with os.fdopen(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise refuse(path, "not a regular file")
        yield f, st.st_size


def read_header(path: Path) -> Header:
    """Read and validate the header of the safetensors file at ``path``."""
    try:
        with open_regular_file(path, SafetensorsFormatError) as (f, size):
            head = f.read(8)
            if len(head) == 8:
                (n,) = struct.unpack("<Q", head)
                if n <= MAX_HEADER_BYTES and 8 + n <= size:
                    head += f.read(n)
    except OSError as exc:
        raise SafetensorsFormatError(path, f"cannot read: {exc.strerror}") from None
    return parse_header(head, size, path)


def build_header(tensors: list[tuple[str, str, tuple[int, ...], int]],
                 metadata: dict[str, str]) -> tuple[bytes, list[TensorInfo]]:
    """Serialize a header for tensors laid out in the given order: (name, dtype, shape, nbytes) each.

    Returns the header bytes (length prefix included, padded with spaces to 8-byte alignment so that
    tensor data stays aligned) and the resulting TensorInfo list. Deterministic for equal input.
    """
    entries: dict[str, Any] = {METADATA_KEY: metadata} if metadata else {}
    infos = []
    cursor = 0
    for name, dtype, shape, nbytes in tensors:
        entries[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [cursor, cursor + nbytes]}
        infos.append(TensorInfo(name, dtype, tuple(shape), cursor, cursor + nbytes))
        cursor += nbytes
    body = json.dumps(entries, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-(len(body) + 8) % 8)
    return struct.pack("<Q", len(body)) + body, infos


def layout_order(dtype: str, name: str) -> tuple[int, str]:
    """Sort key that keeps every tensor aligned to its item size: wide dtypes first, then by name."""
    return (-DTYPE_BITS[dtype], name)
