"""The wire format both transports share: headers, the hello, requests and answers checked whole, payload
views. Transfers are tested per backend (test_tcp.py, test_ucx.py) and for all of them
(test_conformance.py)."""

import numpy as np
import pytest

from packager.manifest import MANIFEST_FILE, MAX_MANIFEST_BYTES
from pipecast.agent.errors import PeerAuthError, PeerProtocolError
from pipecast.agent.transport.base import PeerAuth
from pipecast.agent.transport.wire import (
    AUTH_FAIL,
    CHUNK,
    ERROR,
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
    answer_request,
    block_request_payload,
    byte_view,
    check_answer,
    check_message,
    file_answer_limit,
    frames,
    parse_request,
    range_end,
    request_payload,
)


def test_headers_keep_their_sizes_and_round_trip():
    assert (TCP_HEADER.size, UCX_HEADER.size) == (20, 24)
    header = Header(CHUNK, 3, 7, 1 << 20)
    assert TCP_HEADER.parse(TCP_HEADER.pack(header), "p") == header
    framed = Header(CHUNK, 3, 7, 1 << 20, 64 << 10)
    assert UCX_HEADER.parse(UCX_HEADER.pack(framed), "p") == framed
    with pytest.raises(PeerProtocolError, match=r"^peer p: sent a header with magic b'PU' version 4 \(expected b'PC'"):
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
    with pytest.raises(PeerProtocolError, match=f"at most {MAX_MANIFEST_BYTES}"):  # the manifest's cap
        check_answer(Header(FILE, length=MAX_MANIFEST_BYTES + 1), FILE, "file manifest.json", "p",
                     file_answer_limit(MANIFEST_FILE, 0))
    with pytest.raises(PeerProtocolError, match="error message of"):
        check_answer(Header(AUTH_FAIL, length=1 << 20), FILE, "file a", "p")


def test_every_manifest_the_packager_allows_is_taken_whole_from_a_peer():
    """Found in review: the wire took manifests of at most 32 MiB while the packager packs them up to 64 MiB, so
    every receiver refused a 450-870 GB model's manifest and blamed the seed that served it."""
    assert file_answer_limit(MANIFEST_FILE, 0) == MAX_MANIFEST_BYTES
    check_answer(Header(FILE, length=MAX_MANIFEST_BYTES), FILE, "file manifest.json", "p",
                 file_answer_limit(MANIFEST_FILE, 0))


# -- chunk ranges (issue #16) ------------------------------------------------------------------------------


def test_a_block_request_may_name_its_end_chunk_and_a_whole_block_request_stays_as_it_was():
    ranged = request_payload(PKG, "node-a", end_chunk=9)
    assert ranged == f"{PKG}\nnode-a\n9".encode()
    request = parse_request(Header(REQ_BLOCK, 3, 5, len(ranged)), ranged, "p")
    assert (request.block, request.chunk, request.end_chunk, request.path) == (3, 5, 9, "")
    old = request_payload(PKG, "node-a")  # what requesters sent before ranges: served to the block's end
    assert old == f"{PKG}\nnode-a".encode()
    assert parse_request(Header(REQ_BLOCK, 3, 5, len(old)), old, "p").end_chunk is None
    # A range that runs to the block's end goes without the end line, so servers that predate ranges serve it.
    assert block_request_payload(PKG, "node-a", 27, 27) == old
    assert block_request_payload(PKG, "node-a", 9, 27) == ranged
    assert range_end(3, 5, None, 27) == 27 and range_end(3, 5, 9, 27) == 9
    with pytest.raises(ValueError, match="^block 3 has 27 chunks: no chunk range 5-28$"):
        range_end(3, 5, 28, 27)
    with pytest.raises(ValueError, match="a file or an end chunk"):
        request_payload(PKG, "node-a", "config.json", 9)


@pytest.mark.parametrize("end", ["", "-1", "+3", " 3", "3 ", "03", "1e3", "0x10", "\u0663", "4294967297",
                                 "99999999999"])
def test_a_malformed_end_chunk_is_a_protocol_error_naming_the_peer(end):
    payload = f"{PKG}\nrx\n{end}".encode()
    with pytest.raises(PeerProtocolError, match=r"^peer p: sent a request with end chunk .* which is not a chunk "
                                                r"number \(decimal, at most 4294967296\)$"):
        parse_request(Header(REQ_BLOCK, 0, 0, len(payload)), payload, "p")


def test_a_block_request_of_four_fields_is_a_protocol_error():
    payload = f"{PKG}\nrx\n3\n4".encode()
    with pytest.raises(PeerProtocolError, match="sent a request of 4 fields"):
        parse_request(Header(REQ_BLOCK, 0, 0, len(payload)), payload, "p")


class Served:
    """A block of ``count`` chunks, every one here; records the requests it admitted."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.requested: list[int | None] = []

    async def admit(self, requester: str, package_id: str) -> None:
        return None

    async def chunk_count(self, package_id: str, block: int) -> int:
        return self.count

    async def wait_chunk(self, package_id: str, block: int, chunk: int) -> memoryview:
        return memoryview(bytes([chunk]) * 4)

    def peer_requested(self, requester: str, package_id: str, block: int | None) -> None:
        self.requested.append(block)


async def answers(served: Served, first: int, end: int | None) -> list[tuple[int, int, bytes]]:
    """What ``answer_request`` sends for chunks ``first`` .. ``end`` of block 3: (kind, chunk, payload)."""
    sent = []

    async def send(header: Header, payload: memoryview) -> None:
        sent.append((header.kind, header.chunk, bytes(payload)))

    payload = request_payload(PKG, "rx", end_chunk=end)
    await answer_request(served, parse_request(Header(REQ_BLOCK, 3, first, len(payload)), payload, "p"), send, "p")
    return sent


@pytest.mark.parametrize("first, end, chunks", [(5, 9, [5, 6, 7, 8]), (24, 27, [24, 25, 26]),
                                                (26, None, [26]), (0, 1, [0])])
async def test_the_server_sends_exactly_the_range_asked_for(first, end, chunks):
    served = Served(27)
    assert await answers(served, first, end) == [(CHUNK, c, bytes([c]) * 4) for c in chunks]
    assert served.requested == [3]


@pytest.mark.parametrize("first, end", [(5, 40), (5, 5), (9, 5), (27, 28), (30, 31)])
async def test_a_chunk_range_the_block_lacks_is_refused_with_an_error_and_nothing_is_recorded(first, end):
    served = Served(27)
    [(kind, chunk, text)] = await answers(served, first, end)
    assert (kind, chunk) == (ERROR, first)
    assert text.decode() == f"block 3 has no chunk range {first}-{end} (it has 27 chunks)"
    assert served.requested == []
