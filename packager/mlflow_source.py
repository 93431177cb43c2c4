"""``pipecast pack`` from MLflow (extra ``mlflow``): a Hugging Face checkpoint folder registered as a model
version (``models:/NAME/VERSION``, ``models:/NAME@ALIAS``) or logged as a run's artifacts
(``runs:/RUN_ID/PATH``) on a tracking server, fetched with MLflow's client.

The artifacts are downloaded into a hidden temporary folder beside the package being written (the same
filesystem, which needs room for the package anyway, where /tmp may be small) and removed when the pack
ends, whether it succeeded or not. The checkpoint is the one folder of the artifacts that holds config.json
and ``*.safetensors`` files: their root for a folder logged with ``mlflow.log_artifacts(folder, "model")``,
``model/`` for an ``mlflow.transformers`` model saved with its weights (whose tokenizer files, saved apart in
``components/tokenizer/``, are moved beside the weights so that the package has them). The manifest records
the URI, the version it resolved to and the run (``pipecast.v1.ModelSource``).
"""

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from packager.errors import MlflowSourceError
from pipecast.core.fsutil import locked_folder, sweep_unlocked_folders
from pipecast.core.mlflow_tracking import check_reachable, import_mlflow, server_calls, tracking_uri
from pipecast.v1.manifest_pb2 import ModelSource

logger = logging.getLogger(__name__)

SCHEMES = ("models:/", "runs:/")
FORMS = "models:/NAME/VERSION, models:/NAME@ALIAS or runs:/RUN_ID/PATH"
_MODEL_URI = re.compile(r"models:/(?P<name>[^/@]+)(?:/(?P<version>\d+)|@(?P<alias>[\w-]+))/?")
_RUN_URI = re.compile(r"runs:/(?P<run_id>[^/]+)(?:/(?P<path>.*))?")
# An mlflow.transformers model: MLmodel, the weights in model/, the tokenizer in components/tokenizer/.
_FLAVOR_WEIGHTS, _FLAVOR_TOKENIZER = "model", "components/tokenizer"
_NOT_FOUND = "RESOURCE_DOES_NOT_EXIST"
#: A download's temporary folder in the scratch folder (a killed pack's is swept by the next: fsutil.locked_folder).
DOWNLOAD_PREFIX = ".pipecast-mlflow-"
_LISTED = 10  # artifact files named in a "no checkpoint" error


@dataclass(frozen=True)
class SourceCheckpoint:
    """The checkpoint folder to pack for a SRC, where it was fetched from, and the model name to record
    unless ``--name`` gives one."""

    folder: Path
    source: ModelSource | None  # None: a local folder
    name: str | None            # None: pack's default (packager.pack: config.json's _name_or_path, else ...)


@dataclass(frozen=True)
class _Target:
    """A resolved MLflow source: what to download and what to record."""

    artifact_uri: str
    version: str
    run_id: str
    name: str


def is_mlflow_uri(src: str) -> bool:
    """True if ``src`` names a checkpoint in MLflow rather than a local folder."""
    return src.startswith(SCHEMES)


@contextmanager
def source_checkpoint(src: str, *, scratch: Path, mlflow_uri: str | None = None) -> Iterator[SourceCheckpoint]:
    """The SRC of ``pipecast pack`` as a checkpoint folder, for the duration of the block: a local folder as it
    is, or an MLflow URI fetched from the tracking server ``mlflow_uri`` (default ``$MLFLOW_TRACKING_URI``)
    into a temporary folder in ``scratch``.

    Raises :class:`~packager.errors.MlflowSourceError` for a URI that names nothing or artifacts without a
    checkpoint, and :class:`~pipecast.core.mlflow_tracking.MlflowError` when MLflow is not installed, no
    server is given, the server does not answer within the deadline, or it fails a call.
    """
    if not is_mlflow_uri(src):
        yield SourceCheckpoint(Path(src), None, None)
        return
    model, run = _MODEL_URI.fullmatch(src), _RUN_URI.fullmatch(src)
    if not (model or run):
        raise MlflowSourceError(src, f"not an MLflow URI pipecast packs: expected {FORMS}")
    uri = tracking_uri(mlflow_uri)
    mlflow = import_mlflow()
    check_reachable(uri)
    with server_calls(uri):  # the client refuses some URIs itself (an unknown scheme, a path it cannot use)
        client = mlflow.MlflowClient(uri)  # the registry is the tracking server unless MLFLOW_REGISTRY_URI says
        target = (_resolve_model(client, src, model["name"], model["version"], model["alias"]) if model
                  else _resolve_run(client, src, run["run_id"], (run["path"] or "").strip("/")))
    scratch.mkdir(parents=True, exist_ok=True)
    sweep_unlocked_folders(scratch, DOWNLOAD_PREFIX)
    with locked_folder(scratch, DOWNLOAD_PREFIX) as tmp:
        logger.info("downloading %s (%s) into %s", src, target.artifact_uri, tmp)
        with server_calls(uri):
            root = Path(mlflow.artifacts.download_artifacts(artifact_uri=target.artifact_uri, dst_path=str(tmp),
                                                            tracking_uri=uri))
        folder = find_checkpoint(root, src)
        path = folder.relative_to(root).as_posix()
        yield SourceCheckpoint(folder, ModelSource(uri=src, version=target.version, run_id=target.run_id,
                                                   path="" if path == "." else path), target.name)


def _resolve_model(client, src: str, name: str, version: str | None, alias: str | None) -> _Target:
    """The model version ``src`` names (by number or alias), checked to exist."""
    from mlflow.exceptions import MlflowException

    try:
        found = client.get_model_version(name, version) if version else client.get_model_version_by_alias(name, alias)
    except MlflowException as exc:
        # An unknown version is "does not exist", an unknown alias "invalid parameter": ask for the model to
        # tell an unknown model from an unknown version or alias.
        if exc.error_code not in (_NOT_FOUND, "INVALID_PARAMETER_VALUE"):
            raise
        try:
            client.get_registered_model(name)
        except MlflowException as model_exc:
            if model_exc.error_code == _NOT_FOUND:
                raise MlflowSourceError(src, f"no registered model {name!r}") from None
            raise
        missing = f"version {version}" if version else f"alias {alias!r}"
        raise MlflowSourceError(src, f"registered model {name!r} has no {missing}") from None
    return _Target(client.get_model_version_download_uri(name, found.version), str(found.version),
                   found.run_id or "", name)


def _resolve_run(client, src: str, run_id: str, path: str) -> _Target:
    """The run ``src`` names, checked to exist and to hold artifacts at ``path``."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code == _NOT_FOUND:
            raise MlflowSourceError(src, f"no run {run_id!r}") from None
        raise
    if path and not client.list_artifacts(run_id, path):
        raise MlflowSourceError(src, f"run {run_id} has no artifacts at {path!r}")
    # The run's artifact location, not src: MLflow's downloader refuses a runs:/ URI without a path.
    artifact_uri = run.info.artifact_uri + (f"/{path}" if path else "")
    return _Target(artifact_uri, "", run_id, PurePosixPath(path).name or run_id)


def find_checkpoint(root: Path, src: str) -> Path:
    """The one folder under ``root`` (downloaded artifacts) holding config.json and ``*.safetensors`` files;
    for an ``mlflow.transformers`` model, its tokenizer files are moved into it. :class:`MlflowSourceError`
    when there is none or more than one."""
    folders = sorted({c.parent for c in root.rglob("config.json") if any(c.parent.glob("*.safetensors"))})
    if len(folders) > 1:
        shown = ", ".join(f.relative_to(root).as_posix() for f in folders)
        raise MlflowSourceError(src, f"its artifacts hold {len(folders)} checkpoint folders ({shown}); pack one "
                                     "of them with runs:/RUN_ID/PATH")
    if not folders:
        files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
        listed = ", ".join(files[:_LISTED]) + (f" (and {len(files) - _LISTED} more)" if len(files) > _LISTED else "")
        raise MlflowSourceError(
            src, "no checkpoint in its artifacts: expected a folder holding config.json and *.safetensors files "
                 "(a Hugging Face checkpoint folder logged with mlflow.log_artifacts, or an mlflow.transformers "
                 f"model saved with its weights); the artifacts hold {listed or 'no files'}")
    folder = folders[0]
    tokenizer = root / _FLAVOR_TOKENIZER
    if (root / "MLmodel").is_file() and folder == root / _FLAVOR_WEIGHTS and tokenizer.is_dir():
        for file in tokenizer.iterdir():
            if file.is_file() and not (folder / file.name).exists():
                file.rename(folder / file.name)
    return folder
