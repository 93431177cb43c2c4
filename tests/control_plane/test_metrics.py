"""The control plane's metrics read from its state: bytes each worker holds, per package."""

import asyncio
import threading

from prometheus_client import generate_latest

from control_plane.metrics import ControlMetrics
from control_plane.state import ControlState
from pipecast.v1.manifest_pb2 import Block, Manifest
from tests.control_plane.test_state import STORE, spec


def test_worker_bytes_sum_the_sizes_of_the_blocks_each_worker_reported():
    state = ControlState(lease_s=10.0)
    # Blocks of different sizes, as a real package's (the first holds the embeddings).
    state.publish(Manifest(package_id="pkg", model_name="tiny",
                           blocks=[Block(index=i, bytes=size) for i, size in enumerate((500, 100, 100, 300))]),
                  STORE, now=0)
    for node in ("w0", "w1"):
        state.register(spec(node), {}, now=0)
    state.report("w0", {"pkg": [0, 3]}, {}, now=1)
    state.report("w1", {"pkg": [1]}, {}, now=1)
    text = generate_latest(ControlMetrics(state).registry).decode()
    assert 'pipecast_control_worker_bytes{node="w0",package="pkg"} 800.0' in text
    assert 'pipecast_control_worker_bytes{node="w1",package="pkg"} 100.0' in text
    state.report("w0", {}, {"pkg": [0]}, now=2)  # dropped: no longer counted
    text = generate_latest(ControlMetrics(state).registry).decode()
    assert 'pipecast_control_worker_bytes{node="w0",package="pkg"} 300.0' in text


async def test_a_scrape_from_the_metrics_thread_reads_the_state_on_its_event_loop():
    # Found in review: the metrics server's thread iterated the state while the event loop changed it, and the
    # scrape failed ("dictionary changed size during iteration").
    state = ControlState(lease_s=600.0)
    state.publish(Manifest(package_id="pkg", model_name="tiny", blocks=[Block(index=i, bytes=100) for i in range(8)]),
                  STORE, now=0)
    metrics = ControlMetrics(state)
    metrics.bind(asyncio.get_running_loop())
    errors, scrapes, stop = [], [], threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            try:
                scrapes.append(generate_latest(metrics.registry))
            except Exception as exc:  # any failure is the finding
                errors.append(exc)
    thread = threading.Thread(target=scrape)
    thread.start()
    try:
        for _ in range(40):
            for i in range(1000):
                state.register(spec(f"w{i}"), {"pkg": range(i % 8)}, now=0)
            await asyncio.sleep(0)  # the scrapes' copies run here
            for i in range(1000):
                state.deregister(f"w{i}")
            await asyncio.sleep(0)
    finally:
        stop.set()
        await asyncio.to_thread(thread.join)  # it may wait for this loop
    assert not errors and scrapes
