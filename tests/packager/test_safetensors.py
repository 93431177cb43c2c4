"""The safetensors header parser on hostile bytes: it returns a header or raises SafetensorsFormatError,
whatever the input (issue #12, finding 3; fuzzed with hypothesis)."""

import json
import os
import struct

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from packager.errors import SafetensorsFormatError
from packager.safetensors_format import build_header, parse_header, read_header

FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def container(header: bytes | str, data: bytes = b"") -> bytes:
    """A safetensors file: the length prefix, ``header`` as given, then ``data``."""
    body = header.encode() if isinstance(header, str) else header
    return struct.pack("<Q", len(body)) + body + data


def parse(blob: bytes):
    return parse_header(blob, len(blob), "fuzz.safetensors")


def valid_file() -> bytes:
    header, _ = build_header([("a", "F32", (2, 3), 24), ("b", "BF16", (5,), 10), ("c", "U8", (), 1)],
                             {"format": "pt"})
    return header + bytes(range(35))


def test_a_valid_file_parses():
    parsed = parse(valid_file())
    assert sorted(parsed.tensors) == ["a", "b", "c"] and parsed.metadata == {"format": "pt"}


@pytest.mark.parametrize("header, problem", [
    ("[" * 100_000, "nested too deeply"),                            # RecursionError before
    ('{"a": ' * 50_000 + "1" + "}" * 50_000, "nested too deeply"),
    ('{"a": {"dtype": "F32", "shape": [1e400], "data_offsets": [0, 4]}}', "out of range"),
    ('{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 4]}}', "NaN is not a JSON number"),
    ('{"a": {"dtype": "F32", "shape": [' + "9" * 5000 + '], "data_offsets": [0, 4]}}', "4300 digits"),
    ('{"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}', "unknown dtype"),  # TypeError before
    ('{"a": {"dtype": {}, "shape": [1], "data_offsets": [0, 4]}}', "unknown dtype"),
    ('[{"a": 1}]', "not a JSON object"),
    ('"text"', "not a JSON object"),
    ('{"__metadata__": [], "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}', "__metadata__"),
    ('{"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, "a\\ud800": 1}', "lone surrogate"),
    # Found in review: a product of 400 dimensions of 10**12 went whole into the message (ValueError past 4300
    # digits), and a zero-size tensor with a dimension past int64 was taken, then no reader could build it.
    ('{"a": {"dtype": "F32", "shape": [' + ", ".join(["1000000000000"] * 400) + '], "data_offsets": [0, 4]}}',
     "has more elements than any file holds"),
    ('{"a": {"dtype": "F32", "shape": [0, 9223372036854775808], "data_offsets": [0, 0]}, '
     '"b": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}', "invalid shape"),
])
def test_hostile_json_in_a_header_is_a_typed_error(header, problem):
    """Finding 3: RecursionError, ValueError and TypeError while parsing a header became
    SafetensorsFormatError naming the file."""
    with pytest.raises(SafetensorsFormatError, match=problem) as info:
        parse(container(header, bytes(4)))
    assert "fuzz.safetensors" in str(info.value)


def test_a_tensor_named_twice_is_refused_not_silently_the_last():
    """Finding 3: with json.loads the second entry of a duplicate name won; the header is now refused."""
    header = ('{"w": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}, '
              '"w": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}}')
    with pytest.raises(SafetensorsFormatError, match="duplicate key 'w'"):
        parse(container(header, bytes(4)))


@pytest.mark.timeout(10)
def test_a_fifo_or_a_folder_is_refused_without_hanging(tmp_path):
    os.mkfifo(tmp_path / "fifo.safetensors")  # opening it for reading used to wait for a writer forever
    with pytest.raises(SafetensorsFormatError, match="not a regular file"):
        read_header(tmp_path / "fifo.safetensors")
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(SafetensorsFormatError, match="cannot read|not a regular file"):
        read_header(tmp_path / "dir.safetensors")


def _check(blob: bytes) -> None:
    try:
        parse(blob)
    except SafetensorsFormatError:
        pass


@FUZZ
@given(st.binary(max_size=512))
@example(b"")
@example(struct.pack("<Q", 2) + b"{}")
@example(struct.pack("<Q", 2**64 - 1))
def test_fuzz_random_bytes(blob):
    _check(blob)


@FUZZ
@given(st.binary(min_size=0, max_size=300))
def test_fuzz_random_bytes_as_the_header(body):
    _check(container(body, bytes(16)))


@FUZZ
@given(st.integers(min_value=0, max_value=len(valid_file())))
def test_fuzz_truncated_files(cut):
    _check(valid_file()[:cut])


@FUZZ
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=len(valid_file()) - 1),
                          st.integers(min_value=0, max_value=255)), min_size=1, max_size=8))
def test_fuzz_byte_mutations_of_a_valid_file(flips):
    blob = bytearray(valid_file())
    for offset, value in flips:
        blob[offset] = value
    _check(bytes(blob))


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20)
ENTRY = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "BF16", "U8", "F4", "I64", "F12", ""]) | JSON,
    "shape": st.lists(st.integers(min_value=-2, max_value=2**70), max_size=4) | JSON,
    "data_offsets": st.lists(st.integers(min_value=-2, max_value=2**70), max_size=3) | JSON,
})


@FUZZ
@given(st.dictionaries(st.sampled_from(["a", "b", "__metadata__", "", "x" * 70]), ENTRY | JSON, max_size=4),
       st.integers(min_value=0, max_value=64))
def test_fuzz_structured_headers(header, data_bytes):
    _check(container(json.dumps(header), bytes(data_bytes)))


def test_a_tensor_torch_cannot_view_is_a_typed_error():
    """Review finding 5: a block holding an F4 tensor (from another packer: pack refuses one) raised a bare
    TypeError from every reader."""
    from packager.blockfile import tensors_from_buffer

    header, _ = build_header([("w", "F4", (4, 8), 16)], {})
    with pytest.raises(SafetensorsFormatError) as refused:
        tensors_from_buffer(header + bytes(16), "block.safetensors")
    assert str(refused.value) == ("block.safetensors: invalid safetensors file: tensor 'w' has dtype F4, which torch "
                                  "cannot view")


def test_each_dtype_a_reader_views_is_a_torch_dtype_of_its_size():
    """One table says how large each dtype is and what torch views it as (review finding 5)."""
    import torch

    from packager.safetensors_format import DTYPE_BITS, TORCH_DTYPES

    assert set(DTYPE_BITS) - set(TORCH_DTYPES) == {"F4"}
    for dtype, name in TORCH_DTYPES.items():
        assert getattr(torch, name).itemsize * 8 == DTYPE_BITS[dtype], dtype
