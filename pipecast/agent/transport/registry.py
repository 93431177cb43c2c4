"""Which transport an agent uses: a small registry with auto-detection.

``auto`` takes the first accelerated backend (UCX) that imports and whose hardware is present (a GPU or
an RDMA device), else TCP. A node whose settings name the data plane's TLS files gets only a
backend that encrypts (TCP): ``auto`` skips the others and naming one is refused. Each backend is an entry
of ``_REGISTRY`` naming its class as ``module:attribute``, imported only when chosen, so a heavy backend
(ucxx) costs nothing otherwise.
"""

import importlib
import importlib.util
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from pipecast.agent.errors import TransportUnavailableError
from pipecast.agent.transport.base import PeerAuth, Transport
from pipecast.core.settings import Settings

log = logging.getLogger(__name__)


def accelerated_fabric_present() -> bool:
    """Whether this node has a GPU or an RDMA device, the hardware a UCX backend is for."""
    return os.path.exists("/dev/nvidiactl") or bool(os.path.isdir("/sys/class/infiniband")
                                                     and os.listdir("/sys/class/infiniband"))


@dataclass(frozen=True)
class TransportEntry:
    """A backend: its name, its class (``module:attribute``), the modules it needs, when auto picks it,
    whether it runs the data plane's mutual TLS.

    The class is built as ``cls(node_id, settings, auth)``.
    """

    name: str
    target: str
    requires: tuple[str, ...] = ()
    preferred: Callable[[], bool] = lambda: False
    encrypts: bool = False

    def importable(self) -> bool:
        return all(importlib.util.find_spec(module) is not None for module in self.requires)

    def import_failure(self) -> str | None:
        """Why the modules it needs, installed, do not import (a broken native library), or None: they do."""
        for module in self.requires:
            try:
                importlib.import_module(module)
            except (ImportError, OSError) as exc:
                return f"{module}: {exc}"
        return None


_REGISTRY: dict[str, TransportEntry] = {
    "tcp": TransportEntry("tcp", "pipecast.agent.transport.tcp:TcpTransport", encrypts=True),
    # The UCX backend (RDMA, GPU memory) lives in its own module; it is usable once that module and the
    # ucx extra (pip install 'pipecast[ucx]') are both there.
    "ucx": TransportEntry("ucx", "pipecast.agent.transport.ucx:UcxTransport",
                          requires=("ucxx", "pipecast.agent.transport.ucx"), preferred=accelerated_fabric_present),
}


def transport_names() -> list[str]:
    """Registered backends, plus ``auto``."""
    return ["auto", *_REGISTRY]


def data_plane_tls(settings: Settings) -> bool:
    """Whether ``settings`` name the files of the data plane's mutual TLS (all three, as TCP needs them)."""
    return bool(settings.tls_cert and settings.tls_key and settings.tls_ca)


def resolve_transport_name(name: str, tls: bool = False) -> str:
    """The backend ``name`` means on this node (``auto`` resolved), with the data plane's TLS files named
    (``tls``) or not; raise if it cannot be used here."""
    if name == "auto":
        for entry in _REGISTRY.values():
            if entry.name != "tcp" and (entry.encrypts or not tls) and entry.importable() and entry.preferred():
                # Imported here, not only found: an installed backend whose native library does not load would
                # otherwise fail the agent at listen instead of leaving it TCP.
                failure = entry.import_failure()
                if failure is None:
                    return entry.name
                log.warning("%s unusable (%s); using tcp", entry.name, failure)
        return "tcp"
    entry = _REGISTRY.get(name)
    if entry is None:
        raise TransportUnavailableError(f"transport {name!r} is not registered (known: "
                                        f"{', '.join(transport_names())})")
    if tls and not entry.encrypts:
        # Running it would send blocks in the clear on a node whose operator asked for TLS.
        raise TransportUnavailableError(f"transport {name!r} does not encrypt its traffic, but this node's settings "
                                        f"name TLS files (tls_cert, tls_key, tls_ca): use transport 'tcp' (mutual "
                                        f"TLS) or drop the tls_* settings")
    if not entry.importable():
        missing = [m for m in entry.requires if importlib.util.find_spec(m) is None]
        raise TransportUnavailableError(f"transport {name!r} cannot be used on this node: "
                                        f"{', '.join(missing)} not installed")
    failure = entry.import_failure()
    if failure is not None:  # installed, but its native library does not load: said here, not as a traceback
        raise TransportUnavailableError(f"transport {name!r} cannot be used on this node: {failure}")
    return name


def select_transport(name: str, node_id: str, settings: Settings, auth: PeerAuth | None = None) -> Transport:
    """Build the transport ``name`` (``auto``, ``tcp``, ...) for the agent ``node_id`` with its data-plane
    credentials ``auth`` (None: those the settings' ``auth_token`` gives)."""
    resolved = resolve_transport_name(name, data_plane_tls(settings))
    module, attribute = _REGISTRY[resolved].target.split(":")
    log.info("transport: %s%s", resolved, " (auto)" if name == "auto" else "")
    return getattr(importlib.import_module(module), attribute)(node_id, settings, auth)
