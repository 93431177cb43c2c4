"""The worker session's registrations when the agent's disk cache changes (a unit test: the control plane is a
recording fake, its register call held open to race against). Found in review of the agent telling its control
plane what its disk cache removed: a registration asked for while one was in flight was lost; a queued report of a
removed package's cached blocks was sent all the same; a session registering again did not deregister on close."""

import asyncio
import logging

import pytest

from control_plane.errors import ChangeNotStored
from control_plane.messages import PeerInfo, WorkerSpec
from control_plane.worker_session import WorkerSession

pytestmark = pytest.mark.timeout(30)


class Registration:
    heartbeat_s = 0.05
    data_key = b""
    unknown_packages = ()


class RecordingControlPlane:
    """Records registrations (the cached packages each carried) and deregistrations; ``gate`` holds a register
    call open until set."""

    target = "fake"

    def __init__(self) -> None:
        self.registrations: list[list[str]] = []
        self.deregistered: list[str] = []
        self.gate: asyncio.Event | None = None

    async def register(self, spec, held, cached):
        self.registrations.append(sorted(cached))
        if self.gate is not None:
            await self.gate.wait()
        return Registration()

    async def heartbeat(self, node_id):
        return 10.0

    async def deregister(self, node_id):
        self.deregistered.append(node_id)


async def session_over(disk: dict[str, set[int]]) -> tuple[WorkerSession, RecordingControlPlane]:
    plane = RecordingControlPlane()
    session = WorkerSession(plane, WorkerSpec(PeerInfo("a1", "127.0.0.1:7000", ("tcp",)), 1 << 30),
                            holdings=lambda: {}, cached=lambda: {p: set(b) for p, b in disk.items()}, heartbeat_s=0.05)
    await session.start()
    await asyncio.wait_for(session.registered.wait(), 5)
    return session, plane


async def until(check, what: str) -> None:
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


async def test_a_registration_asked_for_while_one_is_in_flight_runs_again_with_what_the_disk_holds_then():
    disk = {"A": {0, 1}, "B": {0, 1}}
    session, plane = await session_over(disk)
    try:
        plane.gate = asyncio.Event()
        del disk["A"]
        session.holdings_changed(removed=["A"])
        await until(lambda: len(plane.registrations) == 2, "the registration after A was removed")
        del disk["B"]  # removed while that registration's call is in flight
        session.holdings_changed(removed=["B"])
        plane.gate.set()
        await until(lambda: plane.registrations[-1] == [], "a registration carrying what the disk holds now")
        await asyncio.wait_for(session.registered.wait(), 5)
        assert plane.registrations == [["A", "B"], ["B"], []]
    finally:
        await session.close()


async def test_a_removed_packages_cached_blocks_still_queued_are_not_reported():
    disk = {"A": {0, 1}}
    session, plane = await session_over(disk)
    try:
        plane.gate = asyncio.Event()  # the reports wait for the registration: nothing goes before it
        session.report_cached("A", [0, 1])
        del disk["A"]
        session.holdings_changed(removed=["A"])
        plane.gate.set()
        await until(lambda: len(plane.registrations) == 2 and session.registered.is_set(), "the registration")
        assert plane.registrations[-1] == []
    finally:
        await session.close()


async def test_a_session_registering_again_deregisters_when_it_closes():
    session, plane = await session_over({"A": {0}})
    plane.gate = asyncio.Event()
    session.holdings_changed(removed=["A"])
    await until(lambda: len(plane.registrations) == 2, "the registration after A was removed")
    await session.close()
    assert plane.deregistered == ["a1"]


async def test_a_deregistration_made_but_not_stored_yet_is_no_failure(caplog):
    """Found in review: the control plane writes a deregistration before it answers now, and one whose write failed
    (made all the same: the next flush writes it) was logged as a failed deregistration."""
    session, plane = await session_over({})

    async def not_stored(node_id):
        raise ChangeNotStored("the change was made but not stored yet: database gone")

    plane.deregister = not_stored
    with caplog.at_level(logging.INFO, logger="control_plane.worker_session"):
        await session.close()
    assert "deregistered node=a1, not stored yet" in caplog.text and "deregister failed" not in caplog.text
