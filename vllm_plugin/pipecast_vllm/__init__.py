"""pipecast's vLLM plugin: ``vllm serve PACKAGE --load-format pipecast`` loads a pipecast block package from
the node agent's memory as its blocks arrive (README "vLLM").

vLLM calls :func:`register` once in each of its processes (entry point group ``vllm.general_plugins``);
importing this package imports neither vLLM nor torch.
"""

import importlib


def register() -> None:
    """Register the model loader of ``--load-format pipecast``."""
    from vllm.model_executor.model_loader import register_model_loader

    try:  # pipecast's own packages, installed apart with --no-deps
        importlib.import_module("packager")
        importlib.import_module("pipecast")
    except ImportError as exc:
        raise ImportError(f"pipecast-vllm: pipecast is not installed in vLLM's environment ({exc}): `pip install "
                          "--no-deps` the pipecast checkout the node agent runs, then this plugin (README "
                          "\"vLLM\")") from exc

    from .loader import PipecastModelLoader
    from .weights import LOAD_FORMAT

    register_model_loader(LOAD_FORMAT)(PipecastModelLoader)
