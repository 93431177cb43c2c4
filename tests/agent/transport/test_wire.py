"""The wire format both transports share: headers, the hello, requests and answers checked whole, payload
views. Transfers are tested per backend (test_tcp.py, test_ucx.py) and for all of them
(test_conformance.py)."""

import numpy as np
import pytest

from pipecast.agent.errors import PeerAuthError, PeerProtocolError
from pipecast.agent.transport.base import PeerAuth
from pipecast.agent.transport.wire import (
    AUTH_FAIL,
    CHUNK,
    FILE,
    KEY_ID_BYTES,
    NONCE_BYTES,
    REQ_BLOCK,
    REQ_FILE,
    TCP_HEADER,
    UCX_HEADER,
    ClientHello,
    Header,
    HelloRefused,
    ServerHello,
    byte_view,
    check_answer,
    check_message,
    file_answer_limit,
    frames,
    parse_request,
    request_payload,
)


def test_headers_keep_their_sizes_and_round_trip():
    assert (TCP_HEADER.size, UCX_HEADER.size) == (20, 24)
    header = Header(CHUNK, 3, 7, 1 << 20)
    assert TCP_HEADER.parse(TCP_HEADER.pack(header), "p") == header
    framed = Header(CHUNK, 3, 7, 1 << 20, 64 << 10)
    assert UCX_HEADER.parse(UCX_HEADER.pack(framed), "p") == framed
    with pytest.raises(PeerProtocolError, match=r"^peer p: sent a header with magic b'PU' version 3 \(expected b'PC'"):
        TCP_HEADER.parse(UCX_HEADER.pack(header), "p")
    with pytest.raises(PeerProtocolError, match="frame size of 16 bytes"):
        UCX_HEADER.parse(UCX_HEADER.pack(Header(CHUNK, length=100, frame=16)), "p")


PKG = "ab" * 32


def test_requests_parse_what_requesters_send():
    block = request_payload(PKG, "node-a")
    request = parse_request(Header(REQ_BLOCK, 2, 5, len(block)), block, "p")
    assert (request.kind, request.block, request.chunk, request.package_id, request.requester, request.path) == \
        (REQ_BLOCK, 2, 5, PKG, "node-a", "")
    file = request_payload(PKG, "node-a", "config.json")
    assert parse_request(Header(REQ_FILE, 0, 100, len(file)), file, "p").path == "config.json"
    with pytest.raises(PeerProtocolError, match="sent message type 3 of 10 bytes as a request"):
        check_message(Header(CHUNK, length=10), "p")
    with pytest.raises(PeerProtocolError, match="of 5000 bytes as a request"):
        check_message(Header(REQ_BLOCK, length=5000), "p")


def test_payloads_split_into_frames():
    assert frames(0, 0) == [] and frames(10, 0) == [(0, 10)]
    assert frames(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_typed_buffers_travel_as_flat_bytes():
    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = byte_view(memoryview(weights))
    assert (view.format, view.ndim, len(view)) == ("B", 1, weights.nbytes)
    assert bytes(view) == weights.tobytes()


# -- the hello (finding 1) and answer bounds (finding 5) ------------------------------------------------

KEY = bytes(range(32))


def test_a_hello_with_the_same_key_authenticates_both_ways():
    client = ClientHello(PeerAuth("rx", KEY), TCP_HEADER, "seed")
    server = ServerHello(PeerAuth("seed", KEY), TCP_HEADER)
    challenge = server.challenge(client.hello())
    assert server.check(client.proof(challenge)) == "rx"
    assert KEY not in client.hello() + challenge + client.proof(challenge)  # the key never travels


def test_a_wrong_key_is_refused_and_each_side_says_whose_fault():
    client = ClientHello(PeerAuth("rx", KEY), TCP_HEADER, "seed")
    stranger = ServerHello(PeerAuth("seed", b"another key"), TCP_HEADER)
    with pytest.raises(HelloRefused, match=r"^data-plane keys differ \(requester's key id "):
        stranger.challenge(client.hello())
    # A server that claims the cluster's key id but cannot prove the key: the peer's fault.
    impostor = ServerHello(PeerAuth("seed", KEY), TCP_HEADER)
    challenge = bytearray(impostor.challenge(client.hello()))
    challenge[KEY_ID_BYTES + NONCE_BYTES] ^= 1  # its MAC
    with pytest.raises(PeerAuthError, match=r"^peer seed: authentication failed: the peer's hello names this "
                                            r"cluster's key but does not prove it") as caught:
        client.proof(bytes(challenge))
    assert caught.value.fault == "peer"
    # A server holding another key: the key ids differ, both are named.
    other = PeerAuth("seed", b"another key").key_id
    with pytest.raises(PeerAuthError, match=rf"another data-plane key: data-plane keys differ \(requester's key "
                                            rf"id {PeerAuth('rx', KEY).key_id.hex()}, server's key id {other.hex()}\)"
                       ) as caught:
        client.proof(other + bytes(NONCE_BYTES + 32) + b"seed")
    assert caught.value.fault == "keys differ"


def test_a_replayed_proof_or_challenge_fails():
    client = ClientHello(PeerAuth("rx", KEY), TCP_HEADER, "seed")
    first = ServerHello(PeerAuth("seed", KEY), TCP_HEADER)
    challenge = first.challenge(client.hello())
    proof = client.proof(challenge)
    replayed = ServerHello(PeerAuth("seed", KEY), TCP_HEADER)  # a new connection: a fresh server nonce
    replayed.challenge(client.hello())
    with pytest.raises(HelloRefused, match="forged or replayed"):
        replayed.check(proof)
    with pytest.raises(PeerAuthError, match="forged or replayed"):  # an old challenge to a new hello
        ClientHello(PeerAuth("rx", KEY), TCP_HEADER, "seed").proof(challenge)
    # A TCP proof is no UCX proof: the transcript binds the header format.
    ucx = ServerHello(PeerAuth("seed", KEY), UCX_HEADER)
    ucx_challenge = ucx.challenge(client.hello())
    with pytest.raises(PeerAuthError):
        client.proof(ucx_challenge)


def test_requests_are_checked_whole_before_anything_else():
    def parsed(kind, payload):
        return parse_request(Header(kind, 0, 0, len(payload)), payload, "p")

    for bad, problem in [(b"\xff\xfe\n\n", "not UTF-8"), (f"{PKG}".encode(), "1 fields"),
                         (b"../../x\nrx", "not a package id"), (f"{PKG}\nr x".encode(), "not a node id"),
                         (f"{PKG}\n".encode(), "not a node id")]:
        with pytest.raises(PeerProtocolError, match=problem):
            parsed(REQ_BLOCK, bad)
    with pytest.raises(PeerProtocolError, match="sent a request for file ''"):
        parsed(REQ_FILE, f"{PKG}\nrx\n".encode())


def test_an_answer_longer_than_asked_for_is_refused_before_allocation():
    check_answer(Header(FILE, length=1000), FILE, "file a", "p", file_answer_limit("a", 1000))
    with pytest.raises(PeerProtocolError, match=r"announced file a of 1001 bytes \(at most 1000 asked for\)"):
        check_answer(Header(FILE, length=1001), FILE, "file a", "p", file_answer_limit("a", 1000))
    with pytest.raises(PeerProtocolError, match="at most 33554432"):  # the manifest's cap: 32 MiB
        check_answer(Header(FILE, length=(32 << 20) + 1), FILE, "file manifest.json", "p",
                     file_answer_limit("manifest.json", 0))
    with pytest.raises(PeerProtocolError, match="error message of"):
        check_answer(Header(AUTH_FAIL, length=1 << 20), FILE, "file a", "p")
