"""vLLM's own server processes for the plugin's integration tests (``make test-vllm``): ``vllm serve`` from
vLLM's environment (``PIPECAST_VLLM_VENV``, built by ``vllm_plugin/setup_venv.sh``), each in a process group of
its own with its log in a file, stopped with its engine and worker processes."""

import json
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from subprocess import Popen, TimeoutExpired

from benchmarks.processes import Processes, stop_processes
from tests.support.agent_processes import free_ports

#: What keeps a tiny model's vLLM small and quick on a shared 2-core machine: 1 GiB of KV cache, two OpenMP
#: threads, nothing fetched or reported.
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
       "DO_NOT_TRACK": "1"}
#: Eager (no graph compilation: ~20 s to ready instead of ~70 s), float32 as the checkpoints are, the tiny
#: models' whole context.
SERVE_ARGS = ("--enforce-eager", "--dtype", "float32", "--max-model-len", "128")
READY_TIMEOUT_S = 240.0
POLL_S = 0.5


class VllmError(AssertionError):
    """A vLLM server that failed, or did not do what a test waited for; the message ends with its log tail."""


class VllmServers:
    """``vllm serve`` processes of one test module, in ``folder`` (``<name>.log`` each); all stopped at the end."""

    def __init__(self, venv: Path, folder: Path) -> None:
        self.venv = Path(venv)
        self.processes = Processes(folder, VllmError)
        self.urls: dict[str, str] = {}

    def start(self, name: str, model: Path, *args: str, env: dict[str, str] | None = None) -> Popen:
        """``vllm serve MODEL`` with :data:`SERVE_ARGS` and ``args`` on a free port, as ``name``, in this
        process's environment plus :data:`ENV` and ``env``."""
        port = free_ports(1)[0]
        self.urls[name] = f"http://127.0.0.1:{port}"
        return self.processes.launch(name, [self.venv / "bin" / "vllm", "serve", model, "--port", str(port),
                                            *SERVE_ARGS, *args], env={**ENV, **(env or {})})

    def wait_ready(self, name: str, timeout: float = READY_TIMEOUT_S) -> float:
        """Seconds until ``name`` answers /health with 200 (:class:`VllmError` if it exits or takes longer)."""
        started = time.monotonic()
        while True:
            self.processes.check_alive([name])
            try:
                with urllib.request.urlopen(f"{self.urls[name]}/health", timeout=2.0) as answer:
                    if answer.status == 200:
                        return time.monotonic() - started
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() - started > timeout:
                raise VllmError(f"{name} not ready within {timeout:g} s:\n{self.processes.log_tail(name)}")
            time.sleep(POLL_S)

    def wait_log(self, name: str, text: str, timeout: float = READY_TIMEOUT_S) -> None:
        """Wait until ``name``'s log holds ``text`` (:class:`VllmError` if it exits or takes longer)."""
        deadline = time.monotonic() + timeout
        while text not in self.log(name):
            self.processes.check_alive([name])
            if time.monotonic() > deadline:
                raise VllmError(f"{name} did not log {text!r} within {timeout:g} s:\n{self.processes.log_tail(name)}")
            time.sleep(POLL_S / 5)

    def wait_exit(self, name: str, timeout: float = READY_TIMEOUT_S) -> int:
        """``name``'s exit status, once it has exited."""
        try:
            return self.processes.procs[name].wait(timeout)
        except TimeoutExpired:
            raise VllmError(f"{name} still running after {timeout:g} s:\n{self.processes.log_tail(name)}") from None

    def greedy(self, name: str, model: Path, prompt: list[int], max_tokens: int = 16) -> list[int]:
        """The token ids ``name`` generates greedily after the token ids ``prompt``."""
        body = {"model": str(model), "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "return_token_ids": True}
        request = urllib.request.Request(f"{self.urls[name]}/v1/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60.0) as answer:
            return json.load(answer)["choices"][0]["token_ids"]

    def get(self, name: str, path: str) -> tuple[int, str]:
        """Status and body of GET ``path`` on ``name``."""
        with urllib.request.urlopen(f"{self.urls[name]}{path}", timeout=10.0) as answer:
            return answer.status, answer.read().decode()

    def log(self, name: str) -> str:
        return self.processes.log(name)

    def stop(self, name: str | None = None) -> None:
        """Stop ``name`` (default: all), with every process of its group (vLLM's engine core and worker)."""
        procs = self.processes.procs
        stop_processes([procs[name]] if name else list(procs.values()), grace_s=15.0)


def vllm_venv() -> Path | None:
    """vLLM's environment for these tests, from ``PIPECAST_VLLM_VENV`` (None: not set)."""
    venv = os.environ.get("PIPECAST_VLLM_VENV")
    return Path(venv).resolve() if venv else None
