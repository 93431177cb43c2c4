"""What this node is, as it registers: its accelerator (probed without torch) and its reachable address."""

import logging
import shutil
import socket
import subprocess

from control_plane.messages import AcceleratorInfo
from pipecast.agent.transport.base import split_address

log = logging.getLogger(__name__)

NVIDIA_SMI_TIMEOUT_S = 5.0
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def detect_accelerator(device: str) -> AcceleratorInfo:
    """What this node computes on, for the registration: ``device`` is the engine's setting ("cpu",
    "cuda", "cuda:1"); CUDA devices are described by ``nvidia-smi`` (no torch import)."""
    kind = device.split(":", 1)[0]
    if kind != "cuda":
        return AcceleratorInfo(kind=kind)
    smi = shutil.which("nvidia-smi")
    if smi is None:
        log.warning("device %s but no nvidia-smi: registering the accelerator without its name and memory", device)
        return AcceleratorInfo(kind=kind)
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, check=True, timeout=NVIDIA_SMI_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        log.warning("nvidia-smi failed (%s): registering the accelerator without its name and memory", exc)
        return AcceleratorInfo(kind=kind)
    gpus = [line.rsplit(",", 1) for line in out.splitlines() if "," in line]
    if not gpus:
        return AcceleratorInfo(kind=kind)
    name, mib = gpus[0]
    return AcceleratorInfo(kind=kind, name=name.strip(), count=len(gpus),
                           memory_bytes=int(mib.strip()) << 20 if mib.strip().isdigit() else 0)


def advertised_address(listen_address: str) -> str:
    """Where other nodes reach a listener bound to ``listen_address``: a wildcard host is replaced by
    this host's name."""
    host, port = split_address(listen_address)
    if host in WILDCARD_HOSTS:
        host = socket.gethostname()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
