"""Typed failures of the loader plugin. They derive from the exception types vLLM's own loaders raise (a
``ValueError`` for a configuration or checkpoint that cannot be used, a ``RuntimeError`` for a failure while
loading) and from pipecast's :class:`PipecastError`; each message names the package, the block and where its
bytes came from (the agent's socket or the block file)."""

from pipecast.core.errors import PipecastError


class LoaderConfigError(PipecastError, ValueError):
    """``--model-loader-extra-config`` that cannot be used, or a model folder that is not a pipecast package."""


class BlockLoadError(PipecastError, RuntimeError):
    """A block whose tensors could not be handed to the model: not verified in time by the agent, or a file
    that disagrees with the manifest (size, digest, header). None of its tensors was handed over."""

    def __init__(self, package_id: str, block: int, source: str, problem: str) -> None:
        super().__init__(f"pipecast loader: block {block} of package {package_id[:12]} from {source}: {problem}")
        self.package_id, self.block, self.source, self.problem = package_id, block, source, problem


class MissingWeightsError(PipecastError, ValueError):
    """Model parameters that no block filled (vLLM's DefaultModelLoader raises a ``ValueError`` then too)."""


class PackageUnavailableError(PipecastError, RuntimeError):
    """Neither the node agent nor the package folder can provide the package's blocks."""
