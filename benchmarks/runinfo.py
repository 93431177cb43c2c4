"""What the cluster benchmarks share besides their processes: the versions recorded beside every
figure, the parsing of the count lists their options take, and a report of runs as JSON."""

import platform
from dataclasses import asdict, dataclass, field
from importlib import metadata
from typing import Any, ClassVar, Generic, TypeVar

R = TypeVar("R")


def versions(*distributions: str) -> dict[str, str]:
    """Python, the kernel, pipecast and each named distribution's version ("not installed" if absent)."""
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {"pipecast": version("pipecast"), "python": platform.python_version(), "kernel": platform.release(),
            **{dist: version(dist) for dist in distributions}}


def parse_counts(text: str, option: str, error: type[Exception]) -> tuple[int, ...]:
    """``"1,2,4"`` to ``(1, 2, 4)``: distinct counts >= 1 in the order given; ``error`` names ``option``."""
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise error(f"{option} must be a comma-separated list of counts, got {text!r}") from None
    if any(n < 1 for n in counts) or len(set(counts)) != len(counts):
        raise error(f"{option} must list distinct counts >= 1, got {text!r}")
    return counts


@dataclass
class RunsReport(Generic[R]):
    """A benchmark's metadata and its runs' results; a subclass names its result type and its verdicts."""

    meta: dict
    results: list[R] = field(default_factory=list)
    result_type: ClassVar[type[Any]]

    def verdicts(self) -> list[str]:
        """The report's verdict lines."""
        raise NotImplementedError

    def to_json(self) -> dict:
        return {"meta": self.meta, "results": [asdict(r) for r in self.results], "verdicts": self.verdicts()}

    @classmethod
    def from_json(cls, data: dict) -> "RunsReport[R]":
        """The report a run wrote with ``--json``."""
        return cls(meta=data["meta"], results=[cls.result_type(**r) for r in data["results"]])
