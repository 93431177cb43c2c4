"""Parsing sizes and durations: what a flag accepts, and a typed refusal (ValueError) of anything else."""

import pytest

from pipecast.core.units import parse_duration, parse_size


def test_sizes_and_durations_parse():
    assert parse_size("4MiB") == 4 << 20 and parse_size("1.5GB") == 1_500_000_000 and parse_size("7") == 7
    assert parse_duration("500ms") == 0.5 and parse_duration("5m") == 300.0 and parse_duration("2") == 2.0


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
