"""``vllm serve PACKAGE --load-format pipecast`` (vllm_plugin/): a tiny random Llama and Qwen2 (head sizes vLLM's
CPU attention takes) served by vLLM from the node agent as its blocks arrive by multicast, and from the package
folder (the unicast fallback), generate the same greedy tokens as vLLM's own loader on the original checkpoint;
a block file with a flipped byte stops vLLM's start-up with the block and the file named.

vLLM runs from its own environment (``PIPECAST_VLLM_VENV``), the agents from this one. One ``vllm serve`` per
case, eager, on a 128-token context: ~20 s each on 2 cores.
"""

import json
import re
import shutil
import signal
import subprocess
import time

import pytest

from control_plane.planner.schedules import make_plan
from pipecast.agent.local_client import LocalAgentClient
from pipecast.agent.plan_file import plan_file_data
from tests.support.agent_processes import free_ports, write_plan
from tests.support.packages import TinyPackage, tiny_package
from tests.support.vllm import VllmServers, vllm_venv

# vLLM's CPU attention takes head sizes 32, 64, 80, ...: Llama honours config.head_dim; vLLM's Qwen2 takes
# hidden / heads, so Qwen2 gets hidden 128 (4 heads of 32).
SIZES = {"llama": {"head_dim": 32}, "qwen2": {"hidden_size": 128, "intermediate_size": 256}}
PROMPT = list(b"Hello, my name is")  # token ids: the tiny models' tokenizer maps each byte to itself
SEED_MBIT = "2"  # the seed's egress: the ~1 MB package takes ~5 s
HOLD_S = 2.0  # how long the seed is held while vLLM's loader waits for a block
CHUNK = 64 << 10  # a block spans several chunks, verified and forwarded one by one


@pytest.fixture(autouse=True, scope="module")
def no_configured_agent():
    """No agent socket or pipecast config inherited by vLLM: each test names its agent."""
    with pytest.MonkeyPatch.context() as env:
        for name in ("PIPECAST_AGENT_LOCAL_SOCKET", "PIPECAST_CONFIG"):
            env.delenv(name, raising=False)
        yield


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    running = VllmServers(vllm_venv(), tmp_path_factory.mktemp("vllm-logs"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict[str, TinyPackage]:
    root = tmp_path_factory.mktemp("vllm-packages")
    return {arch: tiny_package(root / arch, arch, tokenizer=True, chunk_bytes=CHUNK, **sizes)
            for arch, sizes in SIZES.items()}


@pytest.fixture(scope="module")
def reference(servers, packages) -> dict[str, list[int]]:
    """Each model's greedy tokens from vLLM's default loader on the original checkpoint."""
    tokens = {}
    for arch, package in packages.items():
        name = f"default-{arch}"
        servers.start(name, package.checkpoint)
        servers.wait_ready(name)
        tokens[arch] = servers.greedy(name, package.checkpoint, PROMPT)
        servers.stop(name)
    return tokens


@pytest.mark.parametrize("arch", SIZES)
def test_blocks_multicast_to_the_agent_load_as_they_land(arch, servers, packages, reference, agents, tmp_path):
    """A seed multicasts the package to this node's agent while vLLM starts. Once the node holds a first block the
    seed is held (SIGSTOP) until vLLM's loader has taken the blocks verified so far and waits for the next: that
    block lands while vLLM loads, and the loader took it only then. vLLM's model path holds no block at all."""
    package = packages[arch]
    blocks = len(package.manifest.blocks)
    nodes = dict(zip(("seed", "node"), (f"127.0.0.1:{p}" for p in free_ports(2))))
    plan = write_plan(tmp_path / "plan.json", plan_file_data(
        make_plan("chain", ["seed"], ["node"], blocks), package.manifest.package_id, nodes))
    seed = agents.start("seed", "--seed", package.path, "--plan", plan, "--local-socket", tmp_path / "seed.sock",
                        env={"PIPECAST_EGRESS_MBIT": SEED_MBIT})
    agents.wait("seed", "listening")
    folder = tmp_path / "model"
    made = subprocess.run([vllm_venv() / "bin" / "pipecast-vllm-folder", package.manifest.package_id, folder,
                           "--agent", tmp_path / "seed.sock"], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    assert not (folder / "blocks").exists() and (folder / "config.json").read_bytes() == (
        package.path / "config.json").read_bytes()

    socket = tmp_path / "node.sock"
    name = f"agent-{arch}"
    servers.start(name, folder, "--load-format", "pipecast", "--model-loader-extra-config",
                  json.dumps({"agent_socket": str(socket)}))
    # A long I/O timeout: the node's fetch from the held seed must outlast the hold.
    agents.start("node", "--plan", plan, "--local-socket", socket, env={"PIPECAST_IO_TIMEOUT_S": "300"})
    agents.wait("node", "block_verified")
    seed.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.5)  # what the seed sent before it stopped lands
        with LocalAgentClient(socket) as client:
            missing = {b.index for b in client.progress(package.manifest.package_id).blocks if b.verified_at is None}
        assert missing, "the whole package arrived before the seed was held"
        held = min(missing)  # the first block the loader will wait for: once it logs the block before it
        servers.wait_log(name, f"block {held - 1} verified (" if held else
                         f"loading package {package.manifest.package_id[:12]}")
        time.sleep(HOLD_S)
    finally:
        seed.send_signal(signal.SIGCONT)
    servers.wait_ready(name)
    assert servers.greedy(name, folder, PROMPT) == reference[arch]
    log = servers.log(name)
    assert f"loading package {package.manifest.package_id[:12]} ({package.manifest.model_name}, {blocks} blocks) " \
           f"from agent at {socket}" in log and "unicast fallback" not in log
    waited = re.search(rf"block {held} verified \(.*\) after waiting ([0-9.]+) s", log)
    assert float(waited.group(1)) >= HOLD_S * 0.9, waited.group(0)
    servers.stop(name)


@pytest.mark.parametrize("arch", SIZES)
def test_without_an_agent_the_package_folder_is_read(arch, servers, packages, reference):
    package = packages[arch]
    name = f"folder-{arch}"
    servers.start(name, package.path, "--load-format", "pipecast")
    servers.wait_ready(name)
    assert servers.greedy(name, package.path, PROMPT) == reference[arch]
    log = servers.log(name)
    assert (f"no pipecast agent configured (agent_socket, PIPECAST_AGENT_LOCAL_SOCKET unset): loading "
            f"{package.path} from the package folder (unicast fallback)") in log
    # What a router polls: /health answers 200 with an empty body; /metrics has the queue.
    assert servers.get(name, "/health") == (200, "")
    metrics = servers.get(name, "/metrics")[1]
    assert "vllm:num_requests_waiting" in metrics and "vllm:num_requests_running" in metrics
    servers.stop(name)


def test_a_corrupt_block_stops_vllm_naming_the_block_and_its_file(servers, packages, tmp_path):
    """A byte flipped in the middle of block 2: blocks 0 and 1 load, block 2 is refused before any tensor of
    it reaches the model, and vLLM exits with the loader's message."""
    source = packages["llama"]
    package = shutil.copytree(source.path, tmp_path / "corrupt")
    block = source.manifest.blocks[2]
    path = package / block.file
    data = bytearray(path.read_bytes())
    data[block.bytes // 2] ^= 0x01
    path.write_bytes(bytes(data))
    chunk = (block.bytes // 2) // block.chunk_bytes
    name = "corrupt"
    servers.start(name, package, "--load-format", "pipecast")
    assert servers.wait_exit(name) != 0
    expected = (f"pipecast loader: block 2 of package {source.manifest.package_id[:12]} from {path}: chunk {chunk} "
                f"digest mismatch (bytes {chunk * block.chunk_bytes}-"
                f"{min((chunk + 1) * block.chunk_bytes, block.bytes) - 1})")
    assert expected in servers.log(name), servers.log(name)[-3000:]
