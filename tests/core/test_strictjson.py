"""Strict JSON decoding of untrusted input: one typed error for everything that can go wrong."""

import pytest

from pipecast.core.strictjson import JSONInputError, loads, loads_object


@pytest.mark.parametrize("data, message", [
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b"[NaN]", "NaN is not a JSON number"),
    (b"[1e400]", "number 1e400 is out of range"),
    (b"[" * 100_000, "nested too deeply"),
    (b"1" * 5000, "Exceeds the limit"),
    (b'"\\ud800"', "holds a lone surrogate"),
    (b"\xff", "not UTF-8"),
    ('["\udcff"]', "text holds a lone surrogate at 2"),  # text decoded with surrogateescape (an HTTP header)
])
def test_what_json_loads_lets_through_or_raises_otherwise_is_one_typed_error(data, message):
    with pytest.raises(JSONInputError, match=message):
        loads(data)


def test_valid_json_decodes_and_an_object_is_required_where_asked():
    assert loads('{"a": [1, 2.5, "\\ud83d\\ude00", null]}') == {"a": [1, 2.5, "\U0001F600", None]}
    with pytest.raises(JSONInputError, match="expected a JSON object, got"):
        loads_object(b"[1]")
