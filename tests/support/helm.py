"""The Helm chart (deploy/helm/pipecast) rendered by a real helm: :func:`render` gives its manifests.

helm comes from ``make deploy-tools`` (deploy/helm/install_helm.py) into the virtual environment's bin
folder; the tests fail, saying so, where it is missing.
"""

import json
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import yaml

from tests.support import REPO

CHART = REPO / "deploy" / "helm" / "pipecast"
RELEASE, NAMESPACE = "pipecast", "default"
SETUPS = ("values-single-node.yaml", "values-ha.yaml", "values-mtls.yaml")


class HelmError(AssertionError):
    """helm refused the chart or its values; the message is its own."""


def helm_binary() -> str:
    """The helm of the virtual environment (make deploy-tools), else one on PATH."""
    beside = Path(sys.executable).parent / "helm"
    found = str(beside) if beside.is_file() else shutil.which("helm")
    if found is None:
        raise AssertionError("helm is not installed: run `make deploy-tools`")
    return found


def helm(*args: str | Path) -> str:
    """Run ``helm ARGS``; its standard output, or :class:`HelmError` with what it printed."""
    done = subprocess.run([helm_binary(), *map(str, args)], capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise HelmError(done.stderr.strip() or done.stdout.strip())
    return done.stdout


def value_args(files: tuple[str, ...], values: dict, folder: Path) -> list[str]:
    """``--values`` arguments: the chart's ``files`` in order, then ``values`` (as a file: JSON is YAML)."""
    extra = folder / "values.json"
    extra.write_text(json.dumps(values))
    return [arg for name in (*files, extra) for arg in ("--values", str(CHART / name))]


def render(files: tuple[str, ...] = (), values: dict | None = None, *extra: str) -> list[dict]:
    """``helm template`` of the chart with the values files ``files`` (names in the chart's folder), then
    ``values``: every manifest, parsed."""
    with tempfile.TemporaryDirectory() as folder:
        out = helm("template", RELEASE, CHART, "--namespace", NAMESPACE,
                   *value_args(files, values or {}, Path(folder)), *extra)
    return [doc for doc in yaml.safe_load_all(out) if doc]


def lint(files: tuple[str, ...], values: dict) -> str:
    """``helm lint --strict`` of the chart with these values; its output."""
    with tempfile.TemporaryDirectory() as folder:
        return helm("lint", "--strict", CHART, *value_args(files, values, Path(folder)))


def pod_spec(manifest: dict) -> dict | None:
    """The pod template's spec of a workload manifest (None for other kinds)."""
    template = manifest.get("spec", {}).get("template")
    return template["spec"] if template else None


def containers(manifests: list[dict], init: bool = True) -> Iterator[tuple[dict, dict]]:
    """(workload manifest, container) for every container of every workload, init containers too if ``init``."""
    for manifest in manifests:
        spec = pod_spec(manifest)
        if spec is not None:
            for container in [*(spec.get("initContainers", []) if init else []), *spec["containers"]]:
                yield manifest, container


def workload(manifests: list[dict], kind: str, name: str) -> dict:
    """The one manifest of ``kind`` named ``name``."""
    [found] = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"] == name]
    return found
