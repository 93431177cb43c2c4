"""HTTP base URLs as operators and registrations write them (a worker's serve URL, a router's URL)."""

from urllib.parse import urlsplit


def http_base_url(url: str) -> str | None:
    """``url`` as an http(s) base URL without a trailing slash (a host, no query or fragment); None when it
    is not one (a port that is not a number included)."""
    try:
        parsed = urlsplit(url.strip())
        host, _ = parsed.hostname, parsed.port
    except ValueError:
        return None
    if parsed.scheme not in ("http", "https") or not host or parsed.query or parsed.fragment:
        return None
    return f"{parsed.scheme}://{parsed.netloc}{parsed.path}".rstrip("/")
