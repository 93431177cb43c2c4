"""Reading a Hugging Face checkpoint folder: config, safetensors shards, and the small files.

Only regular files inside the folder are read. A symlink is followed only when it resolves inside the
folder or, for a snapshot of the Hugging Face cache (``<cache>/models--org--name/snapshots/<rev>/``, whose
files are symlinks to ``../../blobs/<digest>``), inside that same repository's ``blobs/``: a
``tokenizer.json`` that leads to ``~/.ssh/id_rsa`` or ``/dev/zero`` is refused with
:class:`CheckpointFileError` naming it, never copied into a package.
"""

import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from packager.errors import CheckpointError, CheckpointFileError, MissingShardError, PickleCheckpointError
from packager.safetensors_format import TensorInfo, read_header
from pipecast.core.strictjson import JSONInputError, loads_object

logger = logging.getLogger(__name__)

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
HUB_REPOSITORY_PREFIX = "models--"  # <cache>/models--org--name/snapshots/<rev>/
# Files copied verbatim into the package: what a serving engine needs besides the weights.
SMALL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
    "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
    "chat_template.jinja", "chat_template.json",
)


#: What a shard changed while it is packed is refused with: the offsets its header gave no longer hold.
CHANGED = ("changed since its header was read (replaced or rewritten while being packed); pack again once it stays "
           "as it is")


def file_identity(st: os.stat_result) -> tuple[int, int, int, int]:
    """What tells a file from its replacement or its rewrite: device, inode, size and modification time."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


@dataclass(frozen=True)
class SourceTensor:
    """A tensor of the input checkpoint and the file holding it."""

    info: TensorInfo
    path: Path
    data_start: int   # file offset of the shard's data section
    identity: tuple[int, ...] = ()  # the shard's file_identity when its header was read

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

    @property
    def files(self) -> list[Path]:
        """Every file of the folder the checkpoint is made of: shards, shard index and small files."""
        index = [self.root / INDEX_FILE] if _uses_index(self.root) else []
        shards = sorted({t.path for t in self.tensors.values()})
        return shards + index + [self.root / name for name in self.small_files]


def open_checkpoint(src: Path) -> Checkpoint:
    """Validate a checkpoint folder and index its tensors (headers only; no tensor data is read)."""
    try:
        is_file, is_dir = src.is_file(), src.is_dir()
    except OSError as exc:  # a name too long, say
        raise CheckpointError(f"{src}: cannot read it ({exc.strerror})") from None
    if is_file:
        if src.suffix in PICKLE_SUFFIXES:
            raise PickleCheckpointError(src)
        raise CheckpointError(f"{src}: expected a checkpoint folder (config.json + safetensors), got a file")
    if not is_dir:
        raise CheckpointError(f"{src}: no such checkpoint folder")
    config_path = src / "config.json"
    if checkpoint_file(src, "config.json") is None:
        raise CheckpointError(f"{config_path}: missing (a checkpoint folder needs config.json)")
    try:
        config = loads_object(read_checkpoint_file(src, "config.json"))
    except JSONInputError as exc:
        raise CheckpointError(f"{config_path}: not a valid JSON object ({exc})") from None
    _check_architectures(config_path, config.get("architectures"))
    shards = _shard_files(src)
    tensors: dict[str, SourceTensor] = {}
    for shard in shards:
        identity = _identity(shard)
        header = read_header(shard)
        if _identity(shard) != identity:
            raise CheckpointFileError(shard, CHANGED)
        for name, info in header.tensors.items():
            if name in tensors:
                raise CheckpointError(f"{shard}: tensor {name!r} also appears in {tensors[name].path}")
            tensors[name] = SourceTensor(info=info, path=shard, data_start=header.data_start, identity=identity)
    _check_index_names(src, shards, tensors)
    if not tensors:
        raise CheckpointError(f"{src}: the checkpoint holds no tensors")
    small = tuple(name for name in SMALL_FILES if checkpoint_file(src, name) is not None)
    return Checkpoint(root=src, config=config, tensors=tensors, small_files=small)


def _identity(path: Path) -> tuple[int, int, int, int]:
    try:
        return file_identity(os.stat(path))
    except OSError as exc:
        raise CheckpointFileError(path, f"cannot read it ({exc.strerror})") from None


def _check_architectures(config_path: Path, archs: object) -> None:
    """The manifest records the first of ``architectures``: absent (or null) or a list of class names."""
    if archs is None or isinstance(archs, list) and all(isinstance(a, str) for a in archs):
        return
    got = (type(archs).__name__ if not isinstance(archs, list)
           else "list holding " + type(next(a for a in archs if not isinstance(a, str))).__name__)
    raise CheckpointError(f"{config_path}: architectures must be a list of strings, got {got}")


def _allowed_roots(src: Path) -> tuple[Path, ...]:
    """Where the files of the checkpoint folder ``src`` may really be (module docstring)."""
    try:
        root = src.resolve(strict=True)
    except (OSError, RuntimeError) as exc:
        raise CheckpointError(f"{src}: cannot resolve the checkpoint folder ({exc})") from None
    repository = _hub_repository(root)
    return (root,) if repository is None else (root, (repository / "blobs").resolve())


def _hub_repository(root: Path) -> Path | None:
    """The ``models--org--name`` folder of ``root`` (resolved) if it is a snapshot of the Hugging Face cache."""
    if root.parent.name == "snapshots" and root.parent.parent.name.startswith(HUB_REPOSITORY_PREFIX):
        return root.parent.parent
    return None


def hub_repo_id(src: Path) -> str | None:
    """The repository id ("org/name", or "name") of the checkpoint folder ``src`` if it is a snapshot of the
    Hugging Face cache, None otherwise: the cache names the folder of "org/name" ``models--org--name``."""
    repository = _hub_repository(src.resolve())
    if repository is None:
        return None
    return repository.name.removeprefix(HUB_REPOSITORY_PREFIX).replace("--", "/") or None


def checkpoint_file(src: Path, name: str) -> Path | None:
    """``src / name`` if it is there, checked to be a regular file inside the folder (module docstring);
    None if there is no such file (a dangling symlink included). Raises :class:`CheckpointFileError` for a
    file that is there but must not be read."""
    path = src / name
    if not os.path.lexists(path):
        return None
    try:
        real = path.resolve(strict=True)
    except FileNotFoundError:
        return None  # a dangling symlink: as good as absent
    except (OSError, RuntimeError) as exc:  # a symlink loop
        raise CheckpointFileError(path, f"cannot resolve it ({exc})") from None
    if not any(real.is_relative_to(root) for root in _allowed_roots(src)):
        raise CheckpointFileError(path, f"it is a symlink to {real}, outside the checkpoint folder"
                                        " (and outside its Hugging Face blob store)")
    try:
        mode = real.stat().st_mode
    except OSError as exc:
        raise CheckpointFileError(path, f"cannot stat it ({exc.strerror})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointFileError(path, "not a regular file")
    return path


def read_checkpoint_file(src: Path, name: str) -> bytes:
    """The bytes of the checkpoint file ``name``, checked as :func:`checkpoint_file` does and checked again
    on the open file (it may have been swapped for something else since)."""
    path = checkpoint_file(src, name)
    if path is None:
        raise CheckpointError(f"{src / name}: missing")
    real = path.resolve()
    try:
        # O_NOFOLLOW: ``real`` has no symlink left in it, unless one was swapped in; O_NONBLOCK: a FIFO
        # swapped in does not hang the open (it is refused just below).
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise CheckpointFileError(path, f"cannot open it ({exc.strerror})") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointFileError(path, "not a regular file")
        try:
            return f.read()
        except OSError as exc:
            raise CheckpointFileError(path, f"cannot read it ({exc.strerror})") from None


def _uses_index(src: Path) -> bool:
    """Whether the shard index says where the tensors are: it is there, and model.safetensors is not (which
    transformers reads first when both are: an index left behind by an earlier sharded save is stale)."""
    return checkpoint_file(src, INDEX_FILE) is not None and checkpoint_file(src, SINGLE_FILE) is None


def _shard_files(src: Path) -> list[Path]:
    index = src / INDEX_FILE
    single = checkpoint_file(src, SINGLE_FILE)
    if single is not None:
        if checkpoint_file(src, INDEX_FILE) is not None:
            logger.info("%s: ignored, as transformers ignores it: %s is there", index, SINGLE_FILE)
        return [single]
    if checkpoint_file(src, INDEX_FILE) is not None:
        weight_map = _read_weight_map(src)
        shards = []
        for shard in sorted(set(weight_map.values())):
            if Path(shard).is_absolute() or ".." in Path(shard).parts or "/" in shard or not shard:
                raise CheckpointError(f"{index}: shard name {shard!r} must be a plain file name in the folder")
            path = checkpoint_file(src, shard)
            if path is None:
                raise MissingShardError(index, shard)
            shards.append(path)
        return shards
    loose = sorted(src.glob("*.safetensors"))
    if len(loose) == 1:
        checked = checkpoint_file(src, loose[0].name)
        if checked is None:
            raise CheckpointError(f"{loose[0]}: a dangling symlink")
        return [checked]
    pickles = sorted(p for p in src.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise PickleCheckpointError(pickles[0])
    if loose:
        raise CheckpointError(f"{src}: {len(loose)} safetensors files but no {INDEX_FILE} saying which "
                              "tensor is where")
    raise CheckpointError(f"{src}: no {SINGLE_FILE} or {INDEX_FILE}")


def _read_weight_map(src: Path) -> dict[str, str]:
    index = src / INDEX_FILE
    try:
        weight_map = loads_object(read_checkpoint_file(src, INDEX_FILE))["weight_map"]
    except (JSONInputError, KeyError) as exc:
        raise CheckpointError(f"{index}: not a valid shard index ({exc!r})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map must map tensor names to shard file names")
    return weight_map


def _check_index_names(src: Path, shards: list[Path], tensors: dict[str, SourceTensor]) -> None:
    """Every tensor the index names must be in the shard it names."""
    index = src / INDEX_FILE
    if not _uses_index(src):
        return
    for name, shard in _read_weight_map(src).items():
        found = tensors.get(name)
        if found is None or found.path.name != shard:
            where = f"in {found.path.name}" if found else "in no shard"
            raise CheckpointError(f"{index}: names tensor {name!r} in {shard}, but it is {where}")
