"""``pipecast bench``: the benchmarks. Each prints its result beside its floor and its baseline."""

import json
import tempfile
from pathlib import Path

import click

from control_plane.command import bench_command as control_plane_bench
from packager.command import SIZE


@click.group("bench")
def bench_group():
    """Benchmarks; each prints measured / floor and the baseline, measured in the same run."""


bench_group.add_command(control_plane_bench, "control-plane")


@bench_group.command("pack")
@click.option("--size", type=SIZE, default="2GB", show_default=True, help="Synthetic checkpoint size.")
@click.option("--workdir", type=click.Path(path_type=Path), help="Scratch folder (default: a temp dir).")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--json", "json_path", type=click.Path(path_type=Path), help="Write the figures as JSON.")
def bench_pack(size, workdir, repeat, json_path):
    """Pack throughput vs cp, peak RSS, and block-open throughput vs safetensors."""
    from benchmarks import pack_bench

    with tempfile.TemporaryDirectory(prefix="pipecast-bench-") as tmp:
        result = pack_bench.run(Path(workdir or tmp), size, repeat, progress=lambda m: click.echo(m, err=True))
    click.echo(pack_bench.report(result))
    if json_path:
        Path(json_path).write_text(json.dumps(pack_bench.to_json(result), indent=2))
