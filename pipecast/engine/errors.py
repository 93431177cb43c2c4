"""Typed failures of the engine; each message says whose fault the failure was."""

from pipecast.core.errors import PipecastError


class EngineError(PipecastError):
    """Base of every engine failure."""


class UnsupportedModelError(EngineError):
    """The package's model type is not one the engine can run layer by layer (the package's fault)."""

    def __init__(self, model_type: str, supported: tuple[str, ...], qualifier: str = ""):
        """``qualifier`` names what rules out a supported type (e.g. "with bidirectional attention")."""
        super().__init__(f"model type {model_type!r}{' ' + qualifier if qualifier else ''} is not supported by "
                         f"the pipecast engine (supported: {', '.join(supported)})")
        self.model_type = model_type


class ModelConfigError(EngineError):
    """config.json names a supported model type but describes no model transformers can build (the package's
    fault): a zero head count, an unknown rotary type, a hidden size the heads do not divide, ..."""

    def __init__(self, model_type: str, error: Exception):
        # One line whatever transformers wrote (its validation errors span several).
        super().__init__(f"config.json of model type {model_type!r} describes no model the engine can build: "
                         f"{type(error).__name__}: {' '.join(str(error).split())}")
        self.model_type = model_type


class PackageMismatchError(EngineError):
    """The package's blocks do not hold the model its config.json describes (the package's fault): loading it
    could never complete."""

    def __init__(self, origin: str, problem: str):
        super().__init__(f"the package from {origin} does not fit its config.json: {problem}")
        self.origin, self.problem = origin, problem


class BlockBindError(EngineError):
    """A block's tensors do not fit the model built from config.json (the package's fault)."""

    def __init__(self, block: int, origin: str, problem: str):
        super().__init__(f"block {block} from {origin}: {problem}")
        self.block, self.origin, self.problem = block, origin, problem


class BlockWaitTimeout(EngineError, TimeoutError):
    """A block was not available within the wait's timeout (normal while a transfer is in progress)."""

    def __init__(self, block: int, origin: str, timeout_s: float):
        super().__init__(f"block {block} not available from {origin} within {timeout_s:g} s")
        self.block, self.origin, self.timeout_s = block, origin, timeout_s


class BlockStalledError(EngineError):
    """No missing block arrived for too long: the blocks' origin (agent, peer, store) stopped delivering."""

    def __init__(self, blocks: list[int], origin: str, stall_s: float):
        super().__init__(f"blocks {blocks} did not arrive from {origin}: nothing arrived for {stall_s:g} s")
        self.blocks, self.origin, self.stall_s = blocks, origin, stall_s


class ModelLoadError(EngineError):
    """Loading the model failed; requests that needed the missing layers fail with this error."""


class EngineClosedError(EngineError):
    """The engine was closed; it takes no more requests."""

    def __init__(self) -> None:
        super().__init__("the engine is closed")


class EngineFailedError(EngineError):
    """The engine thread stopped on an unexpected error: its requests fail and it takes no more (a bug)."""

    def __init__(self, error: BaseException):
        super().__init__(f"the engine stopped on an unexpected error: {type(error).__name__}: {error}")


class DeviceFaultError(EngineError):
    """Requests failed one after another in their steps, and a one-token probe then failed too: the device (a
    sticky accelerator fault) fails every step, not the requests. The engine takes no more."""

    def __init__(self, failed: int, error: BaseException):
        super().__init__(f"the engine's device fails every step: {failed} requests failed in a row, then a "
                         f"one-token probe failed too: {type(error).__name__}: {error}")
        self.failed, self.error = failed, error


class EngineOverloadedError(EngineError):
    """Too many requests are waiting (the caller should retry later; a server answers 429)."""

    def __init__(self, waiting: int):
        super().__init__(f"the engine is full: {waiting} requests are already waiting")
        self.waiting = waiting


class InvalidRequestError(EngineError):
    """A request the engine cannot run as given (the caller's fault): empty prompt, unknown token, ..."""


class DeviceError(EngineError):
    """The ``device`` or ``dtype`` the engine was asked to run in cannot be had here (the caller's fault): not a
    device, a CUDA device on a host without it, a dtype that is not a floating-point ``torch.dtype``."""

    def __init__(self, argument: str, value: object, problem: str):
        super().__init__(f"{argument}={value!r}: {problem}")
        self.argument, self.value, self.problem = argument, value, problem
