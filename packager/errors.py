"""Typed errors of the packager. Each names the file and what is wrong with it."""

from pathlib import Path

from pipecast.core.errors import PipecastError


class PackageError(PipecastError):
    """Base of every packager error: bad input checkpoints and bad packages."""


class CheckpointError(PackageError):
    """The input checkpoint cannot be packed."""


class PickleCheckpointError(CheckpointError):
    """A pickle checkpoint (.bin/.pt/.pth/.ckpt) was offered: loading pickle runs code, so it is refused."""

    def __init__(self, path: Path):
        super().__init__(f"{path}: pickle checkpoints are refused (loading pickle runs arbitrary code); "
                         "convert the model to safetensors first")
        self.path = path


class MissingShardError(CheckpointError):
    """The shard index names a file that is not there."""

    def __init__(self, index: Path, shard: str):
        super().__init__(f"{index}: names shard {shard!r}, which does not exist")
        self.index, self.shard = index, shard


class CheckpointFileError(CheckpointError):
    """A file of the checkpoint folder that is not a regular file inside it (or inside its Hugging Face
    blob store): a symlink leading elsewhere, a FIFO, a device. Packing it would copy whatever it points at
    into the package, so it is refused."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path}: refused: {problem}")
        self.path, self.problem = path, problem


class MlflowSourceError(CheckpointError):
    """A ``models:/`` or ``runs:/`` source that names nothing on the MLflow server, or whose artifacts hold no
    checkpoint folder."""

    def __init__(self, uri: str, problem: str):
        super().__init__(f"{uri}: {problem}")
        self.uri, self.problem = uri, problem


class SafetensorsFormatError(PackageError):
    """A safetensors file (input shard or package block) whose bytes are not a valid safetensors file."""

    def __init__(self, path: Path | str, problem: str):
        super().__init__(f"{path}: invalid safetensors file: {problem}")
        self.path, self.problem = path, problem


class UnplacedTensorsError(CheckpointError):
    """Tensors whose names match no layer, embedding or head pattern: the architecture is not supported."""

    def __init__(self, where: str, names: list[str]):
        shown = ", ".join(names[:20]) + (f" (and {len(names) - 20} more)" if len(names) > 20 else "")
        super().__init__(
            f"{where}: cannot place {len(names)} tensor(s) in a layer, the embeddings or the head: {shown}")
        self.names = names


class ManifestError(PackageError):
    """A manifest that is malformed or inconsistent."""

    def __init__(self, path: Path | str, problem: str):
        super().__init__(f"{path}: invalid manifest: {problem}")
        self.path, self.problem = path, problem


class BlockMismatchError(PackageError):
    """A block file whose size, header or digest disagrees with the manifest."""

    def __init__(self, path: Path | str, problem: str):
        super().__init__(f"{path}: block disagrees with the manifest: {problem}")
        self.path, self.problem = path, problem


class PackageFileError(PackageError):
    """A small file of a package (config.json, generation_config.json, a tokenizer file) that cannot be read,
    disagrees with its manifest entry (size or digest), or does not hold what the runtime reads from it."""

    def __init__(self, path: Path | str, problem: str):
        super().__init__(f"{path}: {problem}")
        self.path, self.problem = path, problem
