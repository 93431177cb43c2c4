"""The block loader: binds blocks in whatever order they arrive, a streamed block part by part as its bytes are
verified, declares a silent source stalled, and stops when told."""

import time

import pytest
import torch

from packager.blockfile import buffer_header, map_file
from pipecast.engine.errors import BlockStalledError, ModelLoadError, PackageMismatchError
from pipecast.engine.loader import BlockLoader
from pipecast.engine.progressive import ProgressiveModel
from pipecast.engine.providers import AgentBlockProvider, DelayedProvider, PackageFolderProvider
from pipecast.engine.weights import ATTENTION, EMBED, HEAD, MLP_IN, stage_of
from tests.support.engine_fixtures import GatedAgent, wait_until
from tests.support.packages import tiny_package

WAIT_S = 10.0


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    """A 4-layer llama in 4 blocks of one layer each (the embeddings in the first, the head in the last)."""
    return tiny_package(tmp_path_factory.mktemp("loader") / "pkg", seed=3).path


def loading(provider, stall_timeout_s: float = 600.0) -> tuple[BlockLoader, ProgressiveModel]:
    model = ProgressiveModel(provider.config, dtype=torch.float32)
    loader = BlockLoader(provider, model, stall_timeout_s=stall_timeout_s)
    loader.start()
    return loader, model


def test_a_block_that_arrives_early_is_bound_while_the_lowest_missing_one_is_awaited(pkg):
    provider = DelayedProvider(PackageFolderProvider(pkg))
    loader, model = loading(provider)
    try:
        provider.release(2)
        wait_until(lambda: loader.blocks_bound == 1)
        assert model.is_ready(2) and not model.is_ready(EMBED)
        provider.release(3, 0)
        wait_until(lambda: loader.blocks_bound == 3)
        assert model.is_ready(HEAD) and model.is_ready(0) and not model.is_ready(1)
        provider.release(1)
        wait_until(lambda: loader.blocks_bound == 4)  # the stamp follows the model's last bind
        assert model.fully_loaded
        bound = loader.block_bound_at
        assert bound[2] < bound[0] < bound[1] and bound[3] < bound[1]
    finally:
        loader.stop(timeout=WAIT_S)


def test_a_source_silent_past_the_stall_timeout_fails_the_model_naming_the_missing_blocks(pkg):
    provider = DelayedProvider(PackageFolderProvider(pkg))
    provider.release(0)
    loader, model = loading(provider, stall_timeout_s=0.3)
    try:
        wait_until(lambda: model.failed)
        with pytest.raises(ModelLoadError) as info:
            model.check_failed()
        stalled = info.value.__cause__
        assert isinstance(stalled, BlockStalledError) and stalled.blocks == [1, 2, 3]
        assert model.is_ready(0) and loader.blocks_bound == 1  # what arrived stays bound
    finally:
        loader.stop(timeout=WAIT_S)


def test_a_model_the_blocks_leave_incomplete_fails_once_every_block_is_bound(pkg):
    """Each block holds its own layers whole, but config.json asks for two layers no block holds: the model
    fails rather than leave requests waiting for layers that will never come."""
    provider = PackageFolderProvider(pkg)
    model = ProgressiveModel({**provider.config, "num_hidden_layers": 6}, dtype=torch.float32)
    loader = BlockLoader(provider, model)
    loader.start()
    try:
        wait_until(lambda: model.failed)
        with pytest.raises(ModelLoadError) as info:
            model.check_failed()
        assert isinstance(info.value.__cause__, PackageMismatchError)
        assert str(info.value.__cause__) == (
            f"the package from package folder {pkg} does not fit its config.json: no block holds 18 of its "
            "parameters: ['model.layers.4.input_layernorm.weight', 'model.layers.4.mlp.down_proj.weight', "
            "'model.layers.4.mlp.gate_proj.weight', 'model.layers.4.mlp.up_proj.weight', "
            "'model.layers.4.post_attention_layernorm.weight', 'model.layers.4.self_attn.k_proj.weight', "
            "'model.layers.4.self_attn.o_proj.weight', 'model.layers.4.self_attn.q_proj.weight']")
        assert loader.blocks_bound == 4 and model.is_ready(HEAD) and not model.fully_loaded
    finally:
        loader.stop(timeout=WAIT_S)


def test_stop_ends_the_wait_within_a_poll_slice_without_failing_the_model(pkg):
    loader, model = loading(DelayedProvider(PackageFolderProvider(pkg)))
    started = time.monotonic()
    loader.stop(timeout=WAIT_S)
    assert time.monotonic() - started < 1.0  # not the join's timeout: the thread ended
    assert not model.failed and loader.blocks_bound == 0


def test_stop_interrupts_a_request_in_flight_to_a_silent_agent(pkg):
    """Found in review: a loader waiting on a silent agent's answer (map_ahead, bounded at agent_timeout_s + 5 s)
    outlived the model's close: close() waited 10 s for it, then kept the weights, and the agent's mappings."""
    import threading

    from pipecast.agent.errors import LocalApiError

    class SilentAgent(GatedAgent):
        def __init__(self, pkg):
            super().__init__(pkg)
            self.entered, self.interrupted = threading.Event(), threading.Event()

        def map_ahead(self, index, package_id=None, timeout=30.0):
            self.entered.set()
            if not self.interrupted.wait(60):
                raise AssertionError("never interrupted")
            raise LocalApiError("agent at gated: the request was interrupted")

        def interrupt(self, scope):
            assert scope is provider._scope  # its own requests only: the client may serve other models
            self.interrupted.set()

    agent = SilentAgent(pkg)
    provider = AgentBlockProvider(agent, package_id=None, where="silent agent", timeout_s=WAIT_S)
    loader, model = loading(provider)
    wait_until(agent.entered.is_set)  # the loader waits on the agent's answer
    assert loader.stop(timeout=WAIT_S)  # ended, not given up on after the join's timeout
    assert agent.interrupted.is_set() and not model.failed  # stopped: the interrupted request is no failure


def test_a_streamed_block_is_bound_stage_by_stage_as_its_bytes_are_verified(pkg):
    agent = GatedAgent(pkg)
    provider = AgentBlockProvider(agent, package_id=None, where="gated agent", timeout_s=WAIT_S)
    header = buffer_header(map_file(pkg / provider.manifest.blocks[0].file))
    attention_end = max(t.end for name, t in header.tensors.items() if stage_of(name) == (0, ATTENTION))
    loader, model = loading(provider)
    try:
        agent.release_prefix(0, header.data_start + attention_end)
        wait_until(lambda: model.is_ready((0, ATTENTION)))
        assert model.is_ready(EMBED) and not model.is_ready((0, MLP_IN)) and loader.blocks_bound == 0
        agent.release()
        wait_until(lambda: model.fully_loaded)
        # The loader records a block bound just after its last part is: the model can be whole a moment before.
        wait_until(lambda: loader.blocks_bound == 4)
        assert loader.blocks_bound == 4
    finally:
        loader.stop(timeout=WAIT_S)
