"""The control-plane benchmark's short form against a real server subprocess."""

from benchmarks import control_plane_bench as bench


def test_bench_short_form_runs_against_a_server_subprocess():
    result = bench.run(workers=20, blocks=4, duration_s=0.5, repeat=1)
    load = result.load
    assert [p.strategy for p in result.planning] == ["binomial", "rotated"]
    assert load.blocks_reported == load.reports > 0
    assert load.alive_at_end == 20 and load.heartbeat_failures == 0
    assert load.plan_cancelled_streams == 20  # every worker reported the first package: its plan ended
    assert "block reports:" in bench.report(result)


def test_bench_short_form_runs_against_a_server_on_postgresql(postgres_server):
    url = postgres_server.database()
    result = bench.run(workers=20, blocks=4, duration_s=0.5, repeat=1, db=url)
    assert result.load.alive_at_end == 20 and result.load.blocks_reported > 0
    assert "server in a subprocess with PostgreSQL postgresql://pipecast:***@" in bench.report(result)
