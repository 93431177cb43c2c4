from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Block(_message.Message):
    __slots__ = ("index", "file", "bytes", "layer_start", "layer_end", "tensor_names", "digest", "chunk_bytes", "chunk_digests")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    LAYER_START_FIELD_NUMBER: _ClassVar[int]
    LAYER_END_FIELD_NUMBER: _ClassVar[int]
    TENSOR_NAMES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHUNK_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    file: str
    bytes: int
    layer_start: int
    layer_end: int
    tensor_names: _containers.RepeatedScalarFieldContainer[str]
    digest: str
    chunk_bytes: int
    chunk_digests: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, index: _Optional[int] = ..., file: _Optional[str] = ..., bytes: _Optional[int] = ..., layer_start: _Optional[int] = ..., layer_end: _Optional[int] = ..., tensor_names: _Optional[_Iterable[str]] = ..., digest: _Optional[str] = ..., chunk_bytes: _Optional[int] = ..., chunk_digests: _Optional[_Iterable[str]] = ...) -> None: ...

class PackageFile(_message.Message):
    __slots__ = ("path", "bytes", "digest")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    path: str
    bytes: int
    digest: str
    def __init__(self, path: _Optional[str] = ..., bytes: _Optional[int] = ..., digest: _Optional[str] = ...) -> None: ...

class Manifest(_message.Message):
    __slots__ = ("format_version", "package_id", "model_name", "architecture", "model_type", "dtypes", "num_layers", "tied_embeddings", "digest_algorithm", "total_bytes", "blocks", "files", "source")
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    PACKAGE_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    TIED_EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_ALGORITHM_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    package_id: str
    model_name: str
    architecture: str
    model_type: str
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    num_layers: int
    tied_embeddings: bool
    digest_algorithm: str
    total_bytes: int
    blocks: _containers.RepeatedCompositeFieldContainer[Block]
    files: _containers.RepeatedCompositeFieldContainer[PackageFile]
    source: ModelSource
    def __init__(self, format_version: _Optional[int] = ..., package_id: _Optional[str] = ..., model_name: _Optional[str] = ..., architecture: _Optional[str] = ..., model_type: _Optional[str] = ..., dtypes: _Optional[_Iterable[str]] = ..., num_layers: _Optional[int] = ..., tied_embeddings: _Optional[bool] = ..., digest_algorithm: _Optional[str] = ..., total_bytes: _Optional[int] = ..., blocks: _Optional[_Iterable[_Union[Block, _Mapping]]] = ..., files: _Optional[_Iterable[_Union[PackageFile, _Mapping]]] = ..., source: _Optional[_Union[ModelSource, _Mapping]] = ...) -> None: ...

class ModelSource(_message.Message):
    __slots__ = ("uri", "version", "run_id", "path")
    URI_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    uri: str
    version: str
    run_id: str
    path: str
    def __init__(self, uri: _Optional[str] = ..., version: _Optional[str] = ..., run_id: _Optional[str] = ..., path: _Optional[str] = ...) -> None: ...
