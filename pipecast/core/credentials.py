"""Every credential of a pipecast cluster, derived from one master secret (the ``auth_token`` setting).

- The **master token** is the operator's: a caller presenting it may do anything.
- A **node token** ``pcn1.<node_id>.<mac>``, mac = base64url-nopad(HMAC-SHA256(master,
  ``b"pipecast node token v1\\0" + node_id``)), names its node and proves the master's holder issued it:
  the control plane checks it without storing anything, and it lets its holder act for that node only.
- The **data-plane key** HMAC-SHA256(master, ``b"pipecast data plane v1"``) keys the agents' mutual hello
  before block transfers; the control plane hands it to registered workers.
- The **serving key** HMAC-SHA256(data-plane key, ``b"pipecast serving v1"``) is what the router and the
  serving workers present to a serving worker (header :data:`SERVING_KEY_HEADER`): a worker learns it from
  its node agent, the router from the control plane (or from the master token). Holding it lets one send
  requests and pipeline stage calls to workers, not fetch blocks: the data-plane key is not derived from it.

Each derivation has its own label, so no credential turns into another. An empty master means auth off
(dev mode). Pure functions, no I/O (but for the one warning that auth is off).
"""

import base64
import hashlib
import hmac
import logging
from dataclasses import dataclass

from pipecast.core.errors import PipecastError

log = logging.getLogger(__name__)

OPERATOR = "operator"
NODE = "node"
MAX_NODE_ID = 128
NODE_TOKEN_PREFIX = "pcn1"
_NODE_LABEL = b"pipecast node token v1\x00"
_DATA_LABEL = b"pipecast data plane v1"
_SERVING_LABEL = b"pipecast serving v1"
# Every credential is an HMAC of the master and the key id and the hello's MACs are public: a guessable master
# is found offline. These bounds refuse the guessable ones (a random 16-character token holds ~95 bits).
MIN_MASTER_CHARS = 16
MIN_MASTER_DISTINCT = 8
#: The HTTP header that carries the serving key (hex) to a serving worker.
SERVING_KEY_HEADER = "X-Pipecast-Serving-Key"
_warned_auth_off: set[str] = set()
_warned_cleartext: set[str] = set()


class CredentialError(PipecastError, ValueError):
    """A node id or token that cannot be used as given (the message says what is wrong)."""


@dataclass(frozen=True)
class Principal:
    """Who is calling: ``role`` is :data:`OPERATOR` (the master token) or :data:`NODE` (a node token;
    ``name`` is then its node id)."""

    name: str
    role: str

    @property
    def is_operator(self) -> bool:
        return self.role == OPERATOR

    def may_act_for(self, node_id: str) -> bool:
        """Whether this principal may speak for ``node_id`` (the operator may speak for any node)."""
        return self.is_operator or (self.role == NODE and self.name == node_id)


def validate_node_id(node_id: str) -> str:
    """``node_id`` if usable (non-empty, printable ASCII, no white space, at most 128 characters; dots are fine: a
    token's node id is what lies between its first and its last '.', and the MAC has none); else
    :class:`CredentialError` saying what is wrong."""
    if not node_id:
        raise CredentialError("a node id must not be empty")
    if len(node_id) > MAX_NODE_ID:
        raise CredentialError(f"node id {node_id[:32]!r}... has {len(node_id)} characters; at most {MAX_NODE_ID}")
    if not node_id.isprintable():
        raise CredentialError(f"node id {node_id!r} has unprintable characters")
    if any(c.isspace() for c in node_id):
        raise CredentialError(f"node id {node_id!r} has white space")
    if _outside_ascii_at(node_id) is not None:  # its token could be issued, yet no client could present it
        raise CredentialError(f"node id {node_id!r} has characters other than ASCII: a node token names it, and "
                              "gRPC metadata, which carries tokens, takes printable ASCII only")
    return node_id


def _outside_ascii_at(text: str) -> int | None:
    """Where ``text`` first holds a character other than printable ASCII without spaces (0x21-0x7e, what a token in
    gRPC metadata may hold); None if nowhere."""
    return next((i for i, c in enumerate(text) if not "!" <= c <= "~"), None)


def _hmac(master: str, message: bytes) -> bytes:
    if not master:
        raise CredentialError("no master token is set (auth is off): there is no credential to derive")
    return hmac.new(master.encode(), message, hashlib.sha256).digest()


def _node_mac(master: str, node_id: str) -> str:
    return base64.urlsafe_b64encode(_hmac(master, _NODE_LABEL + node_id.encode())).rstrip(b"=").decode()


def issue_node_token(master: str, node_id: str) -> str:
    """The token that lets ``node_id`` (validated) act as itself in the cluster of ``master``."""
    return f"{NODE_TOKEN_PREFIX}.{validate_node_id(node_id)}.{_node_mac(master, node_id)}"


def parse_node_token(token: str) -> tuple[str, str] | None:
    """``(node_id, mac)`` of a token shaped like a node token (not verified), else None (e.g. a master)."""
    prefix, _, rest = token.partition(".")
    node_id, dot, mac = rest.rpartition(".")
    if prefix != NODE_TOKEN_PREFIX or not dot or not mac:
        return None
    try:
        return validate_node_id(node_id), mac
    except CredentialError:
        return None


def verify_node_token(master: str, token: str) -> str | None:
    """The node id ``token`` was issued for by ``master``'s holder, or None (malformed, forged, auth off).
    Constant-time in the mac."""
    parsed = parse_node_token(token) if master else None
    if parsed is None:
        return None
    node_id, mac = parsed
    return node_id if hmac.compare_digest(_raw(mac), _node_mac(master, node_id).encode()) else None


def principal_for(master: str, token: str) -> Principal | None:
    """Who ``token`` is in the cluster of ``master``: the operator, a node, or None (unknown or forged)."""
    if not master or not token:
        return None
    if hmac.compare_digest(_raw(token), master.encode()):
        return Principal(OPERATOR, OPERATOR)
    node_id = verify_node_token(master, token)
    return Principal(node_id, NODE) if node_id is not None else None


def data_plane_key(master: str) -> bytes:
    """The 32-byte key of the data-plane hello (agent-to-agent block transfers); b"" when ``master`` is
    empty (auth off)."""
    return _hmac(master, _DATA_LABEL) if master else b""


def serving_key(data_key: bytes) -> bytes:
    """The 32-byte serving key of the cluster whose data-plane key is ``data_key``; b"" when that is b""
    (auth off)."""
    return hmac.new(data_key, _SERVING_LABEL, hashlib.sha256).digest() if data_key else b""


def serving_headers(key: bytes) -> dict[str, str]:
    """The headers that present ``key`` to a serving worker (none when ``key`` is b"": auth off)."""
    return {SERVING_KEY_HEADER: key.hex()} if key else {}


def presents_key(presented: str | None, key: bytes) -> bool:
    """Whether ``presented`` (a :data:`SERVING_KEY_HEADER` value, hex, or None when absent) is ``key``;
    constant-time in the value."""
    return presented is not None and hmac.compare_digest(_raw(presented), key.hex().encode())


def _raw(presented: str) -> bytes:
    """A presented secret's bytes: a header's non-UTF-8 bytes come as surrogates (aiohttp decodes with
    surrogateescape), which a plain encode would raise on (a 500 instead of a refusal); any other lone surrogate
    is encoded as it stands (no secret holds one)."""
    return presented.encode("utf-8", "surrogatepass")


def check_client_token(token: str) -> str:
    """``token`` unchanged if gRPC metadata can carry it (empty: auth off); :class:`CredentialError` naming where
    it is not (a token read from a file with its trailing newline: gRPC refused the call with an error of its own
    core, which no caller took for a refusal, and an agent waited for its registration for good)."""
    if (first := _outside_ascii_at(token)) is not None:  # where, not what: the message must not show the secret
        raise CredentialError(
            f"auth_token: the token has a character other than printable ASCII (white space, a control character "
            f"or a non-ASCII one) at position {first + 1} of {len(token)}; gRPC metadata, which carries it, takes "
            "printable ASCII only (a trailing newline from a file?)")
    return token


def check_master_token(master: str) -> str:
    """``master`` unchanged if it is empty (auth off) or long and varied enough to resist offline guessing;
    :class:`CredentialError` naming what is wrong otherwise. The data-plane key's id and the hello's MACs, which
    any caller may see, are HMACs of it: a short or patterned master is recovered from them by guessing. A node
    token is refused too: it is a credential of the cluster, not the secret it derives from."""
    if not master:
        return master
    if (first := _outside_ascii_at(master)) is not None:  # where, not what: the message must not show the secret
        raise CredentialError(
            f"auth_token: the master token has a character other than printable ASCII (white space, a control "
            f"character or a non-ASCII one) at position {first + 1}; gRPC metadata, which carries it, takes printable "
            "ASCII only: make one with `openssl rand -hex 32`")
    parsed = parse_node_token(master)
    if parsed is not None:
        raise CredentialError(
            f"auth_token: the master token is a node token (of node {parsed[0]!r}, from `pipecast cp issue-token`); "
            "the control plane needs the cluster's master secret, from which node tokens derive: make one with "
            "`openssl rand -hex 32`")
    if len(master) < MIN_MASTER_CHARS or len(set(master)) < MIN_MASTER_DISTINCT:
        raise CredentialError(
            f"auth_token: the master token has {len(master)} characters, {len(set(master))} of them different; "
            f"it needs at least {MIN_MASTER_CHARS}, {MIN_MASTER_DISTINCT} different (every credential derives "
            f"from it and can be guessed offline from what the cluster shows anyone): make one with `openssl rand "
            f"-hex 32`")
    return master


def warn_if_cleartext(token: str, tls: bool, component: str) -> bool:
    """True (and a warning, once per component and process) when ``token`` is set but ``tls`` is off: the control
    plane's calls carry tokens, and its answers the data-plane and serving keys, in the clear."""
    if not token or tls:
        return False
    if component not in _warned_cleartext:
        _warned_cleartext.add(component)
        log.warning("%s: authentication is on but TLS is off: tokens, the data-plane key and the serving key cross "
                    "the network in the clear (set tls_cert and tls_key on the control plane, tls_ca on its "
                    "clients)", component)
    return True


def warn_if_auth_off(master: str, component: str) -> bool:
    """True (and a warning, once per component and process) when ``master`` is empty: auth is off."""
    if master:
        return False
    if component not in _warned_auth_off:
        _warned_auth_off.add(component)
        log.warning("%s: no auth_token set: authentication is OFF (dev mode); anyone who can reach it may "
                    "act as the operator", component)
    return True
