"""Reading a Hugging Face checkpoint folder: config, safetensors shards, and the small files."""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from packager.errors import CheckpointError, MissingShardError, PickleCheckpointError
from packager.safetensors_format import TensorInfo, read_header

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Files copied verbatim into the package: what a serving engine needs besides the weights.
SMALL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",
)


@dataclass(frozen=True)
class SourceTensor:
    """A tensor of the input checkpoint and the file holding it."""

    info: TensorInfo
    path: Path
    data_start: int   # file offset of the shard's data section

    @property
    def file_offset(self) -> int:
        return self.data_start + self.info.begin


@dataclass(frozen=True)
class Checkpoint:
    """A validated input checkpoint: its config and every tensor, not yet read."""

    root: Path
    config: dict
    tensors: dict[str, SourceTensor]
    small_files: tuple[str, ...]

    @property
    def total_bytes(self) -> int:
        return sum(t.info.nbytes for t in self.tensors.values())


def open_checkpoint(src: Path) -> Checkpoint:
    """Validate a checkpoint folder and index its tensors (headers only; no tensor data is read)."""
    if src.is_file():
        if src.suffix in PICKLE_SUFFIXES:
            raise PickleCheckpointError(src)
        raise CheckpointError(f"{src}: expected a checkpoint folder (config.json + safetensors), got a file")
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such checkpoint folder")
    config_path = src / "config.json"
    try:
        config = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{config_path}: missing (a checkpoint folder needs config.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_path}: not valid JSON ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: not a JSON object")
    shards = _shard_files(src)
    tensors: dict[str, SourceTensor] = {}
    for shard in shards:
        header = read_header(shard)
        for name, info in header.tensors.items():
            if name in tensors:
                raise CheckpointError(f"{shard}: tensor {name!r} also appears in {tensors[name].path}")
            tensors[name] = SourceTensor(info=info, path=shard, data_start=header.data_start)
    _check_index_names(src, shards, tensors)
    if not tensors:
        raise CheckpointError(f"{src}: the checkpoint holds no tensors")
    small = tuple(name for name in SMALL_FILES if (src / name).is_file())
    return Checkpoint(root=src, config=config, tensors=tensors, small_files=small)


def _shard_files(src: Path) -> list[Path]:
    index = src / INDEX_FILE
    if index.is_file():
        weight_map = _read_weight_map(index)
        shards = []
        for shard in sorted(set(weight_map.values())):
            path = src / shard
            if Path(shard).is_absolute() or ".." in Path(shard).parts or "/" in shard:
                raise CheckpointError(f"{index}: shard name {shard!r} must be a plain file name in the folder")
            if not path.is_file():
                raise MissingShardError(index, shard)
            shards.append(path)
        return shards
    single = src / SINGLE_FILE
    if single.is_file():
        return [single]
    loose = sorted(src.glob("*.safetensors"))
    if len(loose) == 1:
        return loose
    pickles = sorted(p for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise PickleCheckpointError(pickles[0])
    if loose:
        raise CheckpointError(f"{src}: {len(loose)} safetensors files but no {INDEX_FILE} saying which "
                              "tensor is where")
    raise CheckpointError(f"{src}: no {SINGLE_FILE} or {INDEX_FILE}")


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
        weight_map = data["weight_map"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index}: not a valid shard index ({exc!r})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    return weight_map


def _check_index_names(src: Path, shards: list[Path], tensors: dict[str, SourceTensor]) -> None:
    """Every tensor the index names must be in the shard it names."""
    index = src / INDEX_FILE
    if not index.is_file():
        return
    for name, shard in _read_weight_map(index).items():
        found = tensors.get(name)
        if found is None or found.path.name != shard:
            where = f"in {found.path.name}" if found else "in no shard"
            raise CheckpointError(f"{index}: names tensor {name!r} in {shard}, but it is {where}")
