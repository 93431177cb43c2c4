"""The ``/health`` answer: the JSON a worker writes is what the router reads back (the wire format is one type)."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipecast.serve.health import MAX_COUNT, HealthFormatError, WorkerHealth

PARTIAL = WorkerHealth(status="partial", blocks_present=3, blocks_total=8, queue_depth=2, running=1, max_queue=64,
                       max_batch=16, stage="loading_weights", model="tiny-llama", package_id="ab" * 32)


def test_the_answer_has_every_field_in_order_and_error_only_when_there_is_one():
    assert list(PARTIAL.to_json()) == ["status", "blocks_present", "blocks_total", "queue_depth", "running",
                                       "max_queue", "max_batch", "pipeline_sessions", "pipeline_moved", "pipeline_kept",
                                       "stage", "model", "package_id"]
    failed = WorkerHealth("failed", 0, 0, 0, 0, 64, 16, stage="failed", error="cannot load x: gone")
    assert failed.to_json()["error"] == "cannot load x: gone" and failed.to_json()["model"] is None


def test_what_the_worker_writes_reads_back_the_same():
    assert WorkerHealth.from_json(json.loads(json.dumps(PARTIAL.to_json()))) == PARTIAL


@pytest.mark.parametrize("status, code", [("loading", 200), ("partial", 200), ("ready", 200), ("failed", 503),
                                          ("draining", 503)])
def test_a_worker_that_cannot_serve_answers_503(status, code):
    assert WorkerHealth(status, 0, 0, 0, 0, 1).http_status == code


def test_descriptive_fields_that_are_not_text_are_ignored_but_bad_counts_are_refused():
    answer = {**PARTIAL.to_json(), "stage": 7, "model": None}
    assert WorkerHealth.from_json(answer) == WorkerHealth("partial", 3, 8, 2, 1, 64, 16, package_id="ab" * 32)
    with pytest.raises(HealthFormatError, match="field 'running' is 1.5, not a count"):
        WorkerHealth.from_json({**answer, "running": 1.5})


@pytest.mark.parametrize("name", ["queue_depth", "pipeline_moved"])
def test_a_count_beyond_any_real_one_is_refused(name):
    """Found in review: a queue_depth of 2**60 was stored and copied into the router's /stats, which the scaler then
    refused whole (its figures stop at 2**53): every deployment behind that router lost its signals."""
    answer = PARTIAL.to_json()
    assert getattr(WorkerHealth.from_json({**answer, name: MAX_COUNT}), name) == MAX_COUNT
    with pytest.raises(HealthFormatError) as info:
        WorkerHealth.from_json({**answer, name: 2 ** 60})
    assert str(info.value) == f"/health field {name!r} is {2 ** 60}, more than {MAX_COUNT}"


def test_serving_and_room():
    assert PARTIAL.can_serve and not WorkerHealth("loading", 0, 8, 0, 0, 4).can_serve
    assert not WorkerHealth("ready", 8, 8, 4, 0, 4).can_serve  # its own queue is full
    assert PARTIAL.fraction_present == 3 / 8 and WorkerHealth("ready", 0, 0, 0, 0, 4).fraction_present == 1.0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20)


@settings(max_examples=300, deadline=None)
@given(st.fixed_dictionaries({}, optional={name: st.sampled_from(["loading", "partial", "ready"]) | st.integers()
                                           | JSON_VALUES for name in PARTIAL.to_json()}) | JSON_VALUES)
def test_fuzz_any_answer_reads_as_health_or_a_format_error(answer):
    """Issue #12, finding 3: whatever a worker answers (nested hundreds deep included), the router's
    reading of it is a WorkerHealth or HealthFormatError, never another exception."""
    try:
        WorkerHealth.from_json(answer)
    except HealthFormatError:
        pass


def test_a_deeply_nested_status_is_a_format_error():
    nested: list = []
    for _ in range(900):
        nested = [nested]
    with pytest.raises(HealthFormatError, match=r"status \[\[\[\[\.\.\.\]\]\]\] is not one of"):
        WorkerHealth.from_json({"status": nested})
