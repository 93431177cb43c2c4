"""The library hook, ``pipecast.load``: a model object that is usable before its weights are all in.

``pipecast.load(package)`` returns at once. Blocks are bound in the background (from the node agent's
shared memory when one is reachable, else from the package folder: the unicast fallback, logged as a
warning), and each call blocks only for the layers it needs::

    model = pipecast.load("/models/smollm2-pkg")
    model.generate([1, 2, 3], max_new_tokens=16)      # first layers run while later blocks arrive
    model.progress()                                  # LoadProgress(blocks_present=3, blocks_total=8, ...)
    model.wait_loaded(600)                            # raises ModelLoadError at once if loading failed

This module is named ``loading`` and not ``load`` on purpose: a submodule ``pipecast.load`` would replace the
function ``pipecast.load`` on the package as soon as anything imported it.
"""

import atexit
import functools
import itertools
import logging
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from packager.errors import PackageFileError
from packager.manifest import HEX_DIGEST
from pipecast.core.errors import PipecastError
from pipecast.core.strictjson import JSONInputError, describe, loads_object
from pipecast.engine.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch

    from pipecast.engine.engine import Engine, LoadProgress
    from pipecast.engine.providers import BlockProvider
    from pipecast.engine.sampling import SamplingParams
    from pipecast.engine.streams import TokenStream

logger = logging.getLogger(__name__)

SOURCE_AGENT = "agent"
SOURCE_LOCAL = "local"


class PackageUnavailableError(PipecastError):
    """Neither the node agent nor a local folder can provide the package (the caller's setup)."""


class LoadedModel:
    """A model being loaded or loaded: generate and score now, block only for missing layers."""

    def __init__(self, engine: "Engine", *, origin: str, stop_token_ids: frozenset[int],
                 on_close: Callable[[], None] | None = None):
        self.engine = engine
        self._on_close = on_close
        # Until close(), its engine is closed at exit (_close_open_models), dropped or not: the registry holds the
        # engine, not the model, so that dropping the model still says so below.
        self._key = next(_KEYS)
        _OPEN[self._key] = (engine, on_close)
        # Dropped unclosed, it says so (found in review: after `del model` its engine thread, block mappings and file
        # descriptors stayed for the process's life, unsaid). Not closed then: a stream or the engine taken from it
        # may still be in use. At exit _close_open_models closes it.
        self._unclosed = weakref.finalize(self, _warn_unclosed, engine.provider.manifest.package_id)
        self._unclosed.atexit = False
        self.origin = origin
        """Where blocks come from: ``agent`` (multicast delivery) or ``local`` (the package folder)."""
        self.fully_loaded = engine.fully_loaded
        """A ``threading.Event`` set once every block is bound, never if loading fails: to wait, call
        :meth:`wait_loaded`, which raises the failure at once."""
        self.stop_token_ids = stop_token_ids
        """Tokens that end generation by default (the model's EOS ids)."""

    def progress(self) -> "LoadProgress":
        """Blocks present out of the package's total."""
        return self.engine.progress()

    def wait_loaded(self, timeout: float | None = None) -> None:
        """Block until fully loaded; raise ModelLoadError if loading failed, EngineClosedError if the model was closed
        before, TimeoutError on timeout."""
        self.engine.wait_loaded(timeout)

    def generate(self, input_ids: "Sequence[int] | torch.Tensor", *, max_new_tokens: int = 32,
                 temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None, timeout: float | None = None) -> list[int]:
        """The generated token ids for one prompt (the prompt is not repeated).

        Greedy when ``temperature`` is 0; ends at a stop token (returned last; default: the model's EOS)
        or after ``max_new_tokens``. A request that times out is cancelled.
        """
        params = self._params(max_new_tokens, temperature, top_p, seed, stop_token_ids)
        return self.engine.generate(_one_prompt(input_ids), params, timeout)

    def submit(self, input_ids: "Sequence[int] | torch.Tensor", *, max_new_tokens: int = 32,
               temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None,
               stop_token_ids: Sequence[int] | None = None) -> "TokenStream":
        """Like :meth:`generate` but returns the token stream at once (iterate it, or ``async for``)."""
        params = self._params(max_new_tokens, temperature, top_p, seed, stop_token_ids)
        return self.engine.submit(_one_prompt(input_ids), params)

    def _params(self, max_new_tokens: int, temperature: float, top_p: float, seed: int | None,
                stop_token_ids: Sequence[int] | None) -> "SamplingParams":
        from pipecast.engine.sampling import SamplingParams

        stops = self.stop_token_ids if stop_token_ids is None else stop_token_ids  # SamplingParams checks them
        return SamplingParams(max_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed,
                              stop_token_ids=stops)

    def logits(self, input_ids: "Sequence[int] | torch.Tensor", timeout: float | None = None) -> "torch.Tensor":
        """Logits of every position: [seq, vocab] for one prompt, [batch, seq, vocab] for a 2-D tensor.

        Runs on the calling thread, waiting for each layer just before it is needed (each wait bounded
        by ``timeout`` seconds).
        """
        import torch

        rows = _token_rows(input_ids)  # checked first: converting to torch.long would turn 5.9 into 5 silently
        try:
            ids = torch.as_tensor(rows).to(torch.long)
        except (TypeError, ValueError) as exc:  # ragged rows, ids past int64
            raise InvalidRequestError(f"input_ids are not prompts of token ids of one length: {exc}") from None
        if ids.dim() == 1:
            return self.engine.logits(ids.unsqueeze(0), timeout)[0]
        return self.engine.logits(ids, timeout)

    def close(self) -> None:
        """Stop the engine (requests still running, later ones and :meth:`logits` fail with EngineClosedError; its
        weights are dropped first, so that the agent client can unmap the blocks) and unmap the blocks: the agent
        client ``load`` opened is closed, one given as ``agent=`` (it may serve other models) unmaps this package's
        blocks and stays open. Models still open when the interpreter exits are closed then."""
        _OPEN.pop(self._key, None)
        self._unclosed.detach()
        self.engine.close()
        if self._on_close is not None:
            self._on_close()

    def __enter__(self) -> "LoadedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(package: str | Path, *, agent: str | Path | Any | None = None, device: str = "cpu",
         dtype: "torch.dtype | None" = None, max_batch: int = 16, max_queue: int = 64,
         stall_timeout_s: float = 600.0, agent_timeout_s: float = 10.0, verify: bool = True) -> LoadedModel:
    """Start loading ``package`` (a package folder, or a package id); return a usable model at once.

    ``agent`` is the node agent's local socket (or a connected client); by default the socket set in
    pipecast's settings (``PIPECAST_AGENT_LOCAL_SOCKET``). Without a reachable agent holding the package,
    blocks are read from the package folder, or from the agent's disk cache (``PIPECAST_AGENT_CACHE_DIR``)
    for a package id: the unicast fallback, logged as a warning; a folder that lacks blocks is refused
    (:class:`PackageUnavailableError` naming them). ``dtype`` defaults to the weights' dtype (then CPU parameters
    are views of the block buffers: no copy). ``stall_timeout_s`` bounds how long loading may go without a new
    block before it fails. ``agent_timeout_s`` (0 to 86400 s) is how long the agent may take over each request
    (to hold the package's manifest, to map a block); an agent that does not answer is given up on 5 s
    (``CLIENT_SLACK_S``) later, so a mute agent delays the fallback by ``agent_timeout_s`` + 5 s.
    ``verify`` checks a package folder's blocks and small files (config.json too) against its manifest.
    The arguments are checked first, before the agent is asked (:class:`DeviceError` for ``device`` and
    ``dtype``, :class:`InvalidRequestError` for the others), and the package's EOS ids read before any
    thread starts.
    """
    from pipecast.agent.local_client import MAX_TIMEOUT_S, is_timeout
    from pipecast.core.settings import load_settings
    from pipecast.engine.engine import Engine, check_engine_arguments

    if not isinstance(package, (str, Path)) or not str(package):  # "" would be Path("."): the working directory
        raise InvalidRequestError(f"package must be a package folder or a package id, got {describe(package)}")
    if not isinstance(verify, bool):
        raise InvalidRequestError(f"verify must be True or False, got {describe(verify)}")
    check_engine_arguments(device, dtype, max_batch=max_batch, max_queue=max_queue, stall_timeout_s=stall_timeout_s)
    # The agent client refuses these too, but its error would read as "the agent cannot serve": a silent fallback.
    if not is_timeout(agent_timeout_s):
        raise InvalidRequestError(f"agent_timeout_s must be a number of seconds from 0 to {MAX_TIMEOUT_S:g}, "
                                  f"got {describe(agent_timeout_s)}")
    settings = load_settings()
    agent = agent or settings.agent_local_socket
    if agent is not None and not isinstance(agent, (str, Path)) and not callable(getattr(agent, "manifest", None)):
        raise InvalidRequestError(f"agent must be the path of the agent's local socket or a connected client, got "
                                  f"{describe(agent)} ({type(agent).__name__})")
    folder = local_folder(package, settings.agent_cache_dir)
    if folder is None and not HEX_DIGEST.fullmatch(str(package)):  # found in review: asked of the agent, 10 s later
        raise InvalidRequestError(f"{str(package)!r} is neither a package folder nor a whole package id (64 hex "
                                  "digits, as `pipecast cp availability PREFIX` prints it whole)")
    provider, origin, on_close = _provider(package, folder, agent, agent_timeout_s, verify)
    try:
        # Before the engine starts: a package whose files are bad must not leave its threads running.
        stop_token_ids = default_stop_token_ids(provider)
        engine = Engine(provider, device=device, dtype=dtype, max_batch=max_batch, max_queue=max_queue,
                        stall_timeout_s=stall_timeout_s).start()
    except BaseException:
        if on_close is not None:  # the agent client opened here (nothing else would close it), or a given one's maps
            on_close()
        raise
    logger.info("loading package %s (%d blocks) from %s", provider.manifest.package_id[:12], provider.num_blocks,
                provider.origin)
    return LoadedModel(engine, origin=origin, stop_token_ids=stop_token_ids, on_close=on_close)


#: The engines (and what closes with them) of the models loaded and not closed yet, dropped or not: closed at exit,
#: since an engine's threads still running torch code as the interpreter ends them aborted the process (SIGABRT,
#: exit status 134 in place of the program's own). Not the models themselves: a model dropped mid-load left the
#: weak set of them, and its threads ran into the interpreter's end (found in review: 6 exits in 15 aborted).
_OPEN: "dict[int, tuple[Engine, Callable[[], None] | None]]" = {}
_KEYS = itertools.count()


def _warn_unclosed(package_id: str) -> None:
    logger.warning("a model of package %s was dropped without close(): its engine thread, memory mappings and agent "
                   "connection stay until the process exits; call close(), or load it in a `with` block",
                   package_id[:12])


@atexit.register
def _close_open_models() -> None:
    while _OPEN:
        _, (engine, on_close) = _OPEN.popitem()
        engine.close()
        if on_close is not None:
            on_close()


def local_folder(package: str | Path, cache_dir: Path | None) -> Path | None:
    """The package's folder on this node: ``package`` itself, or its package id in the agent's cache."""
    if Path(package).is_dir():
        return Path(package)
    if cache_dir is not None and (Path(cache_dir) / str(package)).is_dir():
        return Path(cache_dir) / str(package)
    return None


def _provider(package: str | Path, folder: Path | None, agent: Any, timeout_s: float,
              verify: bool) -> tuple["BlockProvider", str, Callable[[], None] | None]:
    """The block provider, where it gets blocks, and what to call as the model closes: close the agent client
    opened here, or unmap the package's blocks from one given (found in review: they stayed mapped, so a long-lived
    client held every package it ever served)."""
    from pipecast.engine.providers import AgentBlockProvider, PackageFolderProvider

    if agent is None:
        reason = "no pipecast agent configured (PIPECAST_AGENT_LOCAL_SOCKET unset)"
    else:
        # A package id as given (a cache folder's manifest is not read: the agent serves it); a folder's, read.
        package_id = _read_package_id(folder) if folder == Path(package) else str(package)
        where = getattr(agent, "socket_path", agent)  # a client given: its socket, not its object's repr
        client = None
        try:
            client = _connect(agent) if isinstance(agent, (str, Path)) else agent
            provider = AgentBlockProvider(client, package_id=package_id, where=str(where), timeout_s=timeout_s)
            if client is not agent:
                return provider, SOURCE_AGENT, client.close
            unmap = getattr(client, "unmap", None)  # a client given may serve other models: this package's blocks go
            if unmap is None:
                return provider, SOURCE_AGENT, None
            return provider, SOURCE_AGENT, functools.partial(unmap, provider.manifest.package_id)
        except (OSError, PipecastError) as exc:
            reason = f"pipecast agent at {where} cannot serve package {package} ({exc})"
            if client is not None and client is not agent:
                client.close()
    if folder is None:
        raise PackageUnavailableError(f"package {package}: {reason}, and it is neither a package folder nor "
                                      "in the agent's disk cache")
    provider = PackageFolderProvider(folder, verify=verify)
    if folder != Path(package) and provider.manifest.package_id != str(package):
        raise PackageUnavailableError(f"package {str(package)[:12]}: the agent's cache folder {folder} holds "
                                      f"package {provider.manifest.package_id[:12]}, not it")
    # A folder lacking blocks (an agent's disk cache it stopped filling) would fail only once loading reached them.
    missing = sorted(set(range(provider.num_blocks)) - provider.present_blocks())
    if missing:
        raise PackageUnavailableError(f"package {package}: {reason}, and the package folder {folder} lacks "
                                      f"{len(missing)} of its {provider.num_blocks} blocks: {missing[:8]}")
    logger.warning("%s: loading %s from the package folder (unicast fallback)", reason, folder)
    return provider, SOURCE_LOCAL, None


def _connect(socket: str | Path) -> Any:
    from pipecast.agent.local_client import LocalAgentClient

    return LocalAgentClient(socket)


def _read_package_id(folder: Path) -> str:
    from packager.manifest import read_manifest

    return read_manifest(folder).package_id


def default_stop_token_ids(provider: "BlockProvider") -> frozenset[int]:
    """The model's EOS ids: generation_config.json's if the package has one, else config.json's.

    :class:`PackageFileError` naming the file if generation_config.json is not a JSON object, or the
    ``eos_token_id`` used is neither a token id nor a list of them.
    """
    eos, where = None, "config.json"
    gen = provider.small_file("generation_config.json")
    if gen is not None:
        try:
            eos = loads_object(gen).get("eos_token_id")
        except JSONInputError as exc:
            raise PackageFileError(f"generation_config.json of the package from {provider.origin}",
                                   f"not a valid JSON object ({exc})") from None
        where = "generation_config.json"
    if eos is None:
        eos, where = provider.config.get("eos_token_id"), "config.json"
    if eos is None:
        return frozenset()
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise PackageFileError(f"{where} of the package from {provider.origin}",
                               f"eos_token_id must be a token id or a list of token ids, got {describe(eos)}")
    return frozenset(ids)


def _one_prompt(input_ids: "Sequence[int] | torch.Tensor") -> list[int]:
    """A prompt as a list of ids, from a list, a 1-D tensor or a [1, seq] tensor; :class:`InvalidRequestError`
    for ids that are not integers."""
    from pipecast.engine.engine import token_ids

    shape = getattr(input_ids, "shape", None)
    if shape is not None and len(shape) == 2:
        if shape[0] != 1:
            raise InvalidRequestError(f"generate takes one prompt, got a batch of {shape[0]} (submit each)")
        input_ids = input_ids[0]
    return token_ids(input_ids)


def _token_rows(input_ids: Any) -> Any:
    """``input_ids`` of :meth:`LoadedModel.logits` once every id is known to be an integer: a tensor or an
    array of an integer dtype as it is, else one prompt or a list of prompts as lists of ints."""
    from pipecast.engine.engine import check_integer_dtype, token_ids

    if hasattr(input_ids, "dtype"):  # a tensor or an array: its dtype says whether it holds integers
        check_integer_dtype(input_ids)
        return input_ids
    if not isinstance(input_ids, Sequence) or isinstance(input_ids, str | bytes | bytearray):
        raise InvalidRequestError(f"input_ids must be token ids, got {type(input_ids).__name__}")
    items = list(input_ids)
    if any(isinstance(item, (list, tuple)) or getattr(item, "ndim", 0) >= 1 for item in items):
        return [token_ids(row) for row in items]
    return token_ids(items)
