"""The chaos scenarios: each starts real processes on loopback through a :class:`Harness`, injects its
faults, and returns whether its own goal held (a transfer completed, an agent kept serving, a request got
a 400). The harness counts hangs, corrupt blocks served and resource peaks around it.
"""

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from benchmarks.chaos_harness import Harness, measure
from benchmarks.chaos_net import (
    Abuse,
    BackgroundLoop,
    FakePeer,
    FlippingProxy,
    fetch_manifest_raw,
    nested_json,
    unique_requesters,
)
from benchmarks.processes import cli, free_port
from control_plane.client import ControlPlaneClient
from control_plane.errors import PermissionDenied
from control_plane.messages import PeerInfo, WorkerSpec
from control_plane.planner.schedules import make_plan
from packager.manifest import manifest_to_json
from pipecast.agent.plan_file import plan_file_data
from pipecast.core.credentials import data_plane_key, issue_node_token, serving_headers, serving_key
from pipecast.v1.manifest_pb2 import Manifest

MIB = 1 << 20
STORE = "store"
OVERSIZED_BODY_BYTES = 20 << 20  # over the serving worker's and the router's 16 MiB body limit
START_S = 60.0  # python start-up of a few processes on a busy 2-core machine
# Growth over the scale-up/release cycles that still counts as no leak: allocator noise, caches filled
# by the first cycles (the baseline is taken after the first one).
LEAK_RSS_BYTES = 24 << 20
LEAK_FDS = 4
RESTART_TRANSFER_S = 10.0  # how long the transfer across a control plane restart takes
FORGET_S = 3.0  # from the workers' drop until the control plane no longer counts them as holders
# Where the abusers connect from (all of 127/8 is loopback): apart from the legit peer's 127.0.0.1, as
# on a real network, so that a per-address limit can keep them from crowding it out. The flood comes
# from many addresses (a distributed attacker: only a limit on the whole agent holds it).
LORIS, SLOTHS, GHOSTS = "127.0.0.2", "127.0.0.3", "127.0.0.4"
FLOOD = tuple(f"127.0.1.{i}" for i in range(1, 31))
BLOCK_FILE = r"block-(\d+)\.safetensors"  # a cached block's file name (the packager's layout)


@dataclass(frozen=True)
class Sizes:
    """How much each scenario does: the full run, or the short one (< 3 minutes on 2 cores)."""

    layers: int  # blocks of the random package, one layer each
    layer_bytes: int
    chunk_bytes: int
    egress_mbit: float  # every agent's send rate: slow enough to act mid-transfer
    workers: int  # receivers of the multicast scenarios
    cycles: int  # scale-up/release cycles
    flood: int  # idle connections
    loris: int  # slow-loris connections
    sloths: int  # requesters that never read
    ghosts: int  # requests under made-up requester names
    transfer_s: float  # deadline of a transfer (a few MiB, rate-limited, with a failure to route around)
    hostile_bytes: int = 200_000  # hostile JSON bodies and manifests


FULL = Sizes(layers=8, layer_bytes=MIB, chunk_bytes=128 << 10, egress_mbit=40.0, workers=4, cycles=100, flood=600,
             loris=100, sloths=20, ghosts=5000, transfer_s=60.0)
SHORT = Sizes(layers=6, layer_bytes=512 << 10, chunk_bytes=64 << 10, egress_mbit=24.0, workers=3, cycles=10,
              flood=600, loris=50, sloths=10, ghosts=2000, transfer_s=30.0)


@dataclass
class Context:
    """What a scenario is given: the sizes, the random package, the loop for its network actors."""

    sizes: Sizes
    package: Path
    manifest: Manifest
    loop: BackgroundLoop  # where the scenarios' own network actors run
    model_package: Callable[[], tuple[Path, Manifest]]  # the servable tiny model, built on first use
    manifests: dict[str, Manifest] = field(default_factory=dict)  # by package id: what the re-hash checks


def _rate(sizes: Sizes) -> dict[str, str]:
    return {"PIPECAST_EGRESS_MBIT": f"{sizes.egress_mbit:g}"}


def _verified(h: Harness, name: str, package_id: str, since: float = 0.0) -> set[int]:
    return {e["block"] for e in h.events(name, "block_verified", since) if e.get("package") == package_id}


def _write_plan(h: Harness, strategy: str, sources: list[str], receivers: list[str], blocks: int,
                package_id: str, nodes: dict[str, str]) -> Path:
    path = h.folder / "plan.json"
    plan = make_plan(strategy, sources, receivers, blocks)
    path.write_text(json.dumps(plan_file_data(plan, package_id, nodes)))
    return path


def _start_cluster(h: Harness, ctx: Context, workers: list[str], env: dict[str, str] | None = None) -> bool:
    """Control plane, the package published, the store's agent seeding it, ``workers``' agents (``env``
    added to each agent's environment): True once all are registered and alive."""
    control = h.control_plane()
    store_address = f"127.0.0.1:{free_port('127.0.0.1')}"

    async def publish() -> str:
        async with h.client() as client:
            return await client.publish_package(ctx.manifest, PeerInfo(STORE, store_address, ("tcp",)))

    if h.call("publish the package", publish) is None:
        return False
    h.agent(STORE, "--seed", ctx.package, "--control-plane", control, address=store_address,
            env=h.node_env(STORE, env))
    for worker in workers:
        h.agent(worker, "--control-plane", control, env=h.node_env(worker, env))
    if not all(h.wait_event(n, "listening", START_S) for n in [STORE, *workers]):
        return False
    return _wait_registered(h, [STORE, *workers], START_S)


def _wait_registered(h: Harness, nodes: list[str], timeout_s: float) -> bool:
    async def alive() -> set[str]:
        async with h.client() as client:
            return {w.worker.peer.node_id for w in await client.list_workers() if w.alive}

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if set(nodes) <= asyncio.run(asyncio.wait_for(alive(), 5.0)):
                return True
        except Exception:  # noqa: BLE001 - a control plane still starting: ask again
            pass
        time.sleep(0.3)
    h.hang(f"{', '.join(nodes)} registered and alive: not within {timeout_s:g} s")
    return False


def _scale_up(h: Harness, package_id: str, workers: list[str], strategy: str) -> bool:
    """Ask for a plan bringing the package onto ``workers``: whether one was made for all of them."""
    async def scale() -> object:
        async with h.client() as client:
            return await client.scale_up(package_id, node_ids=workers, strategy=strategy)

    reply = h.call(f"scale-up ({strategy or 'picked'}) to {', '.join(workers)}", scale)
    if reply is None:
        return False
    return h.check(bool(reply.plan_id) and set(reply.receivers) == set(workers),
                   f"scale-up to {', '.join(workers)} made {reply.plan_id or 'no plan'} for "
                   f"{', '.join(reply.receivers) or 'no one'} (said unchanged: {', '.join(reply.unchanged) or '-'})")


def _still_held_by(h: Harness, package_id: str, workers: list[str], timeout_s: float) -> set[str] | None:
    """Those of ``workers`` the control plane still counts as holding a block of the package after
    ``timeout_s`` (None: it did not answer)."""
    async def holders() -> set[str]:
        async with h.client() as client:
            view = await client.availability(package_id)
            return {node for node, blocks in view.by_worker.items() if blocks}

    deadline = time.monotonic() + timeout_s
    while True:
        held = h.call("availability", holders)
        if held is None or not held & set(workers) or time.monotonic() > deadline:
            return held if held is None else held & set(workers)
        time.sleep(0.1)


# -- 1. relay killed mid-multicast ---------------------------------------------------------------------


def relay_killed(h: Harness, ctx: Context) -> bool:
    """kill -9 a middle agent of a chain mid-transfer; the others complete from the re-plan."""
    workers = [f"w{i}" for i in range(1, ctx.sizes.workers + 1)]
    if not _start_cluster(h, ctx, workers, _rate(ctx.sizes)):
        return False
    pid, since = ctx.manifest.package_id, time.time()
    if not _scale_up(h, pid, workers, "chain"):
        return False
    if not all(h.wait_event(w, "assignment", START_S, since) for w in workers):
        return False
    # The relay: a worker that serves others and itself fetches from a worker (the middle of the chain).
    serving = {w for w in workers if any(e.get("serve") for e in h.events(w, "assignment", since))}
    middle = [w for w in workers if w in serving and any(
        parent != STORE for e in h.events(w, "assignment", since) for _, parent in e.get("fetch", []))]
    relay = (middle or sorted(serving) or workers[:1])[0]
    if not h.wait_until(f"{relay} holding a block", lambda: _verified(h, relay, pid, since), ctx.sizes.transfer_s,
                        [STORE, *workers]):
        return False
    held = len(_verified(h, relay, pid, since))
    h.kill9(relay)
    h.fault(f"kill -9 relay {relay} of the chain after {held}/{len(ctx.manifest.blocks)} blocks")
    killed_at, others = time.time(), [w for w in workers if w != relay]
    done = all(h.wait_event(w, "complete", ctx.sizes.transfer_s, since, package=pid) for w in others)
    if done:
        replanned = [w for w in others if h.events(w, "assignment", killed_at)]
        h.note(f"the others completed {time.time() - killed_at:.1f} s after the kill; new assignments after it: "
               f"{', '.join(replanned) or 'none (they fetched around it from the sources)'}")
    return h.check(done, f"{', '.join(others)} did not all complete after the relay died")


# -- 2. control plane restarted mid-transfer -----------------------------------------------------------


def control_plane_restart(h: Harness, ctx: Context) -> bool:
    """kill -9 the control plane mid-transfer and start it again (same port, same database): the
    transfer completes and every agent registers again."""
    workers = [f"w{i}" for i in range(1, ctx.sizes.workers + 1)]
    # Slow enough that the transfer outlasts the control plane's restart (python start-up, seconds here).
    slow = {"PIPECAST_EGRESS_MBIT": f"{ctx.manifest.total_bytes * 8 / 1e6 / RESTART_TRANSFER_S:.3g}"}
    if not _start_cluster(h, ctx, workers, slow):
        return False
    pid, since = ctx.manifest.package_id, time.time()
    if not _scale_up(h, pid, workers, "chain"):
        return False
    if not h.wait_until("a first block verified", lambda: any(_verified(h, w, pid, since) for w in workers),
                        ctx.sizes.transfer_s, [STORE, *workers]):
        return False
    port = int(h.control_address.rsplit(":", 1)[1])
    h.kill9("control-plane-1")
    h.fault("kill -9 the control plane after the first block of a chain")
    time.sleep(1.0)  # agents notice it is gone
    h.control_plane(port)
    h.fault("restart the control plane on its port and database")
    restarted = time.time()
    done = all(h.wait_event(w, "complete", ctx.sizes.transfer_s, since, package=pid) for w in workers)
    early = [w for w in workers if h.has(w, "complete", since, package=pid)
             and not h.has(w, "complete", restarted, package=pid)]
    h.note(f"completed while the control plane was down: {', '.join(early) or 'none'}")
    h.check(done, "the transfer did not complete across the restart")
    registered = _wait_registered(h, [STORE, *workers], START_S)
    return h.check(done and registered, "agents did not register with the restarted control plane")


# -- 3. corrupted chunk from a relay -------------------------------------------------------------------


def corrupt_relay(h: Harness, ctx: Context) -> bool:
    """A relay whose served bytes are flipped by a proxy in front of it: the child detects the bad chunk,
    names the relay, and fetches elsewhere."""
    pid, blocks = ctx.manifest.package_id, len(ctx.manifest.blocks)
    relay_address = f"127.0.0.1:{free_port('127.0.0.1')}"
    proxy = FlippingProxy(relay_address)
    proxy_address = f"127.0.0.1:{ctx.loop.run(proxy.start(ctx.loop), 10.0)}"
    nodes = {STORE: f"127.0.0.1:{free_port('127.0.0.1')}", "relay": proxy_address,
             "child": f"127.0.0.1:{free_port('127.0.0.1')}"}
    plan = _write_plan(h, "chain", [STORE], ["relay", "child"], blocks, pid, nodes)
    h.agent(STORE, "--seed", ctx.package, "--plan", plan, address=nodes[STORE], env=_rate(ctx.sizes))
    if not h.wait_event(STORE, "listening", START_S):  # the others would give up on it meanwhile
        return False
    h.agent("relay", "--plan", plan, address=relay_address, env=_rate(ctx.sizes))
    h.agent("child", "--plan", plan, address=nodes["child"])
    h.fault("a proxy in front of the relay flips one byte of every chunk it serves")
    if not h.wait_event("child", "complete", ctx.sizes.transfer_s, package=pid):
        return False
    named = [e for e in h.events("child", "peer_failed") if e.get("peer") == "relay"]
    h.check(proxy.flipped > 0, "the proxy flipped no chunk (the child never fetched through the relay)")
    h.note(f"{proxy.flipped} chunks flipped, {len(named)} failures naming the relay")
    return h.check(bool(named), "the child completed but never named the relay as the peer that failed")


# -- 4. ENOSPC on the cache ----------------------------------------------------------------------------


def cache_enospc(h: Harness, ctx: Context) -> bool:
    """An agent whose disk cache is a 1 MiB tmpfs (the package is bigger): it completes and keeps serving
    its children from memory."""
    pid, blocks = ctx.manifest.package_id, len(ctx.manifest.blocks)
    cache = h.folder / "small-cache"
    if not h.mount_tmpfs(cache, "1m"):
        return False
    h.fault(f"--cache-dir on a 1 MiB tmpfs for a {ctx.manifest.total_bytes / MIB:.1f} MiB package")
    nodes = {n: f"127.0.0.1:{free_port('127.0.0.1')}" for n in (STORE, "full", "child")}
    plan = _write_plan(h, "chain", [STORE], ["full", "child"], blocks, pid, nodes)
    h.agent(STORE, "--seed", ctx.package, "--plan", plan, address=nodes[STORE], env=_rate(ctx.sizes))
    if not h.wait_event(STORE, "listening", START_S):  # the others would give up on it meanwhile
        return False
    h.agent("full", "--plan", plan, "--cache-dir", cache, address=nodes["full"])
    h.agent("child", "--plan", plan, address=nodes["child"])
    done = all(h.wait_event(n, "complete", ctx.sizes.transfer_s, package=pid) for n in ("full", "child"))
    # A block event names its peer by node id, address or both (node@address).
    from_full = {e["block"] for e in h.events("child", "block_verified")
                 if e.get("peer") == "full" or str(e.get("peer")).split("@")[-1] == nodes["full"]}
    h.note(f"child got {len(from_full)}/{blocks} blocks from the agent with the full cache")
    h.check(bool(from_full), "the child got no block from the agent whose cache was full")
    return h.check(done, "the agent with the full cache or its child did not complete")


# -- 5. kill -9 during a cache write, then restart -----------------------------------------------------


def cache_crash_restart(h: Harness, ctx: Context) -> bool:
    """kill -9 an agent while it writes its disk cache, tear and flip cached blocks, restart it: it
    re-verifies the cache and serves only good blocks."""
    pid, blocks = ctx.manifest.package_id, len(ctx.manifest.blocks)
    cache = h.folder / "cache"
    nodes = {n: f"127.0.0.1:{free_port('127.0.0.1')}" for n in (STORE, "crashy")}
    plan = _write_plan(h, "unicast", [STORE], ["crashy"], blocks, pid, nodes)
    h.agent(STORE, "--seed", ctx.package, "--plan", plan, address=nodes[STORE], env=_rate(ctx.sizes))
    if not h.wait_event(STORE, "listening", START_S):  # the others would give up on it meanwhile
        return False
    h.agent("crashy", "--plan", plan, "--cache-dir", cache, address=nodes["crashy"])
    if not h.wait_until("four blocks verified", lambda: len(_verified(h, "crashy", pid)) >= 4, ctx.sizes.transfer_s,
                        [STORE, "crashy"]):
        return False
    h.kill9("crashy")
    h.fault(f"kill -9 the agent while it caches (after {len(_verified(h, 'crashy', pid))}/{blocks} blocks)")
    cached = sorted(p for p in (cache / pid).rglob("*") if p.is_file() and p.parent.name == "blocks"
                    and re.fullmatch(BLOCK_FILE, p.name))
    index = {p: int(re.fullmatch(BLOCK_FILE, p.name).group(1)) for p in cached}
    if cached:
        cached[0].write_bytes(cached[0].read_bytes()[: max(cached[0].stat().st_size // 2, 1)])
        h.fault(f"truncate cached {cached[0].name} (a torn write)")
    if len(cached) > 1:
        data = bytearray(cached[1].read_bytes())
        data[len(data) // 2] ^= 0xFF
        cached[1].write_bytes(bytes(data))
        h.fault(f"flip a byte of cached {cached[1].name} (rot)")
    tampered = {index[p] for p in cached[:2]}
    h.agent("crashy", "--plan", plan, "--cache-dir", cache, address=nodes["crashy"], name="crashy-restarted")
    done = h.wait_event("crashy-restarted", "complete", ctx.sizes.transfer_s, package=pid)
    fetched = _verified(h, "crashy-restarted", pid)  # from peers: what the cache could not vouch for
    h.note(f"{len(cached)} blocks were cached, {len(set(index.values()) - fetched)} reused after the restart, "
           f"{len(fetched)} fetched again")
    h.check(tampered <= fetched, f"tampered cached block(s) {sorted(tampered - fetched)} were not fetched again")
    return h.check(done, "the restarted agent did not complete")


# -- 6. slow-loris, flood, never-reading and made-up requesters ----------------------------------------


def _legit_fetch(h: Harness, plan: Path, address: str, package_id: str, timeout_s: float) -> bool:
    """A real agent fetching the package, started again after each failed attempt (as a peer would retry)
    until it completes or ``timeout_s`` has passed."""
    deadline, attempt = time.monotonic() + timeout_s, 0
    while time.monotonic() < deadline:
        attempt += 1
        name = f"legit-{attempt}"
        h.agent("legit", "--plan", plan, "--exit-when-complete", address=address, name=name)
        if h.wait_until(f"{name} done", lambda: h.has(name, "complete", package=package_id) or not h.alive(name),
                        max(deadline - time.monotonic(), 0.1)) and h.has(name, "complete", package=package_id):
            h.note(f"the legit fetch completed on attempt {attempt}")
            return True
        h.expected_dead.add(name)  # a failed attempt is the finding, reported once below
        time.sleep(1.0)
    h.note(f"the legit fetch failed {attempt} attempt(s): {h.processes.log_tail(f'legit-{attempt}').splitlines()[-1:]}")
    return False


def resource_abuse(h: Harness, ctx: Context) -> bool:
    """Slow-loris connections, a connection flood, requesters that never read and thousands of made-up
    requester names against one agent: it stays within its bounds and serves a legit fetch in time."""
    sizes, pid, blocks = ctx.sizes, ctx.manifest.package_id, len(ctx.manifest.blocks)
    nodes = {n: f"127.0.0.1:{free_port('127.0.0.1')}" for n in ("victim", "legit")}
    plan = _write_plan(h, "unicast", ["victim"], ["legit"], blocks, pid, nodes)
    victim = h.agent("victim", "--seed", ctx.package, "--plan", plan, address=nodes["victim"])
    if not h.wait_event("victim", "listening", START_S):
        return False
    abuse = Abuse()
    try:
        # The made-up names first: later the flood may fill the agent's connections and they would test
        # nothing.
        try:
            answered = ctx.loop.run(unique_requesters(victim, pid, "config.json", sizes.ghosts, 8, h.key, GHOSTS),
                                    120.0)
            h.fault(f"{sizes.ghosts} insider requests from {GHOSTS}, each under a made-up node id "
                    f"({answered} answered)")
        except TimeoutError:
            h.hang(f"{sizes.ghosts} made-up requester requests not answered within 120 s")
        ctx.loop.run(abuse.never_read(victim, sizes.sloths, pid, blocks, h.key, SLOTHS), 60.0)
        h.fault(f"{sizes.sloths} insiders from {SLOTHS} asking for every block and never reading")
        ctx.loop.run(abuse.slow_loris(victim, sizes.loris, 1.0, LORIS), 60.0)
        h.fault(f"{sizes.loris} slow-loris connections from {LORIS} (a header byte a second)")
        ctx.loop.run(abuse.connect(victim, sizes.flood, FLOOD), 60.0)
        h.fault(f"{sizes.flood} idle connections from {len(FLOOD)} addresses")
        done = _legit_fetch(h, plan, nodes["legit"], pid, sizes.transfer_s)
        h.note(f"of {len(abuse.readers)} abusive connections held, the agent refused {abuse.refused} and "
               f"closed {ctx.loop.run(abuse.closed_by_agent(), 10.0)}")
        h.check(done, f"no legit fetch completed within {sizes.transfer_s:g} s under the abuse")
        h.check(h.alive("victim"), "the victim died under the abuse")
        return done
    finally:
        ctx.loop.run(abuse.close(), 30.0)


# -- 7. scale-up/release cycles ------------------------------------------------------------------------


def _footprint(h: Harness, names: list[str]) -> dict[str, tuple[int, int, int]]:
    """RSS, fds and child processes of each running ``name``."""
    out = {}
    for name in names:
        pid = h.processes.procs[name].pid
        now = measure(pid)
        if now is not None:
            try:
                children = len(psutil.Process(pid).children(recursive=True))
            except psutil.NoSuchProcess:
                children = 0
            out[name] = (now.rss_bytes, now.fds, children)
    return out


def _shm() -> set[str]:
    try:
        return {p.name for p in Path("/dev/shm").iterdir()}
    except OSError:
        return set()


def scale_cycles(h: Harness, ctx: Context) -> bool:
    """Scale up to two workers and release them, again and again: no memory, fd, process or shared
    memory growth from the first cycle to the last. The agents hold a memory reserve of the package's size:
    each scale-up's blocks take it, each release fills it again."""
    workers = ["w1", "w2"]
    if not _start_cluster(h, ctx, workers, {"PIPECAST_AGENT_RESERVE_BYTES": str(ctx.manifest.total_bytes)}):
        return False
    pid, watched = ctx.manifest.package_id, [STORE, *workers, "control-plane-1"]
    before: dict[str, tuple[int, int, int]] = {}
    after: dict[str, tuple[int, int, int]] = {}
    shm_before: set[str] = set()
    shm_after: set[str] = set()
    done = stale = 0
    for cycle in range(ctx.sizes.cycles):
        since = time.time()
        if not _scale_up(h, pid, workers, ""):
            break
        if not all(h.wait_event(w, "complete", ctx.sizes.transfer_s, since, package=pid) for w in workers):
            break

        async def release() -> float:
            async with h.client() as client:
                return await client.release(pid, workers)

        if h.call("release", release) is None:
            break
        if not all(h.wait_event(w, "dropped", ctx.sizes.transfer_s, since, package=pid) for w in workers):
            break
        held = _still_held_by(h, pid, workers, FORGET_S)
        if held is None:
            break
        if held:
            stale += 1
        done += 1
        after, shm_after = _footprint(h, watched), _shm()  # after the last complete cycle
        if cycle == 0:  # the baseline: after one cycle, so what the first one sets up for good is in it
            before, shm_before = after, shm_after
    h.fault(f"{done}/{ctx.sizes.cycles} scale-up/release cycles")
    h.check(not stale, f"in {stale} cycle(s) the control plane still counted released workers as holders "
                       f"{FORGET_S:g} s after they dropped the package")
    for name, (rss, fds, children) in after.items():
        rss0, fds0, children0 = before.get(name, (rss, fds, children))
        h.note(f"{name}: RSS {rss0 / MIB:.0f}->{rss / MIB:.0f} MiB, fds {fds0}->{fds}, children {children0}->"
               f"{children}")
        h.check(rss - rss0 <= LEAK_RSS_BYTES, f"{name} RSS grew by {(rss - rss0) / MIB:.1f} MiB")
        h.check(fds - fds0 <= LEAK_FDS, f"{name} fds grew by {fds - fds0}")
        h.check(children <= children0, f"{name} has {children - children0} more child processes")
    new_shm = shm_after - shm_before
    h.check(not new_shm, f"new /dev/shm entries: {', '.join(sorted(new_shm)[:5])}")
    for worker in workers:  # filled at start and after each release (the last one's fill may be under way)
        fills = len(h.events(worker, "reserve_filled"))
        h.check(fills >= done, f"{worker} filled its memory reserve {fills} times in {done} cycles")
    return h.check(done == ctx.sizes.cycles, f"only {done} of {ctx.sizes.cycles} cycles completed")


# -- 8. the issue's findings, black-box ----------------------------------------------------------------


def _bad_manifest_first(h: Harness, ctx: Context, body: bytes, what: str) -> bool:
    """A fake member (it holds the data-plane key) is the first source of a plan and answers the manifest
    request with ``body``: the target survives, refuses it and gets the package from the store."""
    pid, blocks = ctx.manifest.package_id, len(ctx.manifest.blocks)
    fake = FakePeer(body, h.key)
    nodes = {"fake": f"127.0.0.1:{ctx.loop.run(fake.start(ctx.loop), 10.0)}",
             STORE: f"127.0.0.1:{free_port('127.0.0.1')}", "target": f"127.0.0.1:{free_port('127.0.0.1')}"}
    # The fake is the first source, so the target asks it for the manifest first.
    plan = _write_plan(h, "unicast", ["fake", STORE], ["target"], blocks, pid, nodes)
    h.agent(STORE, "--seed", ctx.package, "--plan", plan, address=nodes[STORE])
    if not h.wait_event(STORE, "listening", START_S):  # the others would give up on it meanwhile
        return False
    h.agent("target", "--plan", plan, address=nodes["target"])
    h.fault(f"a fake peer (with the data-plane key) serves {what}")
    done = h.wait_event("target", "complete", ctx.sizes.transfer_s, package=pid)
    h.check(fake.requests > 0, "the target never asked the fake peer")
    return h.check(done, "the target did not complete from the store")


def nested_manifest(h: Harness, ctx: Context) -> bool:
    """Finding 3: a fake peer answers the manifest request with deeply nested JSON."""
    return _bad_manifest_first(h, ctx, nested_json(ctx.sizes.hostile_bytes),
                               f"a {ctx.sizes.hostile_bytes // 1000} KB deeply nested manifest")


def forged_manifest(h: Harness, ctx: Context) -> bool:
    """Finding 4: a fake peer answers with the real manifest, one field changed, under the real id."""
    forged = Manifest()
    forged.CopyFrom(ctx.manifest)
    forged.model_name = "forged"
    return _bad_manifest_first(h, ctx, manifest_to_json(forged).encode(),
                               "the package's manifest with model_name changed and the package id kept")


def impersonation(h: Harness, ctx: Context) -> bool:
    """Finding 2: with its own node token, w2 tries to register as w1, watch w1's assignments, publish and
    scale up: every call is refused, and w1 stays registered at its own address."""
    if not _start_cluster(h, ctx, ["w1"]):
        return False
    forged = WorkerSpec(PeerInfo("w1", "127.0.0.9:7070", ("tcp",)), 1 << 30)
    calls = {"register as w1": lambda c: c.register(forged),
             "report blocks as w1": lambda c: c.report_blocks("w1", {ctx.manifest.package_id: [0]}),
             "publish": lambda c: c.publish_package(ctx.manifest, PeerInfo("w2", "127.0.0.9:7070", ("tcp",))),
             "scale up": lambda c: c.scale_up(ctx.manifest.package_id, count=1)}
    ok = True
    for what, call in calls.items():
        h.fault(f"w2's node token: {what}")

        async def attempt(call=call) -> str:
            w2 = ControlPlaneClient(h.control_address, token=issue_node_token(h.token, "w2"), timeout_s=10.0)
            async with w2 as client:
                try:
                    await call(client)
                except PermissionDenied as exc:
                    return f"refused ({exc})"[:120]
                return "accepted"

        outcome = h.call(what, attempt)
        h.note(f"{what}: {outcome}")
        ok &= h.check(outcome is not None and outcome.startswith("refused"), f"{what} was not refused: {outcome}")

    async def w1_address() -> str:
        async with h.client() as client:
            return next(w.worker.peer.address for w in await client.list_workers() if w.worker.peer.node_id == "w1")

    address = h.call("list workers", w1_address)
    return h.check(ok and address is not None and address != forged.peer.address,
                   f"w1 is registered at {address}")


def last_line(text: str, limit: int = 160) -> str:
    """The last line of ``text`` (a process's one-line error, after any warnings), cut to ``limit`` characters
    with "..." where longer: it reads from its start."""
    lines = text.strip().splitlines()
    line = lines[-1] if lines else ""
    return line if len(line) <= limit else f"{line[:limit]}..."


def symlinked_checkpoint(h: Harness, ctx: Context) -> bool:
    """Finding 6: a checkpoint whose tokenizer.json is a symlink to a secret outside it: `pipecast pack`
    refuses it by name and leaves no package behind."""
    source = ctx.package.parent / f"{ctx.package.name}-checkpoint"
    checkpoint, out, secret = h.folder / "checkpoint", h.folder / "packed", h.folder / "secret.txt"
    checkpoint.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(source / name, checkpoint / name)
    secret.write_text("a credential that must never be multicast\n")
    (checkpoint / "tokenizer.json").symlink_to(secret)
    h.fault("pack a checkpoint whose tokenizer.json is a symlink to a file outside it")
    done = subprocess.run(cli("pack", checkpoint, out, verbose=False), capture_output=True, text=True,
                          timeout=120)
    h.note(f"pipecast pack: exit {done.returncode}: {last_line(done.stderr)}")
    return h.check(done.returncode == 2 and "tokenizer.json" in done.stderr and not out.exists(),
                   "the packager read a file outside the checkpoint or left a package behind")


def unauthenticated_manifest(h: Harness, ctx: Context) -> bool:
    """A raw client with no credentials asks a store agent of a cluster with a token for the manifest:
    it gets nothing."""
    if not _start_cluster(h, ctx, []):
        return False
    store = next(e["address"] for e in h.events(STORE, "listening"))
    h.fault("a raw client with no credentials asks the store for the manifest")
    try:
        got = ctx.loop.run(fetch_manifest_raw(store, ctx.manifest.package_id), 15.0)
    except TimeoutError:
        h.hang("the raw manifest request")
        return False
    h.note(f"unauthenticated manifest request: {got}")
    return h.check(got != "manifest", "an unauthenticated client got the manifest")


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> int:
    """HTTP status of POSTing ``body`` as JSON to ``url`` (0: no answer in time)."""
    req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json", **(headers or {})},
                                 method="POST")
    try:
        with urllib.request.urlopen(req, timeout=15.0) as answer:
            return answer.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, TimeoutError, ConnectionError):
        return 0


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2.0) as answer:
            return answer.status == 200
    except (urllib.error.URLError, TimeoutError, ConnectionError):
        return False


def hostile_json(h: Harness, ctx: Context) -> bool:
    """Findings 3 and 8: ~200 KB of deeply nested JSON to the completions endpoint of a serving worker and
    of the router: 400, not 500; a body over the limit: 413; and both keep serving."""
    package, manifest = ctx.model_package()
    ctx.manifests[manifest.package_id] = manifest
    h.agent("agent", "--seed", package)
    if not h.wait_event("agent", "listening", START_S):
        return False
    serve = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    router = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    h.launch("serve", cli("serve", manifest.package_id, "--agent-socket", h.sockets["agent"], "--host",
                          "127.0.0.1", "--port", serve.rsplit(":", 1)[1], verbose=False),
             env={"OMP_NUM_THREADS": "1"})
    h.launch("router", cli("router", "--host", "127.0.0.1", "--port", router.rsplit(":", 1)[1], "--worker",
                           serve, verbose=False))
    if not all(h.wait_until(f"{url} healthy", lambda url=url: _healthy(url), START_S) for url in (serve, router)):
        return False
    nested = nested_json(ctx.sizes.hostile_bytes)
    # Bare nesting, and nesting inside an otherwise well-formed request (where a handler may recurse).
    bodies = {"nested arrays": nested,
              "a request whose prompt is nested": b'{"model": "m", "max_tokens": 1, "prompt": ' + nested + b"}"}
    # The worker takes requests from its cluster's insiders only (the router presents the key itself): an
    # outsider's hostile body is refused unread, an insider's is parsed and refused.
    insider = serving_headers(serving_key(data_plane_key(h.token)))
    status = _post(f"{serve}/v1/completions", bodies["nested arrays"])
    h.fault("hostile JSON to serve without the cluster's serving key")
    ok = h.check(status == 401, f"serve answered an outsider's request with {status or 'nothing'} (expected 401)")
    for name, url in (("serve", serve), ("router", router)):
        headers = insider if name == "serve" else {}
        for what, body in bodies.items():
            status = _post(f"{url}/v1/completions", body, headers)
            h.fault(f"{len(body) // 1000} KB of {what} to {name}")
            h.note(f"{name}, {what}: {status or 'no answer'}")
            if status == 0:
                h.hang(f"{name} did not answer {what}")
            ok &= h.check(status == 400, f"{name} answered {what} with {status or 'nothing'} (expected 400)")
        big = b'{"model": "m", "max_tokens": 1, "prompt": "' + b"a" * OVERSIZED_BODY_BYTES + b'"}'
        status = _post(f"{url}/v1/completions", big, headers)
        h.fault(f"a {len(big) >> 20} MiB body to {name}")
        h.note(f"{name}, {len(big) >> 20} MiB body: {status or 'no answer'}")
        ok &= h.check(status == 413, f"{name} answered a {len(big) >> 20} MiB body with {status} (expected 413)")
        ok &= h.check(_healthy(url), f"{name} is not healthy after the hostile bodies")
    return ok

