"""The pipeline former: the same pipelines in its process as in a thread, and a failing process replaced."""

import logging
import os
import signal

import psutil
import pytest

from control_plane.messages import PeerInfo, WorkerSpec
from control_plane.pipeline_forming import PipelineFormer, PipelineQuery, pipeline_infos
from control_plane.state import ControlState
from pipecast.v1.manifest_pb2 import Block, Manifest

BLOCKS = 8
STORE = PeerInfo("store", "10.0.0.1:7070", ("tcp",))


def query(receivers: int = 24) -> PipelineQuery:
    """Two holders of a one-layer-a-block model; ``receivers`` serving workers in a rotated plan from them,
    each holding the first third of its order: pipelines of verified blocks and of the blocks received next."""
    state = ControlState(lease_s=60.0, store_beside_holders=False)
    state.publish(Manifest(package_id="llm", model_name="tiny", num_layers=BLOCKS, blocks=[
        Block(index=i, bytes=100, layer_start=i, layer_end=i + 1) for i in range(BLOCKS)]), STORE, now=0)
    for i in range(receivers + 2):
        spec = WorkerSpec(PeerInfo(f"w{i}", f"w{i}.local:7070", ("tcp",)), 10_000, serve_url=f"http://w{i}.local:8000")
        state.register(spec, {"llm": range(BLOCKS)} if i >= receivers else {}, now=0)
    plan = state.scale_up("llm", node_ids=[f"w{i}" for i in range(receivers)], strategy="rotated", now=1)
    for node in plan.receivers:
        state.report(node, {"llm": [f.block for f in state.plans[plan.plan_id].parts[node].fetch][:BLOCKS // 3]}, {},
                     now=2)
    made = state.pipeline_query("llm")
    assert made is not None
    return made


def started_pids(caplog: pytest.LogCaptureFixture) -> list[int]:
    return [int(r.getMessage().rsplit("pid=", 1)[1]) for r in caplog.records
            if r.getMessage().startswith("pipeline forming process started")]


async def test_the_process_forms_the_pipelines_a_thread_forms_and_stops_with_the_former(caplog):
    caplog.set_level(logging.INFO, logger="control_plane.pipeline_forming")
    asked = query()
    expected = pipeline_infos("llm", asked.candidates())
    assert any(info.waiting_blocks == 0 for _, info in expected) and any(info.waiting_blocks for _, info in expected)
    former = PipelineFormer(process_from=1)
    try:
        assert await former.form("llm", asked) == expected
        assert await former.form("llm", asked) == expected  # the same process again
        [pid] = started_pids(caplog)
        assert pid != os.getpid() and psutil.Process(pid).is_running()
    finally:
        await former.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_few_candidates_are_formed_in_a_thread(caplog):
    caplog.set_level(logging.INFO, logger="control_plane.pipeline_forming")
    asked = query()
    former = PipelineFormer(process_from=len(asked.candidates().urls) + 1)
    assert await former.form("llm", asked) == pipeline_infos("llm", asked.candidates())
    assert started_pids(caplog) == []
    await former.close()


async def test_a_process_that_died_or_overran_is_replaced_and_its_forming_done_in_a_thread(caplog):
    caplog.set_level(logging.INFO, logger="control_plane.pipeline_forming")
    asked = query()
    expected = pipeline_infos("llm", asked.candidates())
    former = PipelineFormer(process_from=1)
    try:
        assert await former.form("llm", asked) == expected
        [first] = started_pids(caplog)
        os.kill(first, signal.SIGKILL)
        # In a thread if the former finds out as it sends the forming, else in a process started anew.
        assert await former.form("llm", asked) == expected
        assert await former.form("llm", asked) == expected
        [_, second] = started_pids(caplog)
        former.timeout_s = 1e-6
        assert await former.form("llm", asked) == expected
        assert "pipeline forming process failed (TimeoutError" in caplog.text
        assert not psutil.pid_exists(second) or psutil.Process(second).status() == psutil.STATUS_ZOMBIE
    finally:
        await former.close()
