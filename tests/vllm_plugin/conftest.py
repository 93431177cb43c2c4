"""The loader plugin without vLLM: a fake ``vllm`` with the few names the plugin uses, and a fake model."""

import importlib
import sys
import types
from dataclasses import dataclass, field

import pytest


class FakeBaseModelLoader:
    """vLLM's ``BaseModelLoader``, as far as the plugin uses it."""

    def __init__(self, load_config) -> None:
        self.load_config = load_config


@dataclass
class FakeLoadConfig:
    load_format: str = "auto"
    model_loader_extra_config: dict = field(default_factory=dict)


class FakeDefaultModelLoader(FakeBaseModelLoader):
    def track_weights_loading(self, model, loaded_weights, quantized: bool = False) -> None:
        """vLLM's check of an unquantized model (without its exemptions for quantization methods)."""
        missing = {name for name, _ in model.named_parameters()} - loaded_weights
        if missing:
            raise ValueError(f"Following weights were not initialized from checkpoint: {missing}")


class FakeModel:
    """A vLLM model as a loader sees it: ``load_weights`` consumes (name, tensor) pairs, keeps a copy of each,
    and returns the names it loaded; ``named_parameters`` names ``parameters``."""

    def __init__(self, parameters) -> None:
        self.parameters = list(parameters)
        self.loaded: dict = {}
        self.order: list[str] = []

    def named_parameters(self):
        return [(name, None) for name in self.parameters]

    def load_weights(self, weights) -> set[str]:
        for name, tensor in weights:
            self.loaded[name] = tensor.clone()
            self.order.append(name)
        return set(self.loaded)


@pytest.fixture
def fake_vllm(monkeypatch):
    """A fake ``vllm`` in ``sys.modules``, and the plugin imported against it (afresh for each test):
    ``.plugin`` is the plugin's package, ``.registry`` the load formats registered."""
    registry = {}

    def register_model_loader(load_format):
        def wrap(cls):
            assert issubclass(cls, FakeBaseModelLoader)
            registry[load_format] = cls
            return cls
        return wrap

    loader_module = types.ModuleType("vllm.model_executor.model_loader")
    loader_module.BaseModelLoader = FakeBaseModelLoader
    loader_module.DefaultModelLoader = FakeDefaultModelLoader
    loader_module.register_model_loader = register_model_loader
    config_module = types.ModuleType("vllm.config")
    config_module.LoadConfig = FakeLoadConfig
    modules = {"vllm": types.ModuleType("vllm"), "vllm.model_executor": types.ModuleType("vllm.model_executor"),
               "vllm.model_executor.model_loader": loader_module, "vllm.config": config_module}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    yield types.SimpleNamespace(plugin=importlib.import_module("vllm_plugin.pipecast_vllm"), registry=registry)
    for name in [n for n in sys.modules if n.startswith("vllm_plugin")]:
        del sys.modules[name]  # bound to this test's fake vllm
