"""What a node says about itself when it registers (:mod:`pipecast.agent.host`): its reachable address and
its accelerator, probed with ``nvidia-smi``."""

import socket

from control_plane.messages import AcceleratorInfo
from pipecast.agent.host import advertised_address, detect_accelerator


def test_a_wildcard_listen_address_is_advertised_by_host_name():
    assert advertised_address("10.0.0.5:7070") == "10.0.0.5:7070"
    assert advertised_address("0.0.0.0:7070") == f"{socket.gethostname()}:7070"
    assert advertised_address("[::1]:7070") == "[::1]:7070"


def test_a_cuda_node_registers_its_gpus_from_nvidia_smi(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\necho 'NVIDIA H200, 143771'\necho 'NVIDIA H200, 143771'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    assert detect_accelerator("cuda:0") == AcceleratorInfo("cuda", "NVIDIA H200", 2, 143771 << 20)
    assert detect_accelerator("cpu") == AcceleratorInfo("cpu")
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert detect_accelerator("cuda") == AcceleratorInfo("cuda")
