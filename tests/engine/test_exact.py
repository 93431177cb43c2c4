"""The engine computes exactly what transformers computes, and binds weights without copying them."""

import importlib
import json

import pytest
import torch

from packager.blockfile import buffer_header, map_file
from packager.pack import pack
from pipecast.engine.architectures import modeling_modules
from pipecast.engine.engine import Engine
from benchmarks.tiny_checkpoints import tiny_config
from pipecast.engine.errors import (
    BlockBindError,
    ModelConfigError,
    ModelLoadError,
    PackageMismatchError,
    UnsupportedModelError,
)
from pipecast.engine.progressive import ProgressiveModel
from pipecast.engine.providers import AgentBlockProvider, PackageFolderProvider
from pipecast.engine.sampling import SamplingParams
from pipecast.engine.weights import EMBED, HEAD, LAYER_STAGES, stage_of
from tests.support import packages
from tests.support.packages import rewrite_unsealed
from tests.support.engine_fixtures import GatedAgent, random_prompt, reference_generate, reference_model, wait_until

CASES = [  # (arch, dtype, config overrides): llama and mistral untied, qwen2 tied with q/k/v biases
    ("llama", "float32", {}),
    ("mistral", "float32", {}),
    ("qwen2", "float32", {}),
    ("llama", "bfloat16", {}),
    ("mistral", "float32", {"sliding_window": 6}),  # prompts and generations run past the window
    ("qwen3", "float32", {}),  # q/k norms, head_dim apart from hidden / heads
    # Gemma 3: scaled tied embeddings, sandwich norms, sliding (window 6) and global layers with their own
    # rotary bases, softcapped logits (benchmarks.tiny_checkpoints)
    ("gemma3_text", "float32", {}),
    ("gemma3_text", "bfloat16", {}),
    ("qwen2", "bfloat16", {}),
    ("mistral", "bfloat16", {"sliding_window": 6}),
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


def test_fp32_prompts_of_different_lengths_decoded_together_get_transformers_greedy_tokens(case):
    """In fp32 a row's tokens do not depend on the rows beside it: shorter rows' keys padded with masked ones, the
    batch's shared matrix products. Not in bf16: there a batch's products round otherwise than one row's (README)."""
    ref, engine, _ = case
    if ref.dtype != torch.float32:
        pytest.skip("bf16 batched decoding is not batch invariant: it may differ from transformers after some tokens")
    prompts = [random_prompt(n, 100 + n) for n in (3, 7, 12, 20, 31, 5)]
    expected = [reference_generate(ref, p, 30) for p in prompts]
    params = SamplingParams(max_tokens=30, stop_token_ids=[ref.generation_config.eos_token_id])
    start = engine.scheduler.steps
    assert [s.result(timeout=60) for s in engine.submit_many(prompts, params)] == expected
    assert engine.scheduler.steps - start < sum(map(len, expected))  # the rows did share decode steps


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


def test_a_config_tying_the_head_to_a_checkpoint_with_its_own_head_equals_transformers(tmp_path):
    """Found in review: a config with tie_word_embeddings over a checkpoint carrying its own lm_head.weight (as
    fine-tunes that untie or resize the vocabulary leave them) bound the embeddings as the head, while transformers
    keeps the checkpoint's head where the two differ: other logits, other tokens, no error."""
    from benchmarks.tiny_checkpoints import make_checkpoint

    ckpt = make_checkpoint("llama", tmp_path / "ckpt", seed=7)  # untied: its own, random lm_head
    config = json.loads((ckpt / "config.json").read_text())
    (ckpt / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    pack(ckpt, tmp_path / "pkg")
    ref = reference_model(ckpt)
    with Engine(PackageFolderProvider(tmp_path / "pkg")).start() as engine:
        ids = torch.tensor([random_prompt(10, 5)])
        with torch.no_grad():
            expected = ref(ids).logits
        assert not torch.equal(ref.lm_head.weight, ref.model.embed_tokens.weight)  # transformers kept them apart
        assert torch.equal(engine.logits(ids, timeout=30), expected)


def test_cpu_parameters_are_views_of_the_block_buffers(case):
    _, engine, _ = case
    engine.wait_loaded(timeout=30)
    # The block files' mappings (the package forgets its own once the tensors are made: they hold them).
    blocks = str(engine.provider.package.root.resolve() / "blocks")
    with open("/proc/self/maps") as maps:
        spans = [tuple(int(end, 16) for end in line.split()[0].split("-")) for line in maps if blocks in line]
    assert spans
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


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text"])
def test_a_streamed_prefill_runs_each_layer_stage_as_its_bytes_arrive(tmp_path, arch):
    """Execute-while-load with the parts Qwen3 and Gemma add (q/k norms with the attention, Gemma's sandwich
    norms with what they norm): the packer streams each stage's tensors together, and the prompt runs each
    stage once its bytes are verified, not waiting for the next, with transformers' tokens."""
    package = packages.tiny_package(tmp_path / "pkg", arch, layers=2, layers_per_block=2, seed=11)
    header = buffer_header(map_file(package.path / package.manifest.blocks[0].file))
    agent = GatedAgent(package.path)
    engine = Engine(AgentBlockProvider(agent, package_id=None, where="gated agent", timeout_s=30)).start()
    try:
        sandwich = engine.model.skeleton.sandwich_norms
        assert sandwich == (arch == "gemma3_text")
        in_bytes = [stage_of(n, sandwich) for n, _ in sorted(header.tensors.items(), key=lambda t: t[1].begin)]
        stages = [part for part in in_bytes if isinstance(part, tuple)]
        assert stages == sorted(stages) and len(set(stages)) == 2 * len(LAYER_STAGES)  # each stage contiguous
        ref = reference_model(package.checkpoint)
        prompt = random_prompt(9, 6)
        params = SamplingParams(max_tokens=12, stop_token_ids=[ref.generation_config.eos_token_id])
        stream = engine.submit(prompt, params)
        prefill = engine.scheduler.prefilling
        for layer, stage in sorted(set(stages)):
            end = max(t.end for n, t in header.tensors.items() if stage_of(n, sandwich) == (layer, stage))
            agent.release_prefix(0, header.data_start + end)
            after = (layer, stage + 1) if stage + 1 < len(LAYER_STAGES) else (layer + 1, 0)
            wait_until(lambda: [(s.next_layer, s.next_stage) for s in prefill] == [after])
        agent.release()
        assert stream.result(timeout=30) == reference_generate(ref, prompt, 12)
    finally:
        engine.close()


def test_unsupported_model_type_is_refused(tmp_path):
    config = {"model_type": "gpt2", "n_layer": 2}
    with pytest.raises(UnsupportedModelError, match=r"^model type 'gpt2' is not supported by the pipecast "
                                                    r"engine \(supported: llama, mistral, qwen2, qwen3, "
                                                    r"gemma3_text\)$"):
        ProgressiveModel(config, dtype=torch.float32)


@pytest.mark.parametrize("change, error", [
    ({"num_attention_heads": 0}, "ZeroDivisionError: integer modulo by zero"),
    ({"rope_scaling": {"rope_type": "bogus"}}, "KeyError: 'bogus'"),
    ({"hidden_size": 65}, r"StrictDataclassClassValidationError: Class validation error for validator "
                          r"'validate_architecture': ValueError: The hidden size \(65\) is not a multiple of the "
                          r"number of attention heads \(4\)\."),
])
def test_a_config_transformers_cannot_build_is_refused_naming_its_error(change, error):
    config = {**tiny_config("llama").to_dict(), **change}
    with pytest.raises(ModelConfigError, match=f"^config.json of model type 'llama' describes no model the engine "
                                               f"can build: {error}$"):
        ProgressiveModel(config, dtype=torch.float32)


@pytest.mark.parametrize("arch, change, problem", [
    ("llama", {"num_hidden_layers": 6}, "config.json has 6 layers but the blocks hold 4"),
    ("llama", {"num_hidden_layers": 3}, "config.json has 3 layers but the blocks hold 4"),
    ("qwen2", {"tie_word_embeddings": False}, r"no block holds 1 of its parameters: \['lm_head.weight'\]"),
])
def test_a_package_whose_blocks_do_not_hold_its_configs_model_is_refused_before_loading(tiny_package, arch,
                                                                                        change, problem):
    """Else loading would never complete (parts no block holds) or fail halfway (layers the model lacks)."""
    pkg = tiny_package(arch).path
    config = json.loads((pkg / "config.json").read_text())
    rewrite_unsealed(pkg / "config.json", json.dumps({**config, **change}))
    with pytest.raises(PackageMismatchError, match=f"^the package from package folder {pkg} does not fit its "
                                                   f"config.json: {problem}$"):
        # verify=False: the edit stands for a package packed so; verified, it is a digest mismatch first
        Engine(PackageFolderProvider(pkg, verify=False))


def test_the_modeling_module_of_every_supported_type_imports():
    """What a serving worker imports before its package arrives (Gemma 3's text model is in gemma3's)."""
    assert "transformers.models.gemma3.modeling_gemma3" in modeling_modules()
    for module in modeling_modules():
        importlib.import_module(module)


@pytest.mark.parametrize("rope, layers", [
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8,
      "original_max_position_embeddings": 16}, None),
    ({"rope_type": "dynamic", "factor": 2.0}, None),
    ({"rope_type": "dynamic", "factor": 2.0}, "full_attention"),  # Gemma 3: one rotary per layer type
])
def test_rotary_variants_following_the_batchs_longest_row_are_refused(rope, layers):
    """transformers picks their frequencies from the batch's largest position: a short request decoded beside one
    past the original context would get the long one's rotary (wrong tokens)."""
    arch = "gemma3_text" if layers else "llama"
    config = tiny_config(arch).to_dict()
    (config["rope_parameters"][layers] if layers else config["rope_parameters"]).update(rope)
    with pytest.raises(UnsupportedModelError, match=f"^model type '{arch}' with rope type '{rope['rope_type']}' "
                                                    f"\\(its frequencies follow a batch's longest row\\) is not "
                                                    f"supported by the pipecast engine"):
        ProgressiveModel(config, dtype=torch.float32)


@pytest.mark.parametrize("config, refused", [
    # Gemma 3 with its vision tower: its text layers are named apart, with image tensors beside them.
    ({"model_type": "gemma3", "text_config": {"num_hidden_layers": 2}}, "'gemma3'"),
    # EmbeddingGemma: an encoder, whose attention the causal masks would cut.
    ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "'gemma3_text' with bidirectional attention"),
])
def test_gemma_variants_that_are_not_causal_text_models_are_refused(config, refused):
    with pytest.raises(UnsupportedModelError, match=f"^model type {refused} is not supported"):
        ProgressiveModel(config, dtype=torch.float32)
