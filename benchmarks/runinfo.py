"""What the cluster benchmarks share besides their processes: the versions recorded beside every
figure, and the parsing of the count lists their options take."""

import platform
from importlib import metadata


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
