"""Typed errors of the control plane, and how they cross gRPC in both directions.

The server raises these from the state model; the service answers with the class's status code, the
message as details and the class name in the ``pipecast-error`` trailer; the client raises the same
class with the server's exact message, so an agent or the CLI can tell e.g. :class:`UnknownWorker`
(register again) from :class:`UnknownPackage` although both are NOT_FOUND.
"""

import grpc

from pipecast.core.errors import PipecastError

ERROR_TRAILER = "pipecast-error"
#: A standby control plane answers every call UNAVAILABLE with the leader's address in this trailer.
LEADER_TRAILER = "pipecast-leader"
#: The metadata naming one call of a client, the same on each replica it tries: a change retried after its answer
#: was lost (a connection cut) is answered as it was by the replica that made it (its memory keeps the answers); a
#: retry reaching a new leader, the first gone after its commit, is made again there (README, control plane).
REQUEST_ID_KEY = "pipecast-request-id"
MAX_REQUEST_ID_CHARS = 64


class ControlPlaneError(PipecastError):
    """Base of every control plane error."""

    code = grpc.StatusCode.INTERNAL


class UnknownWorker(ControlPlaneError):
    """The caller named a worker that is not registered or whose lease lapsed (it must register again)."""

    code = grpc.StatusCode.NOT_FOUND

    @classmethod
    def named(cls, node_id: str) -> "UnknownWorker":
        return cls(f"worker {node_id!r} is not registered (or its lease lapsed): register it again")

    @classmethod
    def restored(cls, node_id: str) -> "UnknownWorker":
        """A worker known from the database only: its last reports may not have been written there."""
        return cls(f"worker {node_id!r} registered before the control plane restarted (or another replica took "
                   "over): register it again with every block it holds")


class UnknownPackage(ControlPlaneError):
    """The caller named a package that was never published or was removed."""

    code = grpc.StatusCode.NOT_FOUND

    @classmethod
    def named(cls, package_id: str) -> "UnknownPackage":
        return cls(f"package {package_id!r} is not published")


class UnknownDeployment(ControlPlaneError):
    """The caller named a package that has no deployment."""

    code = grpc.StatusCode.NOT_FOUND

    @classmethod
    def named(cls, package_id: str) -> "UnknownDeployment":
        return cls(f"package {package_id!r} has no deployment")


class UnknownRoute(ControlPlaneError):
    """The caller named a served model that has no route."""

    code = grpc.StatusCode.NOT_FOUND

    @classmethod
    def named(cls, name: str) -> "UnknownRoute":
        return cls(f"served model {name!r} has no route (pipecast cp route {name} PACKAGE creates it)")


class InvalidRequest(ControlPlaneError):
    """The caller sent a request that can never succeed as written (bad block index, bad strategy)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class Conflict(ControlPlaneError):
    """The request clashes with the current state (a package in use, a worker already receiving it)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class NodeIdInUse(Conflict):
    """A worker registered under the node id of a live worker at another address: two agents were given one id.
    Retrying cannot fix it while the other one renews its lease."""

    @classmethod
    def by(cls, node_id: str, live_address: str, address: str, lease_left_s: float) -> "NodeIdInUse":
        return cls(f"node id {node_id!r} is in use by a live worker at {live_address}: registration from {address} "
                   f"refused (that worker's lease ends in {lease_left_s:.1f} s unless it renews it; give this agent "
                   "another --node-id, or stop the other one; an agent restarted at the same address is accepted)")


class NoSource(Conflict):
    """A scale-up has no node to send the package from: no worker holds all of it and its store is a receiver, or
    none of them speaks a receiver's data-plane transport."""


class DraftStale(Conflict):
    """A scale-up's plan was made from a draft that the cluster changed under meanwhile (a receiver or source gone,
    a receiver taken by another scale-up): nothing was installed. The service drafts and plans it again a few
    times before answering this; retrying may succeed."""


class InsufficientWorkers(ControlPlaneError):
    """A scale-up asked for more workers than are alive, eligible and have memory for the package."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(ControlPlaneError):
    """The control plane refused our token: the caller's configuration is wrong."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(ControlPlaneError):
    """The caller's token is valid but does not allow this call: a node token acting for another node,
    or an operator call made with a node token. Retrying cannot fix it."""

    code = grpc.StatusCode.PERMISSION_DENIED


class ControlPlaneUnavailable(ControlPlaneError):
    """The control plane could not be reached or did not answer within the deadline."""

    code = grpc.StatusCode.UNAVAILABLE


class ControlPlaneDeadlineExceeded(ControlPlaneUnavailable):
    """The control plane did not answer within the call's deadline: unlike a refused connection or a standby's
    answer, a change the call carried may have been made (its handler runs on after its caller's deadline)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class TlsConfigError(ControlPlaneError):
    """A TLS certificate, key or CA file that cannot be used: the operator's configuration."""


class MalformedUpdate(ControlPlaneError):
    """The control plane sent an assignment update this worker cannot read: the control plane's fault (a bug,
    or a version that encodes parts otherwise), never the worker's; the worker reconnects and retries."""

    code = grpc.StatusCode.DATA_LOSS


class StoreError(ControlPlaneError):
    """The control plane's database cannot be opened, read or written (the path is the operator's)."""


class ChangeNotStored(ControlPlaneError):
    """A call's change was made (agents may have been told of it) but the database refused to store it: it is
    written by the next flush that succeeds, and lost if the control plane stops first. Not a refusal: a caller
    must not make the change again."""

    code = grpc.StatusCode.ABORTED


#: How the control plane's refusal of a call without a valid token begins (control_plane.auth.DENIED).
NO_TOKEN = "missing or wrong token"

_BY_NAME: dict[str, type[ControlPlaneError]] = {
    cls.__name__: cls for cls in (UnknownWorker, UnknownPackage, UnknownDeployment, UnknownRoute, InvalidRequest,
                                  Conflict, NodeIdInUse, NoSource, DraftStale, InsufficientWorkers, Unauthenticated,
                                  PermissionDenied, ControlPlaneUnavailable, ChangeNotStored)
}


def error_from_rpc(error: grpc.aio.AioRpcError, *, target: str, method: str) -> ControlPlaneError:
    """The typed error for a failed call: the server's class and message, or which call went unanswered."""
    code = error.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        unanswered = ControlPlaneDeadlineExceeded if code == grpc.StatusCode.DEADLINE_EXCEEDED else \
            ControlPlaneUnavailable
        return unanswered(f"control plane at {target} did not answer {method}: {code.name}: {error.details()}")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        details = error.details() or ""
        if details.startswith(NO_TOKEN):  # the server's words are for any gRPC client: say what a pipecast user sets
            details = (f"{NO_TOKEN}: give the control plane's master token, or a node token from `pipecast cp "
                       "issue-token NODE`, as PIPECAST_AUTH_TOKEN (settings: auth_token; `pipecast cp --token-file`)")
        return Unauthenticated(f"control plane at {target} refused {method}: {details}")
    trailer = dict(error.trailing_metadata() or ()).get(ERROR_TRAILER, "")
    if not trailer:  # not a typed error of the server's: "Method not found!" alone named neither call nor server
        hint = " (is a pipecast control plane listening there?)" if code == grpc.StatusCode.UNIMPLEMENTED else ""
        return ControlPlaneError(f"control plane at {target} failed {method}: {code.name}: {error.details()}{hint}")
    return _BY_NAME.get(trailer, ControlPlaneError)(error.details() or f"{method} failed: {code.name}")
