"""Trace files, windows, time scaling, caps and synthetic loads of ``pipecast bench surge`` (pure)."""


import pytest

from benchmarks.command import SURGE_TRACE
from benchmarks.surge.trace import (
    PEAK_WINDOW_S,
    ScheduledRequest,
    TokenCaps,
    Trace,
    TraceError,
    TraceRecord,
    Window,
    parse_synthetic,
    parse_timestamp,
    parse_trace,
    prompt_token_ids,
    read_trace,
    repeat_surges,
    replay_schedule,
    schedule_facts,
    synthetic_schedule,
)

AZURE = SURGE_TRACE  # ../shared beside the repository (parents[2] was the tests folder: always skipped)
CAPS = TokenCaps(prompt_tokens=64, output_tokens=8)


def trace_of(*rows: tuple[float, int, int]) -> Trace:
    return Trace("test", tuple(TraceRecord(t, c, g) for t, c, g in rows))


def test_azure_timestamps_keep_their_sub_microsecond_digits():
    a = parse_timestamp("2023-11-16 18:15:46.6805900", "x")
    b = parse_timestamp("2023-11-16 18:15:50.9951695", "x")
    assert b - a == pytest.approx(4.3145795, abs=1e-6)
    assert parse_timestamp("2023-11-16T18:15:46Z", "x") == parse_timestamp("2023-11-16 18:15:46", "x")
    assert parse_timestamp("2023-11-16 19:15:46+01:00", "x") == parse_timestamp("2023-11-16 18:15:46", "x")
    assert parse_timestamp(" 12.5 ", "x") == 12.5


def test_a_bad_timestamp_names_its_line():
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens", "2023-11-16 18:15:46,10,2", "yesterday,5,1"]
    with pytest.raises(TraceError, match=r"^t\.csv, line 3: TIMESTAMP 'yesterday' is neither a date-time"):
        parse_trace(lines, "t.csv")


def test_a_file_without_the_columns_is_refused_naming_them():
    with pytest.raises(TraceError, match=r"^t\.csv: not a trace: no column\(s\) GeneratedTokens"):
        parse_trace(["TIMESTAMP,ContextTokens", "1,2"], "t.csv")


def test_negative_or_fractional_token_counts_are_refused():
    with pytest.raises(TraceError, match=r"line 2: ContextTokens -3 is negative"):
        parse_trace(["TIMESTAMP,ContextTokens,GeneratedTokens", "1,-3,2"], "t.csv")
    with pytest.raises(TraceError, match=r"line 2: GeneratedTokens '2.5' is not a whole number"):
        parse_trace(["TIMESTAMP,ContextTokens,GeneratedTokens", "1,3,2.5"], "t.csv")


def test_rows_are_sorted_and_offsets_start_at_zero_and_extra_columns_are_ignored():
    trace = parse_trace(["id,GeneratedTokens,TIMESTAMP,ContextTokens", "a,1,10.5,100", "b,2,10.0,200",
                         "c,3,12.0,300"], "t.csv")
    assert [(r.offset_s, r.context_tokens, r.generated_tokens) for r in trace.records] == [
        (0.0, 200, 2), (0.5, 100, 1), (2.0, 300, 3)]
    assert trace.duration_s == 2.0


def test_an_empty_trace_and_an_unreadable_file_are_errors(tmp_path):
    with pytest.raises(TraceError, match="holds no requests"):
        parse_trace(["TIMESTAMP,ContextTokens,GeneratedTokens"], "t.csv")
    with pytest.raises(TraceError, match=r"^cannot read trace .*missing\.csv"):
        read_trace(tmp_path / "missing.csv")
    binary = tmp_path / "b.csv"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="not a text CSV file"):
        read_trace(binary)


def test_window_start_duration_and_count_select_whichever_ends_first():
    trace = trace_of(*[(float(t), 10, 2) for t in range(10)])
    assert [r.at_s for r in replay_schedule(trace, Window(start_s=2, duration_s=3), 1.0, CAPS)] == [0.0, 1.0, 2.0]
    assert len(replay_schedule(trace, Window(start_s=2, duration_s=30, requests=4), 1.0, CAPS)) == 4
    assert len(replay_schedule(trace, Window(start_s=2, duration_s=2, requests=4), 1.0, CAPS)) == 2
    assert len(replay_schedule(trace, Window(), 1.0, CAPS)) == 10
    with pytest.raises(TraceError, match=r"no request in the window from 20 s, 5 s \(the trace spans 9.0 s\)"):
        replay_schedule(trace, Window(start_s=20, duration_s=5), 1.0, CAPS)


def test_the_surge_starts_with_the_windows_first_request_and_time_is_scaled():
    trace = trace_of((0.0, 1, 1), (4.0, 1, 1), (5.0, 1, 1), (9.0, 1, 1))
    schedule = replay_schedule(trace, Window(start_s=3), 0.5, CAPS)
    assert [(r.index, r.at_s) for r in schedule] == [(0, 0.0), (1, 0.5), (2, 2.5)]
    with pytest.raises(TraceError, match="time scale must be > 0"):
        replay_schedule(trace, Window(), 0.0, CAPS)


def test_caps_cut_lengths_and_keep_the_trace_values():
    trace = trace_of((0.0, 1000, 300), (1.0, 12, 3), (2.0, 0, 0))
    schedule = replay_schedule(trace, Window(), 1.0, CAPS)
    assert [(r.prompt_tokens, r.max_tokens) for r in schedule] == [(64, 8), (12, 3), (1, 1)]
    assert (schedule[0].trace_prompt_tokens, schedule[0].trace_output_tokens) == (1000, 300)


def test_bad_windows_and_caps_are_refused():
    with pytest.raises(TraceError, match="start must be >= 0"):
        Window(start_s=-1)
    with pytest.raises(TraceError, match="duration must be > 0"):
        Window(duration_s=0)
    with pytest.raises(TraceError, match="request count must be >= 1"):
        Window(requests=0)
    with pytest.raises(TraceError, match="token caps must be >= 1"):
        TokenCaps(0, 4)


def test_synthetic_step_and_burst():
    step = synthetic_schedule(parse_synthetic("step:rate=4,duration=2.5"), CAPS)
    assert [r.at_s for r in step] == [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.25]
    assert {(r.prompt_tokens, r.max_tokens) for r in step} == {(64, 8)}
    burst = synthetic_schedule(parse_synthetic("burst:requests=5,spread=2"), CAPS)
    assert [r.at_s for r in burst] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert [r.at_s for r in synthetic_schedule(parse_synthetic("burst:requests=3"), CAPS)] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("text, message", [
    ("ramp:rate=1", "kind must be one of step, burst"),
    ("step:rate=4", "a step needs rate > 0 and duration > 0"),
    ("step:rate=x,duration=1", "rate='x' is not a number"),
    ("burst:count=4", "with keys rate, duration, requests, spread, got 'count=4'"),
    ("burst:requests=0", "a burst needs requests >= 1"),
])
def test_bad_synthetic_loads_are_refused(text, message):
    with pytest.raises(TraceError, match=message):
        parse_synthetic(text)


def test_schedule_facts_count_the_peak_over_a_sliding_window():
    times = [0.0, 0.1, 0.2, 5.0, 30.0, 30.5, 31.0, 31.5, 32.0]
    schedule = [ScheduledRequest(i, t, 10, 2, 10, 2) for i, t in enumerate(times)]
    facts = schedule_facts(schedule)
    assert facts.requests == 9 and facts.duration_s == 32.0
    assert facts.mean_rate_per_s == 8 / 32.0  # nine requests, eight gaps (found in review: 9 / 32)
    assert facts.peak_rate_per_s == 5 / PEAK_WINDOW_S
    assert (facts.prompt_tokens, facts.max_output_tokens) == (90, 18)


def test_prompts_are_deterministic_per_request_and_within_the_vocabulary():
    request = ScheduledRequest(7, 0.0, 20, 4, 20, 4)
    ids = prompt_token_ids(request, vocab_size=50, seed=3)
    assert len(ids) == 20 and all(0 <= t < 50 for t in ids)
    assert ids == prompt_token_ids(request, vocab_size=50, seed=3)
    assert ids != prompt_token_ids(ScheduledRequest(8, 0.0, 20, 4, 20, 4), vocab_size=50, seed=3)


@pytest.mark.skipif(not AZURE.is_file(), reason="the shared Azure trace is not here")
def test_the_azure_conversation_trace_reads_whole():
    trace = read_trace(AZURE)
    assert len(trace.records) == 19366
    assert 3400 < trace.duration_s < 3600
    schedule = replay_schedule(trace, Window(requests=100), 1.0, CAPS)
    assert len(schedule) == 100 and schedule[0].at_s == 0.0
    assert all(r.prompt_tokens <= 64 and r.max_tokens <= 8 for r in schedule)


def test_repeated_surges_are_spaced_by_the_quiet_period_and_renumbered():
    one = tuple(ScheduledRequest(i, t, 8, 2, 8, 2) for i, t in enumerate((0.0, 1.0, 3.0)))
    twice = repeat_surges(one, 2, 10.0)
    assert [r.at_s for r in twice] == [0.0, 1.0, 3.0, 13.0, 14.0, 16.0]
    assert [r.index for r in twice] == list(range(6))
    with pytest.raises(TraceError, match="surges must be >= 1 and the quiet period >= 0 s, got 0 and 1.0"):
        repeat_surges(one, 0, 1.0)
