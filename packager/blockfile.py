"""Zero-copy access to a block's tensors, from a file (mmap) or any buffer (an agent's shared memory)."""

import mmap
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from packager.errors import SafetensorsFormatError
from packager.safetensors_format import TORCH_DTYPES, Header, parse_header, torch_view_problem

if TYPE_CHECKING:
    import torch


def buffer_header(buf: bytes | bytearray | memoryview | mmap.mmap, where: Path | str = "buffer") -> Header:
    """Validate and return the safetensors header of a whole block held in ``buf``."""
    view = memoryview(buf).cast("B")
    return parse_header(view, len(view), where)


def tensors_from_buffer(buf: bytes | bytearray | memoryview | mmap.mmap, where: Path | str = "buffer",
                        header: Header | None = None, names: Iterable[str] | None = None) -> dict[str, "torch.Tensor"]:
    """Tensors of a block as views of ``buf`` (no copy): the caller keeps ``buf`` alive and unchanged.

    With ``names`` (and the block's ``header``) only those tensors, and ``buf`` may be a prefix of the
    block that holds them.
    """
    import torch

    header = header or buffer_header(buf, where)
    out = {}
    with warnings.catch_warnings():
        # A read-only buffer (bytes, a read-only mmap) is fine: pipecast never writes to weights.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name in header.tensors if names is None else names:
            info = header.tensors[name]
            problem = torch_view_problem(name, info.dtype)
            if problem:  # a block of another packer, or of a pack before it refused such tensors
                raise SafetensorsFormatError(where, problem)
            dtype = getattr(torch, TORCH_DTYPES[info.dtype])
            if info.nbytes == 0:
                out[name] = torch.empty(info.shape, dtype=dtype)
                continue
            flat = torch.frombuffer(buf, dtype=dtype, count=info.nbytes // dtype.itemsize,
                                    offset=header.data_start + info.begin)
            out[name] = flat.view(info.shape)
    return out


def map_file(path: Path) -> mmap.mmap:
    """Map a block file copy-on-write: pages are shared with the page cache and never written back."""
    with path.open("rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
