"""``--load-format pipecast`` without vLLM (a fake ``vllm``, see conftest.py): blocks reach the model in block
order, each once verified; from the node agent's memory as blocks land, else from the package folder (the
unicast fallback, logged); a corrupt block is refused before any of its tensors is handed over; options,
missing parameters and a folder that is not a package fail with their exact messages."""

import asyncio
import errno
import json
import logging
import os
import shutil
import struct
import sys
import threading
from types import SimpleNamespace
from unittest import mock

import pytest
from safetensors.torch import load_file

from packager.manifest import read_manifest
from pipecast.agent.local_client import LocalAgentClient
from tests.support.agent_fixtures import block_file_bytes, land_chunk, local_api_serving, receiving_store
from tests.support.packages import tiny_package
from tests.vllm_plugin.conftest import FakeLoadConfig, FakeModel

CHUNK = 64 << 10


@pytest.fixture
def package(tmp_path):
    """A package of 4 random-byte layers: 4 blocks of several chunks each."""
    return tiny_package(tmp_path / "pkg", layers=4, layer_bytes=150_000, chunk_bytes=CHUNK)


def make_loader(fake_vllm, **extra):
    from vllm_plugin.pipecast_vllm.loader import PipecastModelLoader

    return PipecastModelLoader(FakeLoadConfig("pipecast", extra))


def model_config(folder):
    return SimpleNamespace(model=str(folder), quantization=None)


def every_name(manifest) -> list[str]:
    return [name for block in manifest.blocks for name in block.tensor_names]


def block_of(manifest) -> dict[str, int]:
    return {name: block.index for block in manifest.blocks for name in block.tensor_names}


def assert_loaded_in_block_order(model, package):
    """Every tensor of the package, equal to the checkpoint's, block after block."""
    assert sorted(model.loaded) == sorted(every_name(package.manifest))
    blocks = [block_of(package.manifest)[name] for name in model.order]
    assert blocks == sorted(blocks)
    checkpoint = load_file(package.checkpoint / "model.safetensors")
    assert all(model.loaded[name].equal(checkpoint[name]) for name in model.loaded)


def test_register_adds_the_load_format(fake_vllm):
    fake_vllm.plugin.register()
    from vllm_plugin.pipecast_vllm.loader import PipecastModelLoader

    assert fake_vllm.registry == {"pipecast": PipecastModelLoader}


def test_register_without_pipecast_in_vllms_environment_says_what_to_install(fake_vllm, monkeypatch):
    """Found in review: vLLM died at start-up with a bare ModuleNotFoundError when the --no-deps step was skipped."""
    monkeypatch.setitem(sys.modules, "packager", None)  # as if not installed
    with pytest.raises(ImportError, match=r"^pipecast-vllm: pipecast is not installed in vLLM's environment \("):
        fake_vllm.plugin.register()
    assert fake_vllm.registry == {}


def test_without_an_agent_the_folder_is_loaded_in_block_order_and_the_fallback_logged(
        fake_vllm, package, no_configured_agent, caplog):
    model = FakeModel(every_name(package.manifest))
    with caplog.at_level(logging.INFO, logger="vllm.pipecast"):
        make_loader(fake_vllm).load_weights(model, model_config(package.path))
    assert_loaded_in_block_order(model, package)
    assert (f"no pipecast agent configured (agent_socket, PIPECAST_AGENT_LOCAL_SOCKET unset): loading "
            f"{package.path} from the package folder (unicast fallback)") in caplog.messages
    assert (f"loading package {package.manifest.package_id[:12]} (tiny-llama, 4 blocks) from package folder "
            f"{package.path}") in caplog.messages


@pytest.mark.parametrize("configured", ["extra config", "environment"])
def test_an_agent_that_is_not_there_falls_back_to_the_folder(configured, fake_vllm, package, tmp_path, monkeypatch,
                                                            no_configured_agent, caplog):
    socket = tmp_path / "none.sock"
    extra = {"agent_socket": str(socket)} if configured == "extra config" else {}
    if configured == "environment":
        monkeypatch.setenv("PIPECAST_AGENT_LOCAL_SOCKET", str(socket))
    model = FakeModel(every_name(package.manifest))
    make_loader(fake_vllm, **extra).load_weights(model, model_config(package.path))
    assert_loaded_in_block_order(model, package)
    assert (f"pipecast agent at {socket} cannot serve package {package.manifest.package_id[:12]} (no agent at "
            f"{socket} (No such file or directory)): loading {package.path} from the package folder (unicast "
            "fallback)") in caplog.messages


def test_a_corrupt_block_is_refused_before_any_of_its_tensors_is_handed_over(fake_vllm, package, no_configured_agent):
    block = package.manifest.blocks[2]
    path = package.path / block.file
    data = bytearray(path.read_bytes())
    data[CHUNK + 5] ^= 0x01  # in chunk 1
    path.write_bytes(bytes(data))
    model = FakeModel(every_name(package.manifest))
    from vllm_plugin.pipecast_vllm.errors import BlockLoadError

    with pytest.raises(BlockLoadError) as caught:
        make_loader(fake_vllm).load_weights(model, model_config(package.path))
    assert str(caught.value) == (f"pipecast loader: block 2 of package {package.manifest.package_id[:12]} from "
                                 f"{path}: chunk 1 digest mismatch (bytes {CHUNK}-{2 * CHUNK - 1})")
    assert isinstance(caught.value, RuntimeError)
    assert {block_of(package.manifest)[name] for name in model.order} == {0, 1}  # nothing of block 2


async def test_through_the_agent_each_block_is_handed_over_once_verified_in_block_order(
        fake_vllm, package, tmp_path, caplog):
    """The agent receives the blocks out of order (3, 0, 2, 1), chunk by chunk: the model gets block 0 when it
    is verified, waits for block 1 although 2 and 3 are there, then gets 1, 2, 3. The folder given to vLLM is
    what ``pipecast-vllm-folder`` writes from the agent: manifest and small files, no block."""
    from vllm_plugin.pipecast_vllm.folder import write_package_folder

    manifest, socket = package.manifest, tmp_path / "agent.sock"
    store = receiving_store(manifest)
    store.add_file("config.json", (package.path / "config.json").read_bytes(), "test")
    model = FakeModel(every_name(manifest))

    def handed_over() -> set[int]:
        return {block_of(manifest)[name] for name in model.order}

    def land(block: int, chunks: range) -> None:
        data = block_file_bytes(package.path, manifest, block)
        for chunk in chunks:
            land_chunk(store, data, block, chunk)

    async def settle() -> None:
        await asyncio.sleep(0.3)  # time enough for the loader to take what it may

    try:
        async with local_api_serving(store, socket):
            with LocalAgentClient(socket) as client:
                folder = tmp_path / "model"
                await asyncio.to_thread(write_package_folder, client, manifest.package_id, folder, 5.0)
            assert sorted(p.name for p in folder.iterdir()) == ["config.json", "manifest.json"]
            assert read_manifest(folder) == manifest
            loader = make_loader(fake_vllm, agent_socket=str(socket), block_timeout_s=30)
            with caplog.at_level(logging.INFO, logger="vllm.pipecast"):
                loading = asyncio.ensure_future(asyncio.to_thread(loader.load_weights, model, model_config(folder)))
                land(3, range(store.chunk_count(3)))
                land(0, range(store.chunk_count(0) - 1))
                await settle()
                assert handed_over() == set()  # block 0 lacks a chunk
                land(0, range(store.chunk_count(0) - 1, store.chunk_count(0)))
                land(2, range(store.chunk_count(2)))
                await settle()
                assert handed_over() == {0}  # block 1 next, though 2 and 3 are verified
                land(1, range(store.chunk_count(1)))
                await asyncio.wait_for(loading, 10)
    finally:
        store.close()
    assert_loaded_in_block_order(model, package)
    assert (f"loading package {manifest.package_id[:12]} (tiny-llama, 4 blocks) from agent at {socket}"
            in caplog.messages)
    assert not any("unicast fallback" in m for m in caplog.messages)


async def test_a_block_the_agent_does_not_verify_in_time_is_named(fake_vllm, package, tmp_path):
    store = receiving_store(package.manifest)
    land_chunk(store, block_file_bytes(package.path, package.manifest, 0), 0, 0)
    socket = tmp_path / "agent.sock"
    from vllm_plugin.pipecast_vllm.errors import BlockLoadError

    try:
        async with local_api_serving(store, socket):
            loader = make_loader(fake_vllm, agent_socket=str(socket), block_timeout_s=0.2)
            with pytest.raises(BlockLoadError) as caught:
                await asyncio.to_thread(loader.load_weights, FakeModel([]), model_config(package.path))
    finally:
        store.close()
    chunks = len(package.manifest.blocks[0].chunk_digests)
    assert str(caught.value) == (f"pipecast loader: block 0 of package {package.manifest.package_id[:12]} from agent "
                                 f"at {socket}: not verified, and no new byte of the package verified for 0.2 s (the "
                                 f"agent holds 1 of its {chunks} chunks)")


async def test_a_block_waits_as_long_as_the_agent_verifies_other_bytes_of_the_package(fake_vllm, package, tmp_path):
    """block_timeout_s bounds a stall, not a block's wait: vLLM's own limit (VLLM_ENGINE_READY_TIMEOUT_S) is on
    its whole start-up, so a per-block wait as long as it could never end with the loader's own error."""
    from vllm_plugin.pipecast_vllm.weights import LoaderOptions

    manifest, socket = package.manifest, tmp_path / "agent.sock"
    store = receiving_store(manifest)
    model = FakeModel(every_name(manifest))
    try:
        async with local_api_serving(store, socket):
            loader = make_loader(fake_vllm, agent_socket=str(socket), block_timeout_s=0.5)
            loading = asyncio.ensure_future(asyncio.to_thread(loader.load_weights, model, model_config(package.path)))
            # Block 1 comes last, 0.9 s after block 0 (nearly twice block_timeout_s), the others' chunks meanwhile.
            for block in (0, 3, 2, 1):
                data = block_file_bytes(package.path, manifest, block)
                for chunk in range(store.chunk_count(block)):
                    land_chunk(store, data, block, chunk)
                    await asyncio.sleep(0.1)
            await asyncio.wait_for(loading, 10)
    finally:
        store.close()
    assert_loaded_in_block_order(model, package)
    assert LoaderOptions().block_timeout_s < 600  # by default a stall ends with this loader's error, not vLLM's


async def test_a_package_the_agent_drops_between_blocks_fails_at_once_saying_so(fake_vllm, package, tmp_path):
    """Dropped while the model copies block 0: the wait for block 1 fails at once, not after the agent held its
    buffer request (30 s), and not as a block "not verified"."""
    manifest, socket = package.manifest, tmp_path / "agent.sock"
    store = receiving_store(manifest)
    for block in manifest.blocks:
        data = block_file_bytes(package.path, manifest, block.index)
        for chunk in range(store.chunk_count(block.index)):
            land_chunk(store, data, block.index, chunk)
    first, go_on = threading.Event(), threading.Event()

    class SlowModel(FakeModel):
        def load_weights(self, weights):
            for name, tensor in weights:
                self.loaded[name] = tensor.clone()
                if not self.order:
                    first.set()
                    go_on.wait(10)
                self.order.append(name)
            return set(self.loaded)

    from vllm_plugin.pipecast_vllm.errors import BlockLoadError

    try:
        async with local_api_serving(store, socket) as server:
            loader = make_loader(fake_vllm, agent_socket=str(socket))
            loading = asyncio.ensure_future(asyncio.to_thread(loader.load_weights, SlowModel(every_name(manifest)),
                                                              model_config(package.path)))
            assert await asyncio.to_thread(first.wait, 10)
            server._peer_server.stores.pop(manifest.package_id)  # as AgentDaemon.drop_package does
            server.publish_dropped(manifest.package_id)
            await asyncio.sleep(0.3)  # the loader's client hears of it
            go_on.set()
            with pytest.raises(BlockLoadError) as caught:
                await asyncio.wait_for(loading, 5)
    finally:
        go_on.set()
        store.close()
    assert str(caught.value) == (f"pipecast loader: block 1 of package {manifest.package_id[:12]} from agent at "
                                 f"{socket}: package {manifest.package_id[:12]} was dropped there (block 1 not "
                                 "verified)")


def f4_package(tmp_path):
    """A package whose block holds a tensor of dtype F4 (packed fp4), which torch cannot view: packed as by a
    packager that does not refuse it (pipecast's does), or by another tool."""
    from packager.pack import pack

    checkpoint = tmp_path / "f4-checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                        "num_hidden_layers": 1}))
    header = json.dumps({"model.layers.0.mlp.weight": {"dtype": "F4", "shape": [4, 8], "data_offsets": [0, 16]},
                         "model.embed_tokens.weight": {"dtype": "BF16", "shape": [4, 4], "data_offsets": [16, 48]}})
    header += " " * (-len(header) % 8)
    (checkpoint / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header.encode() + bytes(48))
    with mock.patch("packager.pack._check_loadable"):
        pack(checkpoint, tmp_path / "f4")
    return tmp_path / "f4"


F4_PROBLEM = "tensor 'model.layers.0.mlp.weight' has dtype F4, which torch cannot view"


def test_a_block_torch_cannot_view_is_a_block_load_error(fake_vllm, tmp_path, no_configured_agent):
    from vllm_plugin.pipecast_vllm.errors import BlockLoadError

    folder = f4_package(tmp_path)
    manifest = read_manifest(folder)
    path = folder / manifest.blocks[0].file
    with pytest.raises(BlockLoadError) as caught:
        make_loader(fake_vllm).load_weights(FakeModel([]), model_config(folder))
    assert str(caught.value) == (f"pipecast loader: block 0 of package {manifest.package_id[:12]} from {path}: "
                                 f"{F4_PROBLEM}")


async def test_a_block_torch_cannot_view_from_the_agent_is_a_block_load_error(fake_vllm, tmp_path):
    from vllm_plugin.pipecast_vllm.errors import BlockLoadError

    folder = f4_package(tmp_path)
    manifest, socket = read_manifest(folder), tmp_path / "agent.sock"
    store = receiving_store(manifest)
    land_chunk(store, (folder / manifest.blocks[0].file).read_bytes(), 0, 0)
    try:
        async with local_api_serving(store, socket):
            loader = make_loader(fake_vllm, agent_socket=str(socket))
            with pytest.raises(BlockLoadError) as caught:
                await asyncio.to_thread(loader.load_weights, FakeModel([]), model_config(folder))
    finally:
        store.close()
    assert str(caught.value) == (f"pipecast loader: block 0 of package {manifest.package_id[:12]} from agent at "
                                 f"{socket}: {F4_PROBLEM}")


def test_a_block_file_that_cannot_be_read_is_a_block_load_error(fake_vllm, package, monkeypatch, no_configured_agent):
    """Its size is right, opening it is refused (a file of another user: this test may run as root, which
    reads any file, so the refusal is the mapping's)."""
    from packager import package as package_module
    from vllm_plugin.pipecast_vllm.errors import BlockLoadError

    def refuse(path):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(package_module, "map_file", refuse)
    path = package.path / package.manifest.blocks[0].file
    with pytest.raises(BlockLoadError) as caught:
        make_loader(fake_vllm).load_weights(FakeModel([]), model_config(package.path))
    assert str(caught.value) == (f"pipecast loader: block 0 of package {package.manifest.package_id[:12]} from "
                                 f"{path}: cannot read (Permission denied)")


def test_neither_an_agent_nor_blocks_in_the_folder(fake_vllm, package, tmp_path, no_configured_agent):
    shutil.rmtree(package.path / "blocks")
    from vllm_plugin.pipecast_vllm.errors import PackageUnavailableError

    with pytest.raises(PackageUnavailableError) as caught:
        make_loader(fake_vllm).load_weights(FakeModel([]), model_config(package.path))
    assert str(caught.value) == (f"package {package.manifest.package_id[:12]}: no pipecast agent configured "
                                 "(agent_socket, PIPECAST_AGENT_LOCAL_SOCKET unset), and the package folder "
                                 f"{package.path} holds none of its blocks")


def test_a_folder_missing_some_blocks_is_refused_before_any_block(fake_vllm, package, no_configured_agent):
    """Found in review: a folder missing its last block (a copy cut short) loaded every other block into the model,
    then failed on that one."""
    from vllm_plugin.pipecast_vllm.errors import PackageUnavailableError

    last = package.manifest.blocks[-1]
    (package.path / last.file).unlink()
    model = FakeModel([])
    with pytest.raises(PackageUnavailableError) as caught:
        make_loader(fake_vllm).load_weights(model, model_config(package.path))
    assert str(caught.value) == (f"package {package.manifest.package_id[:12]}: no pipecast agent configured "
                                 "(agent_socket, PIPECAST_AGENT_LOCAL_SOCKET unset), and the package folder "
                                 f"{package.path} lacks block(s) {last.index} of {len(package.manifest.blocks)}")
    assert model.order == []


def test_a_config_that_is_not_the_packages_is_refused_before_any_block(fake_vllm, package, no_configured_agent):
    """Found in review: vLLM builds the model from the folder's config.json, which nothing checked: an edited one
    (its rope_theta) loaded every block into the wrong model, wrong logits and no error."""
    from vllm_plugin.pipecast_vllm.errors import LoaderConfigError

    config = package.path / "config.json"
    config.write_text(config.read_text().replace("}", ', "rope_theta": 1.0}', 1))
    model = FakeModel(every_name(package.manifest))
    with pytest.raises(LoaderConfigError) as caught:
        make_loader(fake_vllm).load_weights(model, model_config(package.path))
    assert str(caught.value).startswith(f"package {package.manifest.package_id[:12]} at {package.path}: {config}: "
                                        "disagrees with the manifest: size is ")
    assert model.order == []


def test_the_folder_fallback_holds_no_block_mapping_past_its_tensors(fake_vllm, package, no_configured_agent):
    """Found in review: each block file's mapping stayed cached until the load ended: a whole model mapped and read
    in each tensor-parallel worker."""
    from vllm_plugin.pipecast_vllm.weights import LoaderOptions, open_blocks

    source = open_blocks(package.path, LoaderOptions())
    for block in package.manifest.blocks:
        assert source.tensors(block)
        assert source._package._maps == {}


def test_an_error_of_the_models_own_loading_names_the_tensor_and_block(fake_vllm, package, no_configured_agent):
    """Found in review: a tensor vLLM's model class does not take failed with its bare KeyError."""
    unknown = package.manifest.blocks[1].tensor_names[0]

    class Strict(FakeModel):
        def load_weights(self, weights):
            for name, _ in weights:
                if name == unknown:
                    raise KeyError(name)
            return set()

    with pytest.raises(KeyError) as caught:
        make_loader(fake_vllm).load_weights(Strict([]), model_config(package.path))
    assert caught.value.__notes__ == [f"pipecast loader: while loading tensor {unknown} of block 1 of package "
                                      f"{package.path}"]


def test_a_parameter_no_block_filled_fails_as_vllms_default_loader_does(fake_vllm, package, no_configured_agent):
    from vllm_plugin.pipecast_vllm.errors import MissingWeightsError

    model = FakeModel([*every_name(package.manifest), "lm_head.weight"])
    with pytest.raises(MissingWeightsError) as caught:
        make_loader(fake_vllm).load_weights(model, model_config(package.path))
    assert str(caught.value) == (f"pipecast loader: package {package.path}: Following weights were not initialized "
                                 "from checkpoint: {'lm_head.weight'}")
    assert isinstance(caught.value, ValueError)


def test_get_all_weights_reads_the_folder_vllm_names(fake_vllm, package, tmp_path, no_configured_agent):
    """vLLM's in-place reload sets the model path to its ``weights_path`` and calls get_all_weights."""
    other = tiny_package(tmp_path / "other", layers=2, layer_bytes=150_000, seed=1)
    loader = make_loader(fake_vllm)
    weights = dict(loader.get_all_weights(model_config(other.path), FakeModel([])))
    checkpoint = load_file(other.checkpoint / "model.safetensors")
    assert sorted(weights) == sorted(checkpoint) and all(weights[n].equal(checkpoint[n]) for n in weights)


@pytest.mark.parametrize("extra, message", [
    ({"agent": "/run/a.sock"}, "unexpected --model-loader-extra-config keys for load format pipecast: agent "
                               "(known: agent_socket, agent_timeout_s, block_timeout_s)"),
    ({"agent_socket": 3}, "agent_socket must be the path of the agent's local socket, got 3"),
    ({"block_timeout_s": 0}, "block_timeout_s must be a positive number of seconds, got 0"),
    ({"agent_timeout_s": True}, "agent_timeout_s must be a positive number of seconds, got True"),
    ({"agent_timeout_s": float("inf")}, "agent_timeout_s must be a positive number of seconds, got inf"),
    # Longer than the agent's local API waits: every block request, or the manifest's, would be refused.
    ({"block_timeout_s": 86_401}, "block_timeout_s must be at most 86400 s (the longest wait the agent's local API "
                                  "takes), got 86401"),
    ({"agent_timeout_s": 1e5}, "agent_timeout_s must be at most 86400 s (the longest wait the agent's local API "
                               "takes), got 100000.0"),
    # An integer past a float's range (a raw OverflowError from math.isfinite before).
    ({"agent_timeout_s": 10 ** 400}, "agent_timeout_s must be at most 86400 s (the longest wait the agent's local "
                                     f"API takes), got {10 ** 400}"),
    ({"block_timeout_s": float("nan")}, "block_timeout_s must be a positive number of seconds, got nan"),
])
def test_options_are_checked_when_vllm_makes_the_loader(fake_vllm, extra, message):
    from vllm_plugin.pipecast_vllm.errors import LoaderConfigError

    with pytest.raises(LoaderConfigError) as caught:
        make_loader(fake_vllm, **extra)
    assert str(caught.value) == message and isinstance(caught.value, ValueError)


def test_the_folder_command_on_a_folder_it_wrote_before_for_the_package_is_done(package, capsys):
    """Found in review: the README's scale-up runs the command at every scale-up, and the second one of a package
    on a node failed (exit 2: already exists)."""
    from vllm_plugin.pipecast_vllm.folder import main

    package_id = package.manifest.package_id
    assert main([package_id, str(package.path), "--agent", "/nonexistent.sock"]) == 0
    assert capsys.readouterr().out == (f"{package.path}: already holds package {package_id[:12]} (vllm serve "
                                       f"{package.path} --load-format pipecast)\n")


def test_a_model_path_that_is_not_a_package(fake_vllm, package, tmp_path):
    from vllm_plugin.pipecast_vllm.errors import LoaderConfigError

    with pytest.raises(LoaderConfigError) as caught:
        make_loader(fake_vllm).load_weights(FakeModel([]), model_config(package.checkpoint))
    assert str(caught.value) == (
        f"{package.checkpoint} is not a pipecast package ({package.checkpoint}/manifest.json: invalid manifest: "
        "cannot read (No such file or directory)): --load-format pipecast serves a package folder (manifest.json, "
        "config.json and the tokenizer files at its root; `pipecast pack` writes one, `pipecast-vllm-folder` one "
        "without blocks from the agent)")


def test_the_folder_command_refuses_an_existing_folder_and_a_missing_agent(tmp_path, capsys, no_configured_agent):
    from vllm_plugin.pipecast_vllm.folder import main

    assert main(["0" * 64, str(tmp_path), "--agent", str(tmp_path / "a.sock")]) == 2
    assert capsys.readouterr().err == f"pipecast-vllm-folder: {tmp_path}: already exists\n"
    # One holding another package says which.
    other = tiny_package(tmp_path / "other", layers=1, layer_bytes=1000)
    assert main(["0" * 64, str(other.path), "--agent", str(tmp_path / "a.sock")]) == 2
    assert capsys.readouterr().err == (f"pipecast-vllm-folder: {other.path}: already exists (package "
                                       f"{other.manifest.package_id[:12]})\n")
    assert main(["0" * 64, str(tmp_path / "new")]) == 2
    assert capsys.readouterr().err == ("pipecast-vllm-folder: no agent socket: pass --agent or set "
                                       "PIPECAST_AGENT_LOCAL_SOCKET\n")
    assert main(["0" * 64, str(tmp_path / "new"), "--agent", str(tmp_path / "a.sock")]) == 2
    assert capsys.readouterr().err == (f"pipecast-vllm-folder: no agent at {tmp_path / 'a.sock'} (No such file or "
                                       "directory)\n")
    assert not (tmp_path / "new").exists()
    # Found in review: a short id was asked of the agent, which waited the whole --timeout for no such package.
    assert main(["bace3f98f186", str(tmp_path / "new"), "--agent", str(tmp_path / "a.sock")]) == 2
    assert capsys.readouterr().err == ("pipecast-vllm-folder: 'bace3f98f186' is not a whole package id (64 hex "
                                       "digits, as `pipecast cp availability PREFIX` prints it whole)\n")
