"""HTTP base URLs as operators and registrations write them (a worker's serve URL, a router's URL)."""

from urllib.parse import urlsplit

DEFAULT_PORTS = {"http": 80, "https": 443}


def http_base_url(url: str) -> str | None:
    """``url`` as an http(s) base URL without a trailing slash (a host, no query or fragment); None when it
    is not one (a port that is not a number, or empty, a host name no resolver takes, and white space or control
    characters included)."""
    url = url.strip()
    if any(c.isspace() or not c.isprintable() for c in url):  # urlsplit keeps them in the host
        return None
    try:
        parsed = urlsplit(url)
        host, _ = parsed.hostname, parsed.port
    except ValueError:
        return None
    if (parsed.scheme not in ("http", "https") or not host or parsed.query or parsed.fragment
            or parsed.netloc.endswith(":")):
        return None
    try:
        host.encode("idna")  # what resolving it does: an empty label or one over 63 characters fails there
    except UnicodeError:
        return None
    return f"{parsed.scheme}://{parsed.netloc}{parsed.path}".rstrip("/")


def one_spelling(base: str) -> str:
    """An http(s) base URL (as :func:`http_base_url` gives it) in one spelling: its host in lower case, no default
    port. Two spellings of one router or worker (a host's case, a default port written out) then compare equal."""
    parts = urlsplit(base)
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    port = "" if parts.port in (None, DEFAULT_PORTS[parts.scheme]) else f":{parts.port}"
    return f"{parts.scheme}://{host}{port}{parts.path}"
