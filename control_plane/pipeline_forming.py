"""Forming a package's cross-node pipelines for ListPipelines, away from the event loop.

Three steps: the state's part is copied on the event loop (:class:`PipelineQuery`, made by
:meth:`control_plane.state.ControlState.pipeline_query`); where each receiver goes next is found in a thread
(:meth:`PipelineQuery.candidates`, a compact value); the forming (:func:`pipeline_infos`), about a second among
5,000 receivers, runs in a process of its own once the candidates are many (:class:`PipelineFormer`). In a thread
it held the GIL for that second, and the event loop's thread waited for it at every wake-up: with four routers
polling at 5,000 workers the loop stalled 38-69 ms (bench control-plane), of which its own work was ~10 ms.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import pickle
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from control_plane.collector import collector_off
from control_plane.planner.pipelines import ModelLayout, Pipeline, form_pipelines
from control_plane.planner.plan import Fetch
from pipecast.v1 import control_pb2 as pb

log = logging.getLogger(__name__)

#: Candidates (workers holding or receiving the package) from which a forming runs in the former's process:
#: below, in a thread (64 blocks held in rotated quarters: forming among 200 takes ~10 ms, among 1,000 ~70 ms;
#: the candidates to the process and the answer back pickled and unpickled ~1 ms per 200).
PROCESS_FROM = 200
#: The longest a forming may take in the process (5,000 receivers: ~1 s) before it is killed.
FORMING_TIMEOUT_S = 60.0

Formed = list[tuple[Pipeline, pb.PipelineInfo]]


@dataclass(frozen=True)
class PipelineCandidates:
    """What forming a package's pipelines reads, small enough to send to another process: the serve ``urls``
    of the candidate workers (those holding or receiving the package), the ``verified`` blocks of those holding
    some, and for those still receiving it the blocks they hold and those each of their plans sends next."""

    layout: ModelLayout
    urls: Mapping[str, str]
    verified: Mapping[str, frozenset[int]]
    receiving: Mapping[str, tuple[frozenset[int], frozenset[int]]]

    def run(self) -> list[tuple[Pipeline, int]]:
        """The pipelines (:func:`form_pipelines`), each with the number of blocks its stages still wait for.
        Pipelines of verified blocks come first; the workers left then count with the blocks they receive
        next too (a stage waits for its layers, so such a pipeline serves one block earlier, overlapping its
        compute with the transfer)."""
        ready = form_pipelines(self.layout, self.verified)
        taken = {n for p in ready for n in p.nodes}
        ahead = {n: set(b) for n, b in self.verified.items() if n not in taken}
        for node, (have, following) in self.receiving.items():
            if node not in taken and following:
                ahead.setdefault(node, set(have)).update(following)
        waiting = form_pipelines(self.layout, ahead)

        def missing(pipeline: Pipeline) -> int:
            held = {n: self.receiving[n][0] if n in self.receiving else self.verified.get(n, frozenset())
                    for n in pipeline.nodes}
            return sum(len(self.layout.blocks_for(s.start, s.stop) - held[s.node]) for s in pipeline.stages)
        return [(p, 0) for p in ready] + [(p, missing(p)) for p in waiting]


@dataclass(frozen=True)
class PipelineQuery:
    """The cross-node pipelines of one package, as a value: as :class:`PipelineCandidates`, but for those
    still receiving, their fetches in each plan (references to the plans' parts: the copy on the event loop
    stays cheap). Pure, so it may run in a thread."""

    layout: ModelLayout
    urls: Mapping[str, str]
    verified: Mapping[str, frozenset[int]]
    receiving: Mapping[str, tuple[frozenset[int], tuple[tuple[Fetch[str], ...], ...]]]

    def candidates(self) -> PipelineCandidates:
        """Where each receiver goes next: the first block of each of its fetch lists that it does not hold."""
        receiving = {}
        for node, (have, fetches) in self.receiving.items():
            following = (next((f.block for f in fetch if f.block not in have), None) for fetch in fetches)
            receiving[node] = (have, frozenset(b for b in following if b is not None))
        urls = {n: self.urls[n] for n in self.verified.keys() | receiving.keys()}
        return PipelineCandidates(self.layout, urls, self.verified, receiving)

    def run(self) -> list[tuple[Pipeline, int]]:
        """:meth:`PipelineCandidates.run` of :meth:`candidates`."""
        return self.candidates().run()


def pipeline_infos(package_id: str, candidates: PipelineCandidates) -> Formed:
    """The pipelines of ``candidates``, each with its ListPipelines message."""
    return [(pipeline, pb.PipelineInfo(
        package_id=package_id, waiting_blocks=waiting,
        bottleneck_layers=max(pipeline.stage_costs(candidates.layout)),
        stages=[pb.PipelineStage(node_id=s.node, serve_url=candidates.urls[s.node], layer_start=s.start,
                                 layer_end=s.stop) for s in pipeline.stages]))
            for pipeline, waiting in candidates.run()]


class PipelineFormer:
    """Forms pipelines off the event loop: in a thread for fewer than ``process_from`` candidates, else in a
    process of its own (``python -m control_plane.pipeline_forming``: a new interpreter, not a fork of the control
    plane's gRPC threads, nor a re-run of its main module), started at the first such forming and kept until
    :meth:`close`, one forming at a time. A process that fails or takes over ``timeout_s`` is killed and started
    again next time; that forming is done in a thread."""

    def __init__(self, process_from: int = PROCESS_FROM, timeout_s: float = FORMING_TIMEOUT_S) -> None:
        self.process_from, self.timeout_s = process_from, timeout_s
        self._child: asyncio.subprocess.Process | None = None
        self._turn = asyncio.Lock()

    async def form(self, package_id: str, query: PipelineQuery) -> Formed:
        """The pipelines of ``query`` with their messages (:func:`pipeline_infos`)."""
        candidates = await asyncio.to_thread(collector_off, query.candidates)
        if len(candidates.urls) >= self.process_from:
            try:
                return await self._in_process(package_id, candidates)
            except (OSError, EOFError, TimeoutError, pickle.UnpicklingError) as exc:  # EOF: IncompleteReadError too
                log.warning("pipeline forming process failed (%s: %s): forming package=%s in a thread",
                            type(exc).__name__, exc, package_id)
        return await asyncio.to_thread(collector_off, functools.partial(pipeline_infos, package_id, candidates))

    async def _in_process(self, package_id: str, candidates: PipelineCandidates) -> Formed:
        request = await asyncio.to_thread(pickle.dumps, (package_id, candidates), pickle.HIGHEST_PROTOCOL)
        async with self._turn:
            if self._child is None or self._child.returncode is not None:
                self._child = await asyncio.create_subprocess_exec(
                    sys.executable, "-m", __name__, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                    env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
                log.info("pipeline forming process started pid=%d", self._child.pid)
            child = self._child
            assert child.stdin is not None and child.stdout is not None
            try:
                async with asyncio.timeout(self.timeout_s):
                    child.stdin.write(_framed(request))
                    await child.stdin.drain()
                    answer = await child.stdout.readexactly(int.from_bytes(await child.stdout.readexactly(8)))
            except BaseException:  # a request half-answered leaves the pipes out of step: start afresh
                await self.close()
                raise
        return await asyncio.to_thread(pickle.loads, answer)

    async def close(self) -> None:
        """Stop the forming process, if any."""
        child, self._child = self._child, None
        if child is not None and child.returncode is None:
            child.kill()
            await child.wait()


def _framed(data: bytes) -> bytes:
    return len(data).to_bytes(8) + data


def main() -> None:
    """The forming process: (package id, :class:`PipelineCandidates`) in on stdin, :func:`pipeline_infos` out on
    stdout, each pickled after its length; until stdin closes."""
    requests, answers = sys.stdin.buffer, sys.stdout.buffer
    while header := requests.read(8):
        package_id, candidates = pickle.loads(requests.read(int.from_bytes(header)))
        answers.write(_framed(pickle.dumps(collector_off(functools.partial(pipeline_infos, package_id, candidates)),
                                           pickle.HIGHEST_PROTOCOL)))
        answers.flush()


if __name__ == "__main__":
    main()
