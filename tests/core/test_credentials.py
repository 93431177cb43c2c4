"""The cluster's credentials: node tokens, principals, the data-plane and serving keys, all derived from the master."""

import base64
import hashlib
import hmac
import logging

import pytest

from pipecast.core.credentials import (
    NODE,
    OPERATOR,
    CredentialError,
    Principal,
    check_master_token,
    data_plane_key,
    issue_node_token,
    parse_node_token,
    presents_key,
    principal_for,
    serving_headers,
    serving_key,
    validate_node_id,
    verify_node_token,
    warn_if_auth_off,
    warn_if_cleartext,
)

MASTER = "master-secret"


def test_a_node_token_is_the_specified_hmac_of_its_node_id():
    mac = hmac.new(MASTER.encode(), b"pipecast node token v1\x00" + b"w1", hashlib.sha256).digest()
    expected = "pcn1.w1." + base64.urlsafe_b64encode(mac).rstrip(b"=").decode()
    assert issue_node_token(MASTER, "w1") == expected
    assert parse_node_token(expected) == ("w1", expected.rsplit(".", 1)[1])
    assert verify_node_token(MASTER, expected) == "w1"


def test_the_data_plane_key_is_the_specified_hmac_and_differs_from_every_token():
    key = data_plane_key(MASTER)
    assert key == hmac.new(MASTER.encode(), b"pipecast data plane v1", hashlib.sha256).digest()
    assert len(key) == 32 and data_plane_key("other") != key
    assert base64.urlsafe_b64encode(key).rstrip(b"=").decode() not in issue_node_token(MASTER, "w1")


def test_the_serving_key_is_the_specified_hmac_of_the_data_plane_key_and_travels_in_one_header():
    key = serving_key(data_plane_key(MASTER))
    assert key == hmac.new(data_plane_key(MASTER), b"pipecast serving v1", hashlib.sha256).digest()
    assert len(key) == 32 and key not in (data_plane_key(MASTER), serving_key(data_plane_key("other")))
    assert serving_headers(key) == {"X-Pipecast-Serving-Key": key.hex()}
    assert serving_key(b"") == b"" and serving_headers(b"") == {}


def test_presented_secrets_with_non_utf8_bytes_are_refused_not_raised():
    # aiohttp decodes a header's bytes with surrogateescape: b"\xff" arrives as "\udcff" (fuzzed: a 500 before)
    key = serving_key(data_plane_key(MASTER))
    assert presents_key(key.hex(), key) and not presents_key("\udcff\udcfe", key) and not presents_key(None, key)
    assert principal_for(MASTER, "\udcff") is None and verify_node_token(MASTER, "pcn1.w1.\udcff") is None
    # Found in review: a lone surrogate outside aiohttp's range (a JSON "\ud800" escape) raised.
    assert not presents_key("\ud800", key) and principal_for(MASTER, "x\ud800") is None
    assert verify_node_token(MASTER, "pcn1.w1.\ud800") is None


@pytest.mark.parametrize("token", [
    issue_node_token("other-master", "w1"),   # another cluster's
    issue_node_token(MASTER, "w1")[:-1] + "A",  # mac changed
    issue_node_token(MASTER, "w1").replace("w1", "w2"),  # node id changed
    "pcn2" + issue_node_token(MASTER, "w1")[4:],  # another version
    "pcn1.w1", "pcn1..abc", "", MASTER,
])
def test_forged_or_malformed_node_tokens_verify_to_nobody(token):
    assert verify_node_token(MASTER, token) is None


@pytest.mark.parametrize("token", [MASTER, "", "pcn1.w1", "pcn1..mac", "pcn1.a\nb.mac", "x.w1.mac"])
def test_what_is_not_shaped_like_a_node_token_parses_to_none(token):
    assert parse_node_token(token) is None


def test_with_auth_off_nothing_verifies_and_nothing_derives():
    assert verify_node_token("", issue_node_token(MASTER, "w1")) is None
    assert principal_for("", "") is None
    with pytest.raises(CredentialError, match="auth is off"):
        issue_node_token("", "w1")
    assert data_plane_key("") == b""


def test_principals_of_the_master_and_of_node_tokens():
    operator = principal_for(MASTER, MASTER)
    node = principal_for(MASTER, issue_node_token(MASTER, "w1"))
    assert operator == Principal(OPERATOR, OPERATOR) and node == Principal("w1", NODE)
    assert operator.is_operator and operator.may_act_for("w1") and operator.may_act_for("w2")
    assert not node.is_operator and node.may_act_for("w1") and not node.may_act_for("w2")
    assert principal_for(MASTER, "guess") is None


@pytest.mark.parametrize(("node_id", "problem"), [
    ("", "must not be empty"), ("a b", "white space"), ("x" * 129, "at most 128"), ("a\nb", "unprintable"),
    ("a\tb", "unprintable"), ("gpü-1", "'gpü-1' has characters other than ASCII"), ("ノード", "other than ASCII"),
])
def test_unusable_node_ids_are_refused(node_id, problem):
    with pytest.raises(CredentialError, match=problem):
        validate_node_id(node_id)
    with pytest.raises(CredentialError):
        issue_node_token(MASTER, node_id)


def test_usable_node_ids_round_trip():
    for node_id in ("w1", "gpu-node-07:7070", "x" * 128, "!~"):
        assert verify_node_token(MASTER, issue_node_token(MASTER, node_id)) == node_id


def test_auth_off_is_warned_once_per_component(caplog):
    with caplog.at_level(logging.WARNING, logger="pipecast.core.credentials"):
        assert warn_if_auth_off("", "test component") and warn_if_auth_off("", "test component")
        assert not warn_if_auth_off(MASTER, "test component")
    assert [r.message.count("authentication is OFF") for r in caplog.records] == [1]


def test_auth_without_tls_is_warned_once_per_component(caplog):
    with caplog.at_level(logging.WARNING, logger="pipecast.core.credentials"):
        assert warn_if_cleartext(MASTER, False, "cleartext component")
        assert warn_if_cleartext(MASTER, False, "cleartext component")
        assert not warn_if_cleartext(MASTER, True, "cleartext component")
        assert not warn_if_cleartext("", False, "cleartext component")  # auth off: warned as such
    assert [r.message.count("authentication is on but TLS is off") for r in caplog.records] == [1]


def test_a_node_id_with_dots_gets_a_token_that_verifies_to_it():
    """The default node id is host:port, and hosts have dots (10.0.0.2:7070, gpu-2.rack1.example)."""
    for node in ("10.0.0.2:7070", "gpu-2.rack1.example:7070"):
        token = issue_node_token("master", node)
        assert verify_node_token("master", token) == node
        assert verify_node_token("other", token) is None


@pytest.mark.parametrize("master, problem", [
    ("s3cret", "has 6 characters, 6 of them different"),
    ("aaaaaaaabbbbbbbbcccc", "has 20 characters, 3 of them different"),
])
def test_a_guessable_master_token_is_refused_with_what_it_lacks(master, problem):
    with pytest.raises(CredentialError) as caught:
        check_master_token(master)
    assert str(caught.value).startswith(f"auth_token: the master token {problem}; it needs at least 16, 8 different")


def test_a_node_token_is_refused_as_the_master_token():
    with pytest.raises(CredentialError) as caught:
        check_master_token("pcn1.w1.abcdefghijklmnopqrst")
    assert str(caught.value) == (
        "auth_token: the master token is a node token (of node 'w1', from `pipecast cp issue-token`); the control "
        "plane needs the cluster's master secret, from which node tokens derive: make one with `openssl rand -hex "
        "32`")


@pytest.mark.parametrize("master, position", [("pässwörd-Geheimnis-2026", 2), ("tab\tseparated-secret-0123", 4),
                                              ("with space-secret-0123", 5), ("0123456789abcdef\x7f", 17)])
def test_a_master_token_grpc_metadata_cannot_carry_is_refused_without_showing_it(master, position):
    """Found in review: such a master passed, and every call presenting it failed with a raw gRPC error."""
    with pytest.raises(CredentialError) as caught:
        check_master_token(master)
    assert str(caught.value) == (
        f"auth_token: the master token has a character other than printable ASCII (white space, a control character "
        f"or a non-ASCII one) at position {position}; gRPC metadata, which carries it, takes printable ASCII only: "
        "make one with `openssl rand -hex 32`")


def test_no_master_token_and_a_random_one_pass():
    assert check_master_token("") == ""
    assert check_master_token("9f86d081884c7d65") == "9f86d081884c7d65"
