"""Certificates for TLS runs and tests, made with the openssl command: a CA and certificates it signed."""

import shutil
import subprocess
from pathlib import Path

from pipecast.core.errors import PipecastError


class CertificateError(PipecastError):
    """The openssl command is missing or failed."""


def have_openssl() -> bool:
    """Whether certificates can be made here."""
    return shutil.which("openssl") is not None


def make_certs(folder: Path, ca: str = "ca") -> dict[str, Path]:
    """A CA ``<ca>.pem``, a ``server`` certificate for 127.0.0.1 (no usage restriction: a node's data plane
    uses it as server and as client) and a ``client`` certificate, both signed by it, in ``folder``."""
    def openssl(*args):
        if not have_openssl():
            raise CertificateError("making TLS certificates needs the openssl command")
        done = subprocess.run(["openssl", *args], capture_output=True, text=True, cwd=folder)
        if done.returncode:
            raise CertificateError(f"openssl {args[0]} failed: {done.stderr.strip()[-300:]}")

    openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
            "-subj", f"/CN=test-{ca}", "-keyout", f"{ca}.key", "-out", f"{ca}.pem")
    for name, ext in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-subj", f"/CN={name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr")
        (folder / f"{name}.ext").write_text(ext + "\n")
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
                "-days", "1", "-extfile", f"{name}.ext", "-out", f"{name}.pem")
    return {name: folder / name for name in (f"{ca}.pem", "server.pem", "server.key", "client.pem", "client.key")}
