"""The wire format both transports share: headers, requests, payload views. Transfers are tested per
backend (test_tcp.py, test_ucx.py) and for all of them (test_conformance.py)."""

import numpy as np
import pytest

from pipecast.agent.errors import PeerProtocolError
from pipecast.agent.transport.wire import (
    CHUNK,
    REQ_BLOCK,
    REQ_FILE,
    TCP_HEADER,
    UCX_HEADER,
    Header,
    byte_view,
    check_request,
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
    with pytest.raises(PeerProtocolError, match=r"^peer p: sent a header with magic b'PU' version 2 \(expected b'PC'"):
        TCP_HEADER.parse(UCX_HEADER.pack(header), "p")
    with pytest.raises(PeerProtocolError, match="frame size of 16 bytes"):
        UCX_HEADER.parse(UCX_HEADER.pack(Header(CHUNK, length=100, frame=16)), "p")


def test_requests_parse_what_requesters_send():
    block = request_payload("pkg", "node-a")
    request = parse_request(Header(REQ_BLOCK, 2, 5, len(block)), block)
    assert (request.kind, request.block, request.chunk, request.package_id, request.requester, request.path) == \
        (REQ_BLOCK, 2, 5, "pkg", "node-a", "")
    file = request_payload("pkg", "node-a", "config.json")
    assert parse_request(Header(REQ_FILE, 0, 100, len(file)), file).path == "config.json"
    with pytest.raises(PeerProtocolError, match="sent message type 3 of 10 bytes as a request"):
        check_request(Header(CHUNK, length=10), "p")
    with pytest.raises(PeerProtocolError, match="of 5000 bytes as a request"):
        check_request(Header(REQ_BLOCK, length=5000), "p")


def test_payloads_split_into_frames():
    assert frames(0, 0) == [] and frames(10, 0) == [(0, 10)]
    assert frames(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_typed_buffers_travel_as_flat_bytes():
    weights = np.arange(6, dtype=np.float32).reshape(2, 3)
    view = byte_view(memoryview(weights))
    assert (view.format, view.ndim, len(view)) == ("B", 1, weights.nbytes)
    assert bytes(view) == weights.tobytes()
