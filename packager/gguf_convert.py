"""Converting a GGUF model file to a safetensors checkpoint folder (``pipecast convert-gguf``).

GGUF files are quantized; transformers (with the ``gguf`` package, extra ``convert``) dequantizes them
to a dense model, which is saved once as a Hugging Face safetensors checkpoint that ``pack`` accepts.
"""

import functools
import logging
import os
import re
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from packager.errors import CheckpointError, PackageError
from packager.pack import check_output_parent, check_output_spares_source, check_replaceable
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


@contextmanager
def _gguf_alone(gguf: Path) -> Iterator[str]:
    """A private folder holding only a symlink to ``gguf``, to load from: loaded from the GGUF's own folder,
    transformers takes a tokenizer.json lying beside it over the GGUF's own vocabulary."""
    with tempfile.TemporaryDirectory(prefix="pipecast-gguf-") as folder:
        (Path(folder) / gguf.name).symlink_to(gguf.resolve())
        yield folder


def _check_loaded(gguf: Path, info: dict) -> None:
    """Refuse a model transformers completed itself: a weight the GGUF lacks, or one whose shape its metadata
    contradicts, is filled with random values and only warned about. (A tied weight, lm_head with
    tie_word_embeddings, is not listed as missing: it is the embedding.)"""
    if info["missing_keys"]:
        raise CheckpointError(f"{gguf}: lacks tensors the model needs: {', '.join(sorted(info['missing_keys']))}")
    if info["mismatched_keys"]:
        shapes = ", ".join(f"{name} is {tuple(got)}, its metadata makes it {tuple(want)}"
                           for name, got, want in sorted(info["mismatched_keys"]))
        raise CheckpointError(f"{gguf}: tensor shapes do not match its metadata: {shapes}")


#: A model whose metadata makes it more than this many times the elements its tensors hold is refused before it is
#: built (it could not be whole: what it lacks is named once it is, unless building it is what fails).
MAX_ELEMENTS_OVER_FILE = 2


def _check_sizes(gguf: Path, folder: str, name: str) -> None:
    """Refuse, before any weight is allocated, a GGUF whose metadata makes a model its tensors cannot fill: a block
    count other than the blocks its tensors are of (a damaged count of 200,000 in a 50 KB file took 5 GiB and two
    minutes, then a MemoryError; a count short of its tensors drops layers), or sizes (hidden, feed-forward) that
    make a model of more than :data:`MAX_ELEMENTS_OVER_FILE` times the elements its tensors hold."""
    import torch
    from gguf import GGUFReader
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        reader = GGUFReader(str(gguf))
    except (ValueError, struct.error, IndexError, EOFError, OverflowError) as exc:  # its reader ran past the end
        raise CheckpointError(f"{gguf}: truncated or not a GGUF file ({exc})") from None
    arch = reader.fields["general.architecture"].contents()
    blocks = {int(m.group(1)) for t in reader.tensors if (m := re.match(r"blk\.(\d+)\.", t.name))}
    count = reader.fields.get(f"{arch}.block_count")
    if count is not None and count.contents() != len(blocks):
        raise CheckpointError(f"{gguf}: its metadata gives {count.contents()} blocks ({arch}.block_count), its "
                              f"tensors are of {len(blocks)}")
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):  # shapes only: nothing allocated
        skeleton = AutoModelForCausalLM.from_config(config)
    need = sum(p.numel() for p in skeleton.parameters())  # a tied weight once
    have = sum(int(t.n_elements) for t in reader.tensors)
    if need > MAX_ELEMENTS_OVER_FILE * have:
        raise CheckpointError(f"{gguf}: its metadata makes a model of {need:,} weights, its tensors hold {have:,}")


def _why_not_a_checkpoint(folder: Path) -> str | None:
    """What makes ``folder`` other than a checkpoint folder this command may have written (config.json, the
    weights, no subfolder), or None."""
    if not (folder / "config.json").is_file():
        return "without config.json"
    if not any((folder / name).is_file() for name in ("model.safetensors", "model.safetensors.index.json")):
        return "without model.safetensors"
    sub = next((entry.name for entry in os.scandir(folder) if entry.is_dir(follow_symlinks=False)), None)
    return None if sub is None else f"holding a folder ({sub})"


def _load(gguf: Path, folder: str, dtype: str, progress: Progress):
    """The model and tokenizer of ``gguf`` (its alone in ``folder``), dequantized to ``dtype``; whatever the file
    makes fail is a typed error naming it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    name = gguf.name
    try:
        _check_sizes(gguf, folder, name)
        progress.status("tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        progress.advance()
        progress.status(f"dequantize to {dtype}")
        # ignore_mismatched_sizes: a shape mismatch comes back in the loading info (checked below), where it is
        # named, instead of a RuntimeError pointing at transformers' log
        model, info = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=getattr(torch, dtype),
            quantization_config=GgufConfig(gguf_file=name, dequantize=True), ignore_mismatched_sizes=True,
            output_loading_info=True)
    except PackageError:  # refused by name already (_check_sizes)
        raise
    except ImportError as exc:  # transformers reads GGUF with the gguf package
        raise PackageError(f"convert-gguf needs the extra 'convert' (pip install 'pipecast[convert]'): "
                           f"{exc}") from None
    except NotImplementedError as exc:  # gguf has no dequantizer for some types (Q8_1, Q8_K, ...)
        raise CheckpointError(f"{gguf}: uses a quantization type gguf cannot dequantize ({exc})") from None
    except (ValueError, KeyError, OSError) as exc:  # not GGUF, or an architecture transformers cannot read
        raise CheckpointError(f"{gguf}: cannot convert it ({type(exc).__name__}: {exc})") from None
    except (struct.error, IndexError, EOFError, OverflowError) as exc:  # gguf's reader ran past the end, or a
        # length field too large for a count
        raise CheckpointError(f"{gguf}: truncated or not a GGUF file ({exc})") from None
    except MemoryError:  # the host's shortage, not the file's fault
        raise
    except Exception as exc:  # e.g. the config's own checks on metadata a damaged file holds (heads, sizes)
        raise CheckpointError(f"{gguf}: cannot convert it ({type(exc).__name__}: {exc})") from None
    _check_loaded(gguf, info)
    progress.advance()
    return model, tokenizer


def convert_gguf(gguf: Path, out: Path, *, dtype: str = "bfloat16", overwrite: bool = False,
                 progress: Progress = NO_PROGRESS) -> Path:
    """Dequantize ``gguf`` into the checkpoint folder ``out`` (written atomically); return ``out``.

    An existing ``out`` is replaced only with ``overwrite`` (``--force``), and only if it is a checkpoint folder
    (config.json and model.safetensors, no subfolder), an empty folder, a file or a symlink: otherwise
    :class:`PackageError`, as for an ``out`` whose replacement would delete ``gguf`` (its folder, or the file
    itself), one under a file, or a mount point.
    A GGUF the model cannot be whole from (a tensor missing, a shape its metadata contradicts, a quantization type
    gguf cannot dequantize) is a :class:`CheckpointError`, and leaves no ``out``.
    ``progress`` gets a bar over the three steps: tokenizer, dequantize, save.
    """
    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise CheckpointError(f"{gguf}: no such GGUF file")
    check_replaceable(out, overwrite=overwrite, why_not=_why_not_a_checkpoint, what="a checkpoint folder")
    check_output_parent(out)
    # --force moves OUT aside and deletes it: OUT the GGUF's own folder would take the GGUF with it
    check_output_spares_source(out, gguf, [gguf], "the GGUF file being converted")
    try:
        with (_without_transformers_bars(), _gguf_alone(gguf) as folder,
              atomic_directory(out, overwrite=overwrite, durable=True) as tmp):
            logger.info("dequantizing %s to %s", gguf, dtype)
            progress.start(3, f"convert {gguf.name}", unit="step")
            model, tokenizer = _load(gguf, folder, dtype, progress)
            progress.status("save")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            progress.advance()
    except OSError as exc:  # the GGUF's own are typed in _load: this is the output's (full, read-only, a name too long)
        raise PackageError(f"{out}: cannot write the checkpoint ({exc})") from None
    return out
