"""Click commands for the packager: ``pack``, ``verify``, ``inspect``."""

import time
from pathlib import Path

import click

from packager.gguf_convert import convert_gguf
from packager.manifest import manifest_to_json, read_manifest
from packager.mlflow_source import source_checkpoint
from packager.pack import check_pack_arguments, pack
from packager.verify import verify_package
from pipecast.core.progress import Progress
from pipecast.core.units import format_bytes, parse_size


class SizeParam(click.ParamType):
    """A byte size such as 64MB or 4MiB."""

    name = "size"

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        try:
            return parse_size(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


SIZE = SizeParam()


@click.command("pack")
@click.argument("src")
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--layers-per-block", type=click.IntRange(min=1), help="Layers per block.")
@click.option("--block-bytes", type=SIZE, help="Target block size, e.g. 64MB (whole layers per block).")
@click.option("--chunk-bytes", type=SIZE, default="1MiB", show_default=True,
              help="Chunk size of the per-chunk digests (the unit peers verify).")
@click.option("--name", "model_name", help="Model name recorded in the manifest (default: config.json's "
              "_name_or_path, else the repository of a Hugging Face cache snapshot, else SRC's folder name).")
@click.option("--force", is_flag=True, help="Replace OUT if it exists (a package or an empty folder: another "
              "folder is refused).")
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
@click.option("--mlflow-uri", metavar="URI",
              help="MLflow tracking server of a models:/ or runs:/ SRC (default: $MLFLOW_TRACKING_URI).")
def pack_command(src, out, layers_per_block, block_bytes, chunk_bytes, model_name, force, as_json, mlflow_uri):
    """Pack the Hugging Face checkpoint folder SRC into the block package OUT.

    SRC may be in MLflow instead (extra: mlflow): models:/NAME/VERSION or models:/NAME@ALIAS (a registered
    model version, named NAME in the manifest unless --name says) or runs:/RUN_ID/PATH (a run's artifacts).

    By default each block holds ceil(layers / 32) layers: at most 32 blocks (one layer a block up to 32 layers),
    the last may hold fewer; pipelines across nodes need blocks that small.
    """
    if layers_per_block and block_bytes:
        raise click.UsageError("give --layers-per-block or --block-bytes, not both")
    # before an MLflow SRC is downloaded, which may take long
    check_pack_arguments(out, chunk_bytes=chunk_bytes, overwrite=force)
    start = time.perf_counter()
    # An MLflow SRC is downloaded first, into a temporary folder beside OUT removed when the pack ends.
    with source_checkpoint(src, scratch=out.parent, mlflow_uri=mlflow_uri) as checkpoint:
        # A bar on a terminal, else a line per block; --json prints the manifest alone.
        with Progress() if as_json else Progress.on_stderr(lambda line: click.echo(line, err=True)) as progress:
            manifest = pack(checkpoint.folder, out, layers_per_block=layers_per_block, block_bytes=block_bytes,
                            chunk_bytes=chunk_bytes, model_name=model_name or checkpoint.name, overwrite=force,
                            progress=progress, source=checkpoint.source)
    if as_json:
        click.echo(manifest_to_json(manifest), nl=False)
        return
    seconds = time.perf_counter() - start
    click.echo(f"packed {out}: {len(manifest.blocks)} blocks, {format_bytes(manifest.total_bytes)} in "
               f"{seconds:.1f} s; package id {manifest.package_id}")


@click.command("verify")
@click.argument("package", type=click.Path(path_type=Path))
def verify_command(package):
    """Re-hash every block, chunk and file of PACKAGE; exit 1 naming each bad one."""
    with Progress.on_stderr() as progress:
        problems = verify_package(package, progress)
    for problem in problems:
        click.echo(f"BAD {problem}", err=True)
    if problems:
        click.echo(f"{package}: {len(problems)} problem(s)", err=True)
        raise click.exceptions.Exit(1)
    click.echo(f"{package}: OK")


@click.command("inspect")
@click.argument("package", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the manifest as JSON.")
def inspect_command(package, as_json):
    """Print PACKAGE's blocks, layer ranges, sizes and digests."""
    manifest = read_manifest(package)
    if as_json:
        click.echo(manifest_to_json(manifest), nl=False)
        return
    click.echo(format_table(manifest))


def format_table(manifest) -> str:
    """A human-readable summary of a manifest."""
    lines = [
        f"package   {manifest.package_id}",
        f"model     {manifest.model_name} ({manifest.architecture}, {manifest.model_type})",
        f"layers    {manifest.num_layers}, dtypes {', '.join(manifest.dtypes)}, "
        f"tied embeddings: {'yes' if manifest.tied_embeddings else 'no'}",
        f"size      {format_bytes(manifest.total_bytes)} in {len(manifest.blocks)} blocks "
        f"({manifest.digest_algorithm} digests)",
        *([f"source    {manifest.source.uri} (version {manifest.source.version or '-'}, run "
           f"{manifest.source.run_id or '-'})"] if manifest.HasField("source") else []),
        "",
        f"{'block':>5}  {'layers':>9}  {'size':>11}  {'tensors':>7}  {'chunks':>6}  digest",
    ]
    for b in manifest.blocks:
        layers = f"{b.layer_start}-{b.layer_end - 1}"
        lines.append(f"{b.index:>5}  {layers:>9}  {format_bytes(b.bytes):>11}  {len(b.tensor_names):>7}  "
                     f"{len(b.chunk_digests):>6}  {b.digest[:16]}")
    if manifest.files:
        lines += ["", "files     " + ", ".join(f.path for f in manifest.files)]
    return "\n".join(lines)


@click.command("convert-gguf")
@click.argument("gguf", type=click.Path(path_type=Path))
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16",
              show_default=True)
@click.option("--force", is_flag=True, help="Replace OUT if it exists (a checkpoint folder, holding config.json, "
              "or an empty folder: another folder is refused).")
def convert_gguf_command(gguf, out, dtype, force):
    """Dequantize the GGUF model file GGUF into a safetensors checkpoint folder OUT (extra: convert)."""
    with Progress.on_stderr() as progress:
        converted = convert_gguf(gguf, out, dtype=dtype, overwrite=force, progress=progress)
    click.echo(f"converted {converted}")
