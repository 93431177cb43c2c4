"""The image recipe (deploy/docker/Dockerfile), checked without building it (no registry here serves base
images): hadolint finds nothing, and, read with BuildKit's own parser (the `dockerfile` package), it installs
what pyproject.toml pins, copies every package the wheel holds, and runs `pipecast` as the chart's user."""

import fnmatch
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import dockerfile
import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.support import REPO
from tests.support.helm import containers, pod_spec, render

DOCKERFILE = REPO / "deploy" / "docker" / "Dockerfile"
IGNORE = DOCKERFILE.with_name("Dockerfile.dockerignore")  # BuildKit reads <Dockerfile>.dockerignore first
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
README = (REPO / "README.md").read_text()
INSTALL = {"auth": {"masterToken": "m", "routerToken": "r", "nodeTokens": {"store": "s"}}, "serve": {"package": "p"}}


@pytest.fixture(scope="module")
def steps() -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DOCKERFILE)))


def of(steps: list[dockerfile.Command], cmd: str) -> list[dockerfile.Command]:
    return [s for s in steps if s.cmd == cmd]


def test_hadolint_finds_nothing():
    done = subprocess.run([Path(sys.executable).parent / "hadolint", "--no-color", "--failure-threshold", "style",
                           DOCKERFILE], capture_output=True, text=True)
    assert done.returncode == 0 and not done.stdout, done.stdout + done.stderr


def test_the_base_is_the_python_the_project_requires(steps):
    [base] = of(steps, "FROM")
    image, _, tag = base.value[0].partition(":")
    assert image == "python" and tag.endswith("-slim")
    assert tag.removesuffix("-slim") in SpecifierSet(PYPROJECT["project"]["requires-python"])


def test_it_installs_the_pinned_torch_then_pipecast_with_extras_pyproject_has(steps):
    [torch] = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch==")]
    runs = " ".join(" ".join(" ".join(s.value) for s in of(steps, "RUN")).split())  # continuations leave spaces
    assert f'pip install --index-url "${{TORCH_INDEX}}" {torch} && pip install "/src[${{EXTRAS}}]"' in runs
    args = dict(s.value[0].split("=", 1) for s in of(steps, "ARG"))
    assert args["TORCH_INDEX"].endswith("/whl/cpu")  # the CPU build by default; the README says how to take CUDA's
    # The UCX transport and PostgreSQL (values-ha.yaml's control plane), as pyproject names them.
    assert args["EXTRAS"].split(",") == ["ucx", "postgres"]
    assert {"ucx", "postgres"} <= set(PYPROJECT["project"]["optional-dependencies"])


def test_it_copies_every_package_the_wheel_holds_and_the_context_keeps_them(steps):
    copied = {source.rstrip("/").removeprefix("./") for s in of(steps, "COPY") for source in s.value[:-1]}
    packages = {p.rstrip("*") for p in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]}
    assert packages | {"pyproject.toml", "README.md"} == copied
    kept = [line[1:].rstrip("/") for line in IGNORE.read_text().splitlines() if line.startswith("!")]
    for source in copied:
        assert (REPO / source).exists() and any(fnmatch.fnmatch(source, k) for k in kept), source


def test_it_runs_pipecast_as_the_user_the_chart_runs_as(steps):
    uid = of(steps, "USER")[-1].value[0].split(":")[0]
    assert uid != "0" and f"--uid {uid}" in " ".join(of(steps, "RUN")[-1].value)
    manifests = render((), INSTALL)
    assert {pod_spec(m)["securityContext"]["runAsUser"] for m in manifests if pod_spec(m)} == {int(uid)}
    [entrypoint] = of(steps, "ENTRYPOINT")
    assert entrypoint.json and entrypoint.value == ("pipecast",) and "pipecast" in PYPROJECT["project"]["scripts"]
    # The chart's default images are this version's builds: the CUDA one for the agents' pods, which serve on cuda.
    version = PYPROJECT["project"]["version"]
    for manifest, container in containers(manifests):
        cuda = "-cuda" if manifest["metadata"]["name"] == "pipecast-agent" else ""
        assert container["image"] == f"pipecast:{version}{cuda}", container["name"]


def test_the_readme_builds_it_as_the_dockerfile_says():
    def builds(text: str) -> set[str]:
        """Its `docker build` commands, continued lines joined (in comments too), spaces collapsed."""
        text = re.sub(r"\\\n[#\s]*", " ", text)
        return {" ".join(line.lstrip("# ").split()) for line in text.splitlines() if "docker build -f" in line}

    commands = builds(DOCKERFILE.read_text())
    assert len(commands) == 2 and commands <= builds(README)  # the CPU image and the CUDA one


def test_the_build_backend_reads_the_license_as_pyproject_writes_it():
    """Found in review: `license = "Apache-2.0"` (an SPDX string) needs setuptools 77, but the build asked for 68."""
    assert isinstance(PYPROJECT["project"]["license"], str)
    [setuptools] = [Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    floors = [Version(s.version) for s in setuptools.specifier if s.operator in (">=", "==", "~=")]
    assert floors and max(floors) >= Version("77")
