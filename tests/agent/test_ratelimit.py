"""The multicast share of the link, per package priority too: the caps it gives, the buckets a package's
bytes go through, and an agent refusing a share it cannot enforce."""

import pytest
from click.testing import CliRunner

from pipecast.agent.command import agent_command
from pipecast.agent.ratelimit import (
    BucketChain,
    DataPlaneCaps,
    HostRateLimits,
    LinkShareError,
    TokenBucket,
    burst_bytes_for,
    data_plane_caps,
    mbit_to_bytes_per_s,
)
from pipecast.agent.transport.tcp import TcpTransport
from pipecast.core.settings import Settings, SettingsError, load_settings

NO_LINK = (r"^multicast_share 0.8 needs agent_link_mbit \(--link-mbit\), this node's link rate in Mbit/s: "
           r"a share of an unknown link cannot be enforced$")


@pytest.mark.parametrize(("egress", "ingress", "link", "share", "expected"), [
    (0, 0, 0, 1.0, (0, 0)),  # nothing set: uncapped
    (0, 0, 400, 1.0, (0, 0)),  # the whole link: the link itself is the only limit
    (100, 0, 0, 1.0, (100, 0)),  # the plain caps alone
    (0, 0, 400, 0.8, (320, 320)),  # both directions at share x link
    (200, 0, 400, 0.8, (200, 320)),  # the lower of the two wins, per direction
    (0, 500, 400, 0.5, (200, 200)),
])
def test_caps_are_the_share_of_the_link_or_the_plain_cap_whichever_is_lower(egress, ingress, link, share, expected):
    caps = data_plane_caps(egress, ingress, link, share)
    assert (caps.egress_mbit, caps.ingress_mbit) == pytest.approx(expected)


def test_a_share_below_one_without_the_link_rate_is_refused():
    with pytest.raises(LinkShareError, match=NO_LINK):
        data_plane_caps(0, 0, 0, 0.8)
    assert issubclass(LinkShareError, SettingsError)


def test_caps_come_from_the_settings_and_the_transport_enforces_them():
    settings = Settings(egress_mbit=0, ingress_mbit=0, agent_link_mbit=400, multicast_share=0.8)
    assert DataPlaneCaps.of(settings) == DataPlaneCaps(320.0, 320.0)
    limits = TcpTransport("n1", settings).limits
    assert limits.egress is not None and limits.ingress is not None
    assert limits.egress.rate_bytes_per_s == limits.ingress.rate_bytes_per_s == pytest.approx(320e6 / 8)
    with pytest.raises(LinkShareError, match=NO_LINK):
        TcpTransport("n1", Settings(egress_mbit=0, ingress_mbit=0, agent_link_mbit=0, multicast_share=0.8))


@pytest.mark.parametrize("share", [0, 1.5, -0.1])
def test_a_share_outside_zero_to_one_is_invalid(share):
    with pytest.raises(SettingsError, match=r"^invalid settings: multicast_share: "):
        load_settings(multicast_share=share)


def test_the_agent_command_refuses_a_share_without_the_link_rate_before_it_starts(tmp_path):
    result = CliRunner().invoke(agent_command, ["--multicast-share", "0.8", "--listen", "127.0.0.1:0"],
                                env={"PIPECAST_AGENT_LINK_MBIT": "0"})
    assert isinstance(result.exception, LinkShareError)
    assert result.exception.args[0].startswith("multicast_share 0.8 needs agent_link_mbit")


def test_the_agent_command_takes_the_link_rate_and_the_share():
    bad = CliRunner().invoke(agent_command, ["--multicast-share", "1.2", "--link-mbit", "400"])
    assert bad.exit_code == 2 and "'--multicast-share': 1.2 is not in the range 0<x<=1" in bad.output


@pytest.mark.parametrize(("share", "priority_shares", "expected"), [
    (1.0, {"low": 0.25}, ((0, 0), {"low": 100})),  # the host uncapped, low packages at a quarter
    (0.8, {"high": 1.0, "low": 0.5}, ((0, 0), {"normal": 320, "low": 200})),  # high may take the whole link
    (0.8, {"low": 0.5}, ((320, 320), {"low": 200})),  # the host at the largest share (normal's)
    (0.5, {"normal": 0.5, "high": 0.5, "low": 0.5}, ((200, 200), {})),  # all alike: the host's buckets alone
])
def test_each_priority_below_the_largest_share_gets_caps_of_its_own(share, priority_shares, expected):
    caps = data_plane_caps(0, 0, 400, share, priority_shares)
    assert (caps.egress_mbit, caps.ingress_mbit) == pytest.approx(expected[0])
    assert dict(caps.priority_mbit) == pytest.approx(expected[1])


def test_a_priority_share_without_the_link_rate_is_refused_naming_it():
    with pytest.raises(LinkShareError, match=r"^priority_shares 0.25 needs agent_link_mbit \(--link-mbit\)"):
        data_plane_caps(0, 0, 0, 1.0, {"low": 0.25})


def test_a_packages_bytes_go_through_its_prioritys_bucket_and_the_hosts():
    limits = HostRateLimits.of(data_plane_caps(0, 0, 400, 0.8, {"low": 0.5}))
    assert limits.egress_for("p") is limits.egress and limits.ingress_for("p") is limits.ingress  # normal
    limits.set_priority("p", "low")
    low = limits.egress_for("p")
    assert isinstance(low, BucketChain) and low.buckets == (limits.by_priority["low"][0], limits.egress)
    assert limits.ingress_for("p").buckets == (limits.by_priority["low"][1], limits.ingress)
    assert low.buckets[0].rate_bytes_per_s == pytest.approx(200e6 / 8)
    limits.set_priority("p", "urgent")  # a name this agent does not know (a newer control plane): normal
    assert limits.egress_for("p") is limits.egress
    limits.set_priority("p", "low")
    limits.forget("p")
    assert limits.priority_of == {}


def test_bytes_through_a_chain_wait_for_the_slowest_bucket():
    now = [0.0]
    fast = TokenBucket(1000, burst_bytes=0, clock=lambda: now[0])
    slow = TokenBucket(100, burst_bytes=0, clock=lambda: now[0])
    assert BucketChain((slow, fast)).take(50) == pytest.approx(0.5)  # both charged, the slow one decides
    assert fast.take(0) == pytest.approx(0.05)


def _paced(bucket: TokenBucket, now: list[float], late_s: float, seconds: float) -> int:
    """Bytes a sender moves in 64 KiB slices for ``seconds``, waking ``late_s`` after each pause it is given."""
    sent = 0
    while now[0] < seconds:
        delay = bucket.take(64 << 10)
        sent += 64 << 10
        if delay > 0:
            now[0] += delay + late_s
    return sent


@pytest.mark.parametrize("mbit", [400, 4000, 40000])
def test_a_sender_that_wakes_a_millisecond_late_still_gets_its_rate_and_no_more(mbit):
    rate = mbit_to_bytes_per_s(mbit)
    now = [0.0]
    sent = _paced(TokenBucket(rate, clock=lambda: now[0]), now, late_s=0.001, seconds=2.0)
    assert 0.97 * rate * now[0] <= sent <= rate * now[0] + burst_bytes_for(rate) + (64 << 10)
    # A burst of 256 KiB at every rate (as before) holds 0.5 ms of 4 Gbit/s: half the rate is lost.
    now = [0.0]
    fixed = _paced(TokenBucket(rate, burst_bytes=256 << 10, clock=lambda: now[0]), now, late_s=0.001, seconds=2.0)
    assert (fixed >= 0.97 * rate * now[0]) == (mbit == 400)


def test_the_burst_is_five_milliseconds_at_the_rate_and_at_least_256_kib():
    assert burst_bytes_for(mbit_to_bytes_per_s(400)) == 256 << 10
    assert burst_bytes_for(mbit_to_bytes_per_s(4000)) == pytest.approx(2.5e6)
    assert TokenBucket(mbit_to_bytes_per_s(4000)).burst_bytes == pytest.approx(2.5e6)


def test_priority_shares_come_from_the_environment_and_bad_ones_are_named():
    assert load_settings(priority_shares=None).priority_shares == {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PIPECAST_PRIORITY_SHARES", '{"low": 0.3}')
        assert load_settings().priority_shares == {"low": 0.3}
    with pytest.raises(SettingsError, match=r"^invalid settings: priority_shares.urgent.\[key\]: Input should be "
                                            r"'high', 'normal' or 'low'"):
        load_settings(priority_shares={"urgent": 0.5})
    with pytest.raises(SettingsError, match=r"^invalid settings: priority_shares.low: Input should be less than"):
        load_settings(priority_shares={"low": 1.5})


def test_the_agent_command_takes_shares_per_priority_and_names_a_bad_one():
    bad = CliRunner().invoke(agent_command, ["--priority-share", "low=lots", "--link-mbit", "400"])
    assert bad.exit_code == 2 and "expected PRIORITY=SHARE with a number, got low='lots'" in bad.output
    bad = CliRunner().invoke(agent_command, ["--priority-share", "urgent=0.5", "--link-mbit", "400"])
    assert isinstance(bad.exception, SettingsError) and "priority_shares.urgent" in str(bad.exception)
    result = CliRunner().invoke(agent_command, ["--priority-share", "low=0.5", "--listen", "127.0.0.1:0"],
                                env={"PIPECAST_AGENT_LINK_MBIT": "0"})
    assert isinstance(result.exception, LinkShareError)
    assert result.exception.args[0].startswith("priority_shares 0.5 needs agent_link_mbit")
