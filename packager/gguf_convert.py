"""Converting a GGUF model file to a safetensors checkpoint folder (``pipecast convert-gguf``).

GGUF files are quantized; transformers (with the ``gguf`` package, extra ``convert``) dequantizes them
to a dense model, which is saved once as a Hugging Face safetensors checkpoint that ``pack`` accepts.
"""

import logging
from pathlib import Path

from packager.errors import CheckpointError
from pipecast.core.fsutil import atomic_directory

logger = logging.getLogger(__name__)


def convert_gguf(gguf: Path, out: Path, *, dtype: str = "bfloat16") -> Path:
    """Dequantize ``gguf`` into the checkpoint folder ``out`` (written atomically); return ``out``."""
    gguf, out = Path(gguf), Path(out)
    if not gguf.is_file():
        raise CheckpointError(f"{gguf}: no such GGUF file")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with atomic_directory(out, overwrite=True) as tmp:
        folder, name = str(gguf.parent), gguf.name
        logger.info("dequantizing %s to %s", gguf, dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(
            folder, gguf_file=name, dtype=getattr(torch, dtype),
            quantization_config=GgufConfig(gguf_file=name, dequantize=True))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return out
