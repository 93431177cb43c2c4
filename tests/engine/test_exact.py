"""The engine computes exactly what transformers computes, and binds weights without copying them."""

import json

import pytest
import torch

from packager.pack import pack
from pipecast.engine.engine import Engine
from pipecast.engine.errors import BlockBindError, ModelLoadError, UnsupportedModelError
from pipecast.engine.progressive import ProgressiveModel
from pipecast.engine.providers import PackageFolderProvider
from pipecast.engine.sampling import SamplingParams
from pipecast.engine.weights import EMBED, HEAD
from tests.support import packages
from tests.support.engine_fixtures import random_prompt, reference_generate, reference_model

CASES = [  # (arch, dtype, config overrides): llama and mistral untied, qwen2 tied with q/k/v biases
    ("llama", "float32", {}),
    ("mistral", "float32", {}),
    ("qwen2", "float32", {}),
    ("llama", "bfloat16", {}),
    ("mistral", "float32", {"sliding_window": 6}),  # prompts and generations run past the window
]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-{c[1]}{'-window' if c[2] else ''}")
def case(request, tmp_path_factory):
    arch, dtype, overrides = request.param
    package = packages.tiny_package(tmp_path_factory.mktemp(arch) / "pkg", arch, dtype=dtype,
                                    seed=CASES.index(request.param), **overrides)
    engine = Engine(PackageFolderProvider(package.path)).start()
    yield reference_model(package.checkpoint), engine, package.path
    engine.close()


def test_logits_equal_transformers(case):
    ref, engine, _ = case
    ids = torch.tensor([random_prompt(11, 1), random_prompt(11, 2)])
    with torch.no_grad():
        expected = ref(ids).logits
    got = engine.logits(ids, timeout=30)
    assert got.dtype == expected.dtype == ref.dtype
    assert torch.equal(got, expected)


def test_greedy_generation_equals_transformers(case):
    ref, engine, _ = case
    prompt = random_prompt(9, 3)
    expected = reference_generate(ref, prompt, 20)
    assert len(set(expected)) > 5  # the model is not degenerate: the comparison means something
    stops = [ref.generation_config.eos_token_id]
    assert engine.generate(prompt, SamplingParams(max_tokens=20, stop_token_ids=stops), timeout=30) == expected


def test_qwen2_sliding_window_layers_equal_transformers(tmp_path):
    """Qwen2 mixing full and sliding-window layers (per-layer masks), prompt longer than the window."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      use_sliding_window=True, sliding_window=6, max_window_layers=2,
                                      initializer_range=0.3)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "ckpt")
    pack(tmp_path / "ckpt", tmp_path / "pkg", layers_per_block=2)
    ref = reference_model(tmp_path / "ckpt")
    with Engine(PackageFolderProvider(tmp_path / "pkg")).start() as engine:
        assert engine.model.skeleton.windows == (None, None, 6, 6)
        ids = torch.tensor([random_prompt(10, 4)])
        with torch.no_grad():
            assert torch.equal(engine.logits(ids, timeout=30), ref(ids).logits)
        params = SamplingParams(max_tokens=16, stop_token_ids=[ref.generation_config.eos_token_id])
        assert engine.generate(ids[0].tolist(), params, timeout=30) == reference_generate(ref, ids[0].tolist(), 16)


def test_cpu_parameters_are_views_of_the_block_buffers(case):
    _, engine, _ = case
    engine.wait_loaded(timeout=30)
    package = engine.provider.package
    spans = []
    for i in range(package.num_blocks):
        base = torch.frombuffer(package.block_buffer(i), dtype=torch.uint8)
        spans.append((base.data_ptr(), base.data_ptr() + base.numel()))
    params = dict(engine.model.skeleton.model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        assert any(lo <= p.data_ptr() < hi for lo, hi in spans), f"{name} was copied out of the block buffer"
    if engine.model.skeleton.tied_embeddings:
        assert params["lm_head.weight"].data_ptr() == params["model.embed_tokens.weight"].data_ptr()


def test_block_with_wrong_shape_is_refused_naming_block_and_tensor(tiny_package):
    pkg = tiny_package(layers_per_block=2).path
    config = json.loads((pkg / "config.json").read_text())
    config["intermediate_size"] = 96  # the package's MLP weights are 128 wide
    provider = PackageFolderProvider(pkg)
    model = ProgressiveModel(config, dtype=torch.float32)
    with pytest.raises(BlockBindError) as err:
        model.bind_block(0, range(0, 2), provider.wait_block(0, timeout=1), provider.origin)
    assert str(err.value) == (f"block 0 from package folder {pkg}: tensor 'model.layers.0.mlp.gate_proj.weight' "
                              "has shape [128, 64] but config.json implies [96, 64]")  # the first in byte order


def test_load_failure_reaches_waiters_as_model_load_error(tiny_package):
    pkg = tiny_package(layers_per_block=2).path
    (pkg / "blocks" / "block-0001.safetensors").write_bytes(b"corrupt")
    with Engine(PackageFolderProvider(pkg)).start() as engine:
        with pytest.raises(ModelLoadError, match="block-0001.safetensors: block disagrees with the manifest"):
            engine.logits(torch.tensor([[1, 2, 3]]), timeout=30)
        assert engine.model.is_ready(EMBED) and not engine.model.is_ready(HEAD)


def test_unsupported_model_type_is_refused(tmp_path):
    config = {"model_type": "gpt2", "n_layer": 2}
    with pytest.raises(UnsupportedModelError, match=r"^model type 'gpt2' is not supported by the pipecast "
                                                    r"engine \(supported: llama, mistral, qwen2\)$"):
        ProgressiveModel(config, dtype=torch.float32)
