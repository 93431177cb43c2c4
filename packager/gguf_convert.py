"""Converting a GGUF model file to a safetensors checkpoint folder (``pipecast convert-gguf``).

GGUF files are quantized; transformers (with the ``gguf`` package, extra ``convert``) dequantizes them
to a dense model, which is saved once as a Hugging Face safetensors checkpoint that ``pack`` accepts.
"""

import functools
import logging
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packager.errors import CheckpointError, PackageError
from packager.pack import check_output_spares_source, check_replaceable
from pipecast.core.fsutil import atomic_directory
from pipecast.core.progress import NO_PROGRESS, Progress

logger = logging.getLogger(__name__)


@contextmanager
def _without_transformers_bars() -> Iterator[None]:
    """transformers' own tqdm bars off meanwhile ("Writing model shards", "Converting and de-quantizing GGUF
    tensors": ``progress`` is the one bar, and it draws none in pipes and logs), then as they were."""
    from transformers import modeling_gguf_pytorch_utils
    from transformers.utils import logging as transformers_logging

    enabled = transformers_logging.is_progress_bar_enabled()
    transformers_logging.disable_progress_bar()
    # the dequantizing loop calls tqdm itself, past that switch: its module's tqdm is swapped meanwhile
    bar = modeling_gguf_pytorch_utils.tqdm
    modeling_gguf_pytorch_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        modeling_gguf_pytorch_utils.tqdm = bar
        if enabled:
            transformers_logging.enable_progress_bar()


def convert_gguf(gguf: Path, out: Path, *, dtype: str = "bfloat16", overwrite: bool = False,
                 progress: Progress = NO_PROGRESS) -> Path:
    """Dequantize ``gguf`` into the checkpoint folder ``out`` (written atomically); return ``out``.

    An existing ``out`` is replaced only with ``overwrite`` (``--force``), and only if it is a checkpoint folder
    (it holds config.json), an empty folder, a file or a symlink: otherwise :class:`PackageError`, as for an
    ``out`` whose replacement would delete ``gguf`` (its folder, or the file itself).
    ``progress`` gets a bar over the three steps: tokenizer, dequantize, save.
    """
    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise CheckpointError(f"{gguf}: no such GGUF file")
    check_replaceable(out, overwrite=overwrite, marker="config.json", what="a checkpoint folder")
    # --force moves OUT aside and deletes it: OUT the GGUF's own folder would take the GGUF with it
    check_output_spares_source(out, gguf, [gguf], "the GGUF file being converted")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with _without_transformers_bars(), atomic_directory(out, overwrite=overwrite) as tmp:
        folder, name = str(gguf.parent), gguf.name
        logger.info("dequantizing %s to %s", gguf, dtype)
        progress.start(3, f"convert {name}", unit="step")
        try:
            progress.status("tokenizer")
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            progress.advance()
            progress.status(f"dequantize to {dtype}")
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=name, dtype=getattr(torch, dtype),
                quantization_config=GgufConfig(gguf_file=name, dequantize=True))
        except ImportError as exc:  # transformers reads GGUF with the gguf package
            raise PackageError(f"convert-gguf needs the extra 'convert' (pip install 'pipecast[convert]'): "
                               f"{exc}") from None
        except (ValueError, KeyError, OSError) as exc:  # not GGUF, or an architecture transformers cannot read
            raise CheckpointError(f"{gguf}: cannot convert it ({type(exc).__name__}: {exc})") from None
        except (struct.error, IndexError, EOFError) as exc:  # gguf's reader ran past the end of the file
            raise CheckpointError(f"{gguf}: truncated or not a GGUF file ({exc})") from None
        progress.advance()
        progress.status("save")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        progress.advance()
    return out
