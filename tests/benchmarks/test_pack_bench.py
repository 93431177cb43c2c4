"""``pipecast bench pack``: its report says what it measured, and its options are checked before it runs."""

from click.testing import CliRunner

from benchmarks.command import bench_group
from benchmarks.pack_bench import PackBenchResult, report


def test_the_verified_open_is_labelled_as_what_the_package_checks():
    """Finding 4: the label said "BLAKE3 of every chunk and of the block"; a good block is hashed once, on all
    cores (packager.package.check_block_bytes), its chunks only when the block is bad."""
    text = report(PackBenchResult(checkpoint_bytes=2 << 30, cp_seconds=4.0, pack_seconds=1.0,
                                  pack_peak_rss_bytes=80 << 20, open_seconds=0.01, open_verified_seconds=0.1,
                                  safetensors_load_seconds=0.01))
    verified = next(line for line in text.splitlines() if line.startswith("open + verify"))
    assert verified.endswith("(BLAKE3 of each block, one pass on all cores)")
    assert "chunk" not in text


def test_a_workdir_that_is_a_file_is_refused_before_anything_runs(tmp_path):
    """Finding 6: `--workdir FILE` was a NotADirectoryError traceback (exit 1) after the option parsing."""
    file = tmp_path / "file"
    file.write_text("")
    result = CliRunner().invoke(bench_group, ["pack", "--size", "1MB", "--repeat", "1", "--workdir", str(file)])
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--workdir': Directory '{file}' is a file." in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]
