"""Fuzzing the wire parsers in both directions (issue #12): whatever bytes a peer sends, a parser answers
with its value or a typed peer error, never another exception."""

from hypothesis import given, settings
from hypothesis import strategies as st

from pipecast.agent.errors import PeerAuthError, PeerProtocolError
from pipecast.agent.transport.base import PeerAuth
from pipecast.agent.transport.wire import (
    MAC_BYTES,
    REQUESTS,
    TCP_HEADER,
    UCX_HEADER,
    ClientHello,
    Header,
    HelloRefused,
    ServerHello,
    check_answer,
    check_chunk,
    parse_request,
    request_payload,
)

KEY = bytes(range(32))
PEER = "fuzzer"
u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
headers = st.builds(Header, kind=st.integers(0, 255), block=u32, chunk=u32, length=u64, frame=u32)
# Valid-looking requests mutated byte by byte reach deeper into the parser than random bytes alone.
payloads = st.one_of(
    st.binary(max_size=600),
    st.builds(lambda pid, who, path, cut: request_payload(pid, who, path)[:cut],
              st.text("0123456789abcdef", min_size=60, max_size=66), st.text(max_size=40),
              st.none() | st.text(max_size=80), st.integers(0, 400)),
    st.builds(lambda pid, who, end, cut: request_payload(pid, who, end_chunk=end)[:cut],
              st.text("0123456789abcdef", min_size=64, max_size=64), st.text("abc-", min_size=1, max_size=8),
              st.integers(-10, 2**40), st.integers(60, 400)),
)


@settings(max_examples=400, deadline=None)
@given(raw=st.binary(max_size=40), fmt=st.sampled_from([TCP_HEADER, UCX_HEADER]))
def test_any_bytes_parse_to_a_header_or_a_protocol_error(raw, fmt):
    try:
        header = fmt.parse(raw, PEER)
    except PeerProtocolError as exc:
        assert PEER in str(exc)
    else:
        assert fmt.pack(header)[:fmt.size] == raw[:fmt.size]


@settings(max_examples=600, deadline=None)
@given(kind=st.sampled_from(REQUESTS) | st.integers(0, 255), block=u32, chunk=u32, payload=payloads)
def test_any_request_parses_or_is_a_protocol_error(kind, block, chunk, payload):
    try:
        request = parse_request(Header(kind, block, chunk, len(payload)), payload, PEER)
    except PeerProtocolError:
        return
    assert len(request.package_id) == 64 and request.requester
    assert request.end_chunk is None or 0 <= request.end_chunk <= 2**32


@settings(max_examples=400, deadline=None)
@given(header=headers, expected=u64, limit=u64)
def test_any_answer_header_is_accepted_or_a_protocol_error(header, expected, limit):
    try:
        check_answer(header, expected, "the manifest", PEER, limit)
    except PeerProtocolError:
        pass
    try:
        check_chunk(header, header.block, 0, min(expected, 2**32), PEER)
    except PeerProtocolError:
        pass


@settings(max_examples=400, deadline=None)
@given(hello=st.binary(max_size=400), proof=st.binary(max_size=64))
def test_the_serving_side_of_the_hello_refuses_any_forged_message(hello, proof):
    server = ServerHello(PeerAuth("server", KEY), TCP_HEADER)
    try:
        server.challenge(hello)
    except HelloRefused:
        return
    try:
        server.check(proof)
    except HelloRefused:
        return
    raise AssertionError("a random proof was accepted")


@settings(max_examples=400, deadline=None)
@given(challenge=st.binary(max_size=400))
def test_the_requesting_side_of_the_hello_refuses_any_forged_challenge(challenge):
    client = ClientHello(PeerAuth("client", KEY), UCX_HEADER, PEER)
    try:
        proof = client.proof(challenge)
    except (PeerProtocolError, PeerAuthError) as exc:
        assert PEER in str(exc)
    else:
        raise AssertionError(f"a random challenge got a proof of {len(proof)} bytes (MAC is {MAC_BYTES})")
