"""The emulated cluster (benchmarks/cluster.py) and the CPU sampler (benchmarks/cpu.py).

The netns tests push real TCP traffic through the shaped links: a single flow must reach the configured
rate (HTB goodput is ~99% of the rate at MTU 9000, ~95.6% at 1500), and a link shared by several peers
must split per peer. They skip, saying why, where network namespaces are not permitted.
"""

import json
import signal
import subprocess
import sys
import time
from collections import namedtuple
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from benchmarks.cluster import (
    EGRESS_ENV,
    HTB_BURST_BYTES,
    INGRESS_ENV,
    ClusterError,
    EmulatedCluster,
    htb_commands,
    plan_hosts,
)
from benchmarks.cpu import CPU_BOUND_NOTE, CpuSampler, CpuUsage, busy_fraction, summarize
from benchmarks.distribution import DistributionConfig
from tests.support import REPO
from tests.support.netns import require_netns

LINK_MBIT = 80.0

# Accepts N connections, counts bytes per connection in a window after a warm-up, prints Mbit/s each.
SINK = r"""
import json, socket, sys, threading, time
host, port, nconn = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
warm, window = float(sys.argv[4]), float(sys.argv[5])
srv = socket.create_server((host, port))
srv.settimeout(10)
print("ready", flush=True)
conns = [srv.accept()[0] for _ in range(nconn)]
counts = [0] * nconn
def drain(i, c):
    buf = bytearray(1 << 20)
    while n := c.recv_into(buf):
        counts[i] += n
for i, c in enumerate(conns):
    threading.Thread(target=drain, args=(i, c), daemon=True).start()
time.sleep(warm)
start, t0 = list(counts), time.monotonic()
time.sleep(window)
end, dt = list(counts), time.monotonic() - t0
print(json.dumps([(e - s) * 8 / dt / 1e6 for s, e in zip(start, end)]), flush=True)
"""

# Opens N connections and sends zeros on each (one thread per connection) until the deadline.
SOURCE = r"""
import socket, sys, threading, time
host, port, nconn, duration = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
payload, deadline = bytes(1 << 18), time.monotonic() + duration
def pump():
    try:
        with socket.create_connection((host, port), timeout=10) as s:
            while time.monotonic() < deadline:
                s.sendall(payload)
    except OSError:
        pass
threads = [threading.Thread(target=pump) for _ in range(nconn)]
for t in threads: t.start()
for t in threads: t.join()
"""

# Enters a cluster, starts a sleeper in it, reports both, then waits to be signalled.
CHILD = r"""
import sys, time
from benchmarks.cluster import EmulatedCluster
with EmulatedCluster(["a", "b"], 10, mode="netns", name_prefix=sys.argv[1]) as c:
    sleeper = c.spawn("a", ["sleep", "60"])
    print(c.prefix, sleeper.pid, flush=True)
    time.sleep(60)
"""


# Enters a loopback cluster inside an outer finally, and SIGTERMs itself in the with block (body) or while the
# cluster tears down (teardown: the signal is deferred, then delivered).
TERM_CHILD = r"""
import signal, sys
from benchmarks.cluster import EmulatedCluster
try:
    with EmulatedCluster(["a"], 10, mode="loopback") as c:
        if sys.argv[1] == "teardown":
            teardown = c._teardown
            c._teardown = lambda: (signal.raise_signal(signal.SIGTERM), teardown())[1]
        else:
            signal.raise_signal(signal.SIGTERM)
            print("the body went on", flush=True)
finally:
    print("outer finally ran", flush=True)
"""


def _netns_of(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"{prefix}-")]


def _links_of(prefix: str) -> list[str]:
    out = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if prefix in line]


def _gone(pid: int, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def _start_child(family: str) -> tuple[subprocess.Popen[str], str, int]:
    child = subprocess.Popen([sys.executable, "-c", CHILD, family], stdout=subprocess.PIPE, text=True,
                             cwd=REPO)
    prefix, sleeper = child.stdout.readline().split()
    return child, prefix, int(sleeper)


# -- pure planning -------------------------------------------------------------------------------------


def test_plan_gives_store_its_own_egress_and_distinct_addresses() -> None:
    plans = plan_hosts(["store", "w0", "w1"], 400, 100, "store", "10.77.0.")
    assert [p.address for p in plans] == ["10.77.0.2", "10.77.0.3", "10.77.0.4"]
    assert [(p.egress_mbit, p.ingress_mbit) for p in plans] == [(100, 400), (400, 400), (400, 400)]


@pytest.mark.parametrize(("hosts", "link", "store", "message"), [
    ([], 10, None, "an emulated cluster needs at least one host"),
    (["a", "b", "a"], 10, None, "host names must be unique, repeated: a"),
    (["a"], 0, None, "link_mbit must be > 0, got 0"),
    (["a"], 10, 5, "store_mbit is set but the store host 'store' is not among the hosts"),
])
def test_plan_rejects_bad_layouts(hosts: list[str], link: float, store: float | None, message: str) -> None:
    with pytest.raises(ClusterError, match=f"^{message}$"):
        plan_hosts(hosts, link, store, "store", "10.77.0.")


def test_a_host_given_its_own_rate_has_it_both_ways() -> None:
    plans = plan_hosts(["store", "w1", "w2"], 400, None, "store", "10.77.0.", host_mbit={"w2": 100})
    assert [(p.egress_mbit, p.ingress_mbit) for p in plans] == [(400, 400), (400, 400), (100, 100)]
    assert plan_hosts(["a"], 400, None, "store", "10.77.0.", host_mbit={}) == plan_hosts(
        ["a"], 400, None, "store", "10.77.0.")


def test_a_host_given_its_own_egress_rate_has_it_out_only() -> None:
    plans = plan_hosts(["store", "w1", "w2"], 400, 800, "store", "10.77.0.", host_mbit={"w1": 200},
                       host_egress_mbit={"w1": 50, "w2": 100})
    assert [(p.egress_mbit, p.ingress_mbit) for p in plans] == [(800, 400), (50, 200), (100, 400)]
    with pytest.raises(ClusterError, match="^host_egress_mbit of 'w1' must be > 0, got 0$"):
        EmulatedCluster(["store", "w1"], 400, host_egress_mbit={"w1": 0})


def test_a_store_with_its_own_rate_still_sends_at_store_mbit_when_given() -> None:
    slow = {"store": 50}
    plans = plan_hosts(["store", "w1"], 400, None, "store", "10.77.0.", host_mbit=slow)
    assert (plans[0].egress_mbit, plans[0].ingress_mbit) == (50, 50)
    plans = plan_hosts(["store", "w1"], 400, 800, "store", "10.77.0.", host_mbit=slow)
    assert (plans[0].egress_mbit, plans[0].ingress_mbit) == (800, 50)
    assert EmulatedCluster(["store", "w1"], 400, host_mbit=slow).store_mbit == 50


@pytest.mark.parametrize(("host_mbit", "message"), [
    ({"w9": 100}, "host_mbit names 'w9', which is not among the hosts"),
    ({"w1": 0}, "host_mbit of 'w1' must be > 0, got 0"),
    ({"w1": -5.0}, "host_mbit of 'w1' must be > 0, got -5.0"),
])
def test_plan_rejects_bad_host_rates_naming_the_host(host_mbit: dict[str, float], message: str) -> None:
    with pytest.raises(ClusterError, match=f"^{message}$"):
        plan_hosts(["store", "w1"], 400, None, "store", "10.77.0.", host_mbit=host_mbit)
    with pytest.raises(ClusterError, match=f"^{message}$"):
        EmulatedCluster(["store", "w1"], 400, host_mbit=host_mbit)


def test_a_fifo_link_is_one_class_for_every_packet() -> None:
    plans = plan_hosts(["a", "b", "c"], 90, None, "store", "10.77.0.")
    assert htb_commands("eth0", 90, plans[1:], "dst", 9000, "fifo") == [
        "qdisc replace dev eth0 root handle 1: htb default 1",
        "class add dev eth0 parent 1: classid 1:1 htb rate 90000000bit ceil 90000000bit burst 262144 cburst 262144"]
    with pytest.raises(ClusterError, match="^link_queue must be 'per-peer' or 'fifo', got 'red'$"):
        EmulatedCluster(["a"], 10, link_queue="red")


def test_a_link_s_burst_is_what_it_is_given_a_whole_frame_at_least() -> None:
    plans = plan_hosts(["a", "b"], 90, None, "store", "10.77.0.")
    assert htb_commands("eth0", 90, plans[1:], "dst", 9000, "fifo", 32768)[1].endswith(" burst 32768 cburst 32768")
    with pytest.raises(ClusterError,
                       match=r"^a link's burst must hold one frame \(9014 bytes at mtu 9000\), got 9000$"):
        EmulatedCluster(["a"], 10, burst_bytes=9000)


def test_the_distribution_bench_s_default_burst_is_the_cluster_s() -> None:
    from benchmarks.command import bench_distribution
    from pipecast.core.units import parse_size

    [option] = [p for p in bench_distribution.params if p.name == "link_burst"]
    assert parse_size(option.default) == HTB_BURST_BYTES == DistributionConfig(package=Path(".")).link_burst


def test_htb_has_one_class_and_filter_per_peer() -> None:
    plans = plan_hosts(["a", "b", "c", "d"], 90, None, "store", "10.77.0.")
    lines = htb_commands("eth0", 90, plans[1:], "dst", 9000)
    assert lines[1] == ("class add dev eth0 parent 1: classid 1:1 htb rate 90000000bit ceil 90000000bit "
                        "burst 262144 cburst 262144")
    peer_classes = [line for line in lines if "rate 30000000bit ceil 90000000bit" in line]
    assert [c.split()[7] for c in peer_classes] == ["1:11", "1:12", "1:13"]
    filters = [line for line in lines if line.startswith("filter")]
    assert [f.split()[-4:] for f in filters] == [
        ["dst", "10.77.0.3/32", "flowid", "1:11"],
        ["dst", "10.77.0.4/32", "flowid", "1:12"],
        ["dst", "10.77.0.5/32", "flowid", "1:13"],
    ]


# -- loopback mode -------------------------------------------------------------------------------------


def test_loopback_sets_addresses_and_rate_env() -> None:
    with EmulatedCluster(["store", "w0"], 200, store_mbit=50, mode="loopback") as c:
        assert c.mode == "loopback"
        assert [c.address(h) for h in c.hosts] == ["127.0.0.2", "127.0.0.3"]
        assert c.interface("w0") == "lo"
        assert "loopback mode" in c.describe()
        show = f"import os; print(os.environ['{EGRESS_ENV}'], os.environ['{INGRESS_ENV}'])"
        outs = [c.spawn(h, [sys.executable, "-c", show], stdout=subprocess.PIPE, text=True).communicate()[0]
                for h in ("store", "w0")]
    assert outs == ["50 200\n", "200 200\n"]


def test_spawned_processes_do_not_inherit_the_callers_disk_cache_or_config_file(monkeypatch, tmp_path) -> None:
    """Found in review: an agent cache dir in the caller's environment made a benchmark's cold workers warm
    (bench stragglers printed 0.05x S/B, met) and gave every loopback worker one cache."""
    monkeypatch.setenv("PIPECAST_AGENT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("PIPECAST_CONFIG", str(tmp_path / "pipecast.toml"))
    monkeypatch.setenv("PIPECAST_LOG_LEVEL", "debug")  # other settings pass
    show = ("import os; print(os.environ.get('PIPECAST_AGENT_CACHE_DIR'), os.environ.get('PIPECAST_CONFIG'), "
            "os.environ.get('PIPECAST_LOG_LEVEL'))")
    with EmulatedCluster(["store", "w0"], 200, mode="loopback") as c:
        out = c.spawn("w0", [sys.executable, "-c", show], stdout=subprocess.PIPE, text=True).communicate()[0]
    assert out == "None None debug\n"


def test_loopback_tells_a_host_with_its_own_rate_that_rate() -> None:
    with EmulatedCluster(["store", "w1"], 200, mode="loopback", host_mbit={"w1": 25}) as c:
        assert "2 hosts at 200 Mbit/s per direction, w1 at 25, store 'store' egress 200 Mbit/s" in c.describe()
        show = f"import os; print(os.environ['{EGRESS_ENV}'], os.environ['{INGRESS_ENV}'])"
        out = c.spawn("w1", [sys.executable, "-c", show], stdout=subprocess.PIPE, text=True).communicate()[0]
    assert out == "25 25\n"


def test_unknown_host_and_spawn_outside_the_block_are_refused() -> None:
    cluster = EmulatedCluster(["a"], 10, mode="loopback")
    with pytest.raises(ClusterError, match="only once it is entered"):
        _ = cluster.mode
    with cluster as c:
        with pytest.raises(ClusterError, match=r"^unknown host 'x': this cluster's hosts are a$"):
            c.address("x")
    with pytest.raises(ClusterError, match="the cluster is not running"):
        cluster.spawn("a", ["true"])


def test_loopback_exit_kills_spawned_process_groups() -> None:
    with pytest.raises(RuntimeError, match="body failed"):
        with EmulatedCluster(["a"], 10, mode="loopback") as c:
            shell = c.spawn("a", ["sh", "-c", "sleep 60 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
            grandchild = int(shell.stdout.readline())
            raise RuntimeError("body failed")
    assert shell.returncode is not None
    assert _gone(grandchild)


@pytest.mark.parametrize("when", ["body", "teardown"])
def test_sigterm_unwinds_the_callers_blocks_then_exits_128_plus_the_signal(when: str) -> None:
    # Killing the process at the cluster's exit would skip the caller's clean-up (temp dirs, cgroups).
    child = subprocess.run([sys.executable, "-c", TERM_CHILD, when], capture_output=True, text=True, cwd=REPO,
                           timeout=60)
    assert child.returncode == 128 + signal.SIGTERM, child.stderr
    assert child.stdout == "outer finally ran\n"


# -- netns mode ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def netns_cluster() -> Iterator[EmulatedCluster]:
    require_netns()
    with EmulatedCluster(["a", "b", "c"], LINK_MBIT, mode="netns") as cluster:
        yield cluster


def _sink(c: EmulatedCluster, host: str, port: int, connections: int) -> subprocess.Popen[str]:
    argv = [sys.executable, "-c", SINK, c.address(host), str(port), str(connections), "0.4", "1.0"]
    sink = c.spawn(host, argv, stdout=subprocess.PIPE, text=True)
    assert sink.stdout.readline().strip() == "ready"
    return sink


def _source(c: EmulatedCluster, host: str, to: str, port: int, connections: int) -> None:
    c.spawn(host, [sys.executable, "-c", SOURCE, c.address(to), str(port), str(connections), "2.0"])


def _shares(sink: subprocess.Popen[str]) -> list[float]:
    out, _ = sink.communicate(timeout=15)
    return [mbit / LINK_MBIT for mbit in json.loads(out)]


@pytest.mark.netns
def test_single_flow_reaches_the_link_rate(netns_cluster: EmulatedCluster) -> None:
    c = netns_cluster
    sink = _sink(c, "b", 5001, 1)
    _source(c, "a", "b", 5001, 1)
    [share] = _shares(sink)
    print(f"single flow at {LINK_MBIT:g} Mbit/s: goodput {share:.3f} x rate")
    assert 0.80 <= share <= 1.02


@pytest.mark.netns
def test_two_senders_share_the_receivers_ingress(netns_cluster: EmulatedCluster) -> None:
    c = netns_cluster
    sink = _sink(c, "c", 5002, 2)
    _source(c, "a", "c", 5002, 1)
    _source(c, "b", "c", 5002, 1)
    shares = _shares(sink)
    print(f"two senders into one link: {[round(s, 3) for s in shares]} x rate")
    assert all(0.40 <= s <= 0.60 for s in shares)
    assert 0.80 <= sum(shares) <= 1.02


@pytest.mark.netns
def test_egress_splits_per_peer_not_per_flow(netns_cluster: EmulatedCluster) -> None:
    # One flow to b against four to c: per-flow sharing would give b a fifth, per-peer classes a half.
    c = netns_cluster
    to_b, to_c = _sink(c, "b", 5003, 1), _sink(c, "c", 5004, 4)
    _source(c, "a", "b", 5003, 1)
    _source(c, "a", "c", 5004, 4)
    [share_b], share_c = _shares(to_b), sum(_shares(to_c))
    print(f"1 flow to b vs 4 to c: b {share_b:.3f}, c {share_c:.3f} x rate")
    assert 0.40 <= share_b <= 0.60
    assert 0.40 <= share_c <= 0.60


@pytest.mark.netns
def test_netns_children_get_no_app_shaping(netns_cluster: EmulatedCluster) -> None:
    show = f"import os; print(os.environ['{EGRESS_ENV}'], os.environ['{INGRESS_ENV}'])"
    out, _ = netns_cluster.spawn("a", [sys.executable, "-c", show], stdout=subprocess.PIPE,
                                 text=True).communicate(timeout=10)
    assert out == "0 0\n"
    assert netns_cluster.interface("a") == "eth0"


@pytest.mark.netns
def test_netns_exit_after_exception_removes_everything(netns_cluster: EmulatedCluster) -> None:
    with pytest.raises(RuntimeError, match="body failed"):
        with EmulatedCluster(["a", "b"], 10, mode="netns") as c:
            prefix = c.prefix
            assert len(_netns_of(prefix)) == 3  # two hosts and the bridge
            sleeper = c.spawn("b", ["sleep", "60"])
            raise RuntimeError("body failed")
    assert sleeper.returncode is not None
    assert _netns_of(prefix) == []
    assert _links_of(prefix) == []


@pytest.mark.netns
def test_sigterm_cleans_up_then_terminates(netns_cluster: EmulatedCluster) -> None:
    child, prefix, sleeper = _start_child("pcterm")
    assert len(_netns_of(prefix)) == 3
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=10) == 128 + signal.SIGTERM  # exits as a shell reports a SIGTERM death
    assert _netns_of(prefix) == []
    assert _gone(sleeper)


@pytest.mark.netns
def test_next_cluster_removes_one_left_by_a_killed_process(netns_cluster: EmulatedCluster) -> None:
    child, prefix, sleeper = _start_child("pckill")
    child.kill()
    child.wait(timeout=10)
    assert len(_netns_of(prefix)) == 3  # SIGKILL leaves the cluster behind
    with EmulatedCluster(["a"], 10, mode="netns", name_prefix="pckill"):
        assert _netns_of(prefix) == []
    assert _gone(sleeper)


# -- CPU sampler ---------------------------------------------------------------------------------------

_Times = namedtuple("_Times", "user nice system idle iowait guest guest_nice")


def test_busy_fraction_counts_iowait_as_idle_and_guest_once() -> None:
    before = _Times(10, 0, 10, 70, 10, 0, 0)
    after = _Times(40, 0, 20, 100, 20, 5, 0)  # +40 busy (guest inside user), +40 idle/iowait
    assert busy_fraction(before, after) == pytest.approx(0.5)


def test_summary_reports_p95_and_the_cpu_bound_verdict() -> None:
    usage = summarize([float(p) for p in range(1, 101)], 93.0, 2)
    assert usage == CpuUsage(mean_percent=93.0, p95_percent=95.0, samples=100, cores=2)
    assert usage.saturated() and not usage.saturated(threshold=0.95)
    assert usage.summary().endswith(CPU_BOUND_NOTE)
    assert CPU_BOUND_NOTE not in summarize([10.0], 10.0, 2).summary()


def test_sampler_records_a_busy_thread() -> None:
    with CpuSampler(interval_s=0.05) as sampler:
        deadline = time.monotonic() + 0.3
        while time.monotonic() < deadline:
            pass
    usage = sampler.usage()
    cores = psutil.cpu_count()
    assert usage.samples >= 3
    # One spinning thread keeps one core busy, whatever the neighbours do.
    assert 100.0 / cores * 0.5 <= usage.mean_percent <= 100.0
    assert usage.p95_percent >= usage.mean_percent * 0.5
