"""Parsing sizes and durations: what a flag accepts, and a typed refusal (ValueError) of anything else."""

import pytest

from pipecast.core.units import parse_duration, parse_size


def test_sizes_and_durations_parse():
    assert parse_size("4MiB") == 4 << 20 and parse_size("1.5GB") == 1_500_000_000 and parse_size("7") == 7
    assert parse_duration("500ms") == 0.5 and parse_duration("5m") == 300.0 and parse_duration("2") == 2.0
    # Found in review: a large GPU host's --memory 1TiB was "not a size" (1024GiB was one).
    assert parse_size("1TiB") == 1 << 40 and parse_size("2TB") == 2 * 1000**4


def test_a_number_too_large_for_a_float_is_refused_with_a_value_error():
    """Finding 9: parse_size raised OverflowError (a raw traceback from ``pack --block-bytes 999...``) and
    parse_duration returned inf."""
    huge = "9" * 400
    with pytest.raises(ValueError, match=f"^size is too large: '{huge}'$"):
        parse_size(huge)
    with pytest.raises(ValueError, match=f"^size is too large: '{huge}KiB'$"):
        parse_size(f"{huge}KiB")
    with pytest.raises(ValueError, match=f"^duration is too long: '{huge}h'$"):
        parse_duration(f"{huge}h")


def test_sizes_parse_exactly():
    """Found in review: parse_size went through a float: '18446744073709551615' (a uint64's maximum, the largest
    chunk size) became 2**64 and was refused, and 9007199254740993 became 9007199254740992."""
    assert parse_size("18446744073709551615") == 2**64 - 1 and parse_size("9007199254740993") == 2**53 + 1
    assert parse_size("4611686018427387905KiB") == (2**62 + 1) * 1024
    assert parse_size("1.0000000000000000001KiB") == 1024 and parse_size("0.0009765625KiB") == 1
    with pytest.raises(ValueError, match="^size must be positive: '0.0{5000}1GiB'$"):
        parse_size(f"0.{'0' * 5000}1GiB")  # thousands of digits: no int() limit, no rounding up


@pytest.mark.parametrize("text", ["1.5b", "1.9", "0.5"])
def test_a_fraction_of_a_byte_is_no_size(text):
    """Found in review: '1.5b' and '1.9' were taken as 1 byte, and '0.5' refused as not positive."""
    with pytest.raises(ValueError, match=f"^not a whole number of bytes: {text!r}$"):
        parse_size(text)
