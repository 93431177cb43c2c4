"""The multicast share of the link: the caps it gives, and an agent refusing a share it cannot enforce."""

import pytest
from click.testing import CliRunner

from pipecast.agent.command import agent_command
from pipecast.agent.ratelimit import DataPlaneCaps, LinkShareError, data_plane_caps
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
