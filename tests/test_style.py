"""The source tree's line length: at most ``MAX_LINE`` characters as the code is written (the generated
protobuf code aside), so that no line hides past the edge of a reviewer's window."""

from collections.abc import Iterator
from pathlib import Path

from tests.support import REPO
from tests.test_layers import SOURCE_DIRS

MAX_LINE = 120


def _written_sources() -> Iterator[Path]:
    for top in SOURCE_DIRS:
        for path in sorted((REPO / top).rglob("*.py")):
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")):
                yield path


def test_no_source_line_is_longer_than_the_limit():
    long = [f"{path.relative_to(REPO)}:{number}: {len(line)} characters" for path in _written_sources()
            for number, line in enumerate(path.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert long == []
