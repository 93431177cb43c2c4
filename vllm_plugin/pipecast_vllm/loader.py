"""``--load-format pipecast``: vLLM's model loader for a pipecast block package.

vLLM builds the model, then calls :meth:`PipecastModelLoader.load_weights`, which feeds the package's tensors,
block after block as each is verified, to the model's own ``load_weights`` (the same path as vLLM's default
loader, which feeds it the tensors of the checkpoint's safetensors files). With the node agent the blocks come
from its memory as the multicast delivers them, so the load overlaps the transfer; the transfer itself has run
since the scale-up began, during vLLM's own start-up.
"""

from collections.abc import Iterator
from typing import TYPE_CHECKING

from vllm.model_executor.model_loader import BaseModelLoader

from pipecast.core.errors import PipecastError

from .errors import MissingWeightsError
from .weights import LoaderOptions, iter_weights, log, open_blocks

if TYPE_CHECKING:
    import torch
    from torch import nn
    from vllm.config import LoadConfig, ModelConfig


class PipecastModelLoader(BaseModelLoader):
    """Loads a pipecast package (vLLM's model path is the package folder) from the node agent, or from the
    folder itself when no agent can serve it. Options: ``--model-loader-extra-config`` (:class:`LoaderOptions`)."""

    def __init__(self, load_config: "LoadConfig") -> None:
        super().__init__(load_config)
        self.options = LoaderOptions.from_extra_config(load_config.model_loader_extra_config)

    def download_model(self, model_config: "ModelConfig") -> None:
        """Nothing to download: the blocks come from the node agent or the package folder while loading."""

    def get_all_weights(self, model_config: "ModelConfig", model: "nn.Module") -> Iterator[tuple[str, "torch.Tensor"]]:
        """The package's tensors as (checkpoint name, tensor), each block once verified (also what vLLM's
        in-place ``reload_weights`` loads; its ``weights_path`` names another package folder)."""
        return iter_weights(open_blocks(model_config.model, self.options))

    def load_weights(self, model: "nn.Module", model_config: "ModelConfig") -> None:
        """Load every tensor of the package into ``model``; :class:`MissingWeightsError` (a ``ValueError``) if
        parameters are left that DefaultModelLoader would refuse to leave unloaded."""
        last: list[str] = []
        try:
            loaded = model.load_weights(iter_weights(open_blocks(model_config.model, self.options), last))
        except Exception as exc:
            # vLLM's own errors (a tensor name or shape its model class does not take) name no package or block.
            if last and not isinstance(exc, PipecastError):
                exc.add_note(f"pipecast loader: while loading {last[0]} of package {model_config.model}")
            raise
        # DefaultModelLoader's own check, on the models it checks by default (unquantized, reporting what they
        # loaded): the same parameters are exempt (those a quantization method fills after loading).
        if model_config.quantization is None and loaded is not None:
            from vllm.config import LoadConfig
            from vllm.model_executor.model_loader import DefaultModelLoader

            try:
                DefaultModelLoader(LoadConfig()).track_weights_loading(model, loaded)
            except ValueError as exc:
                raise MissingWeightsError(f"pipecast loader: package {model_config.model}: {exc}") from None
        log.info("pipecast loader: %d parameters loaded from package %s", len(loaded or ()), model_config.model)
