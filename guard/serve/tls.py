"""TLS for guard's listeners: certificates re-read when they change, and who may call.

``server_credentials(tls)``: gRPC server credentials whose certificate, key and client CA are
re-read from their files when one of them changes (a cert-manager renewal, a Secret update):
gRPC asks before each new TLS handshake, and this answers from a stat of the three files (no
read while nothing changed). Connections already open keep the certificate they were made
with. A changed set that cannot be read or parsed is reported once (event
``tls_reload_failed``) and the last good one stays in use.

``CallerCheck``: the allow-list of a control listener (admin API, tap). Under mutual TLS the
caller's identities are its certificate's subject alternative names (DNS, URI such as a
SPIFFE id, IP, e-mail) and its common name; a call is allowed when one of them is in
``allowed_identities`` (an empty list allows every certificate the client CA signed). The
caller's name for events is the first identity with the peer address, or the peer address
alone on a plaintext loopback listener.
"""

from __future__ import annotations

import logging
import os
import threading

import grpc

from guard.observe.events import emit

log = logging.getLogger("guard.tls")


def _stamp(paths: tuple[str, ...]) -> tuple:
    out: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = os.stat(path)
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            out.append(None)
    return tuple(out)


class ReloadingCertificates:
    """The fetcher behind ``grpc.dynamic_ssl_server_credentials``."""

    def __init__(self, cert_file: str, key_file: str, client_ca_file: str | None):
        self.paths = tuple(p for p in (cert_file, key_file, client_ca_file) if p)
        self.client_ca_file = client_ca_file
        self._lock = threading.Lock()
        self._stamp = _stamp(self.paths)
        self.reloads = 0
        self.initial = self._configuration()  # raises when the files are unusable at start

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        read = lambda path: open(path, "rb").read()  # noqa: E731
        cert, key = read(self.paths[0]), read(self.paths[1])
        for what, data in (("cert_file", cert), ("key_file", key)):
            if b"-----BEGIN" not in data:
                raise ValueError(f"{what}: not PEM")
        ca = read(self.client_ca_file) if self.client_ca_file else None
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        """Called by gRPC before a handshake: a new configuration, or None (no change)."""
        stamp = _stamp(self.paths)
        with self._lock:
            if stamp == self._stamp:
                return None
            self._stamp = stamp
        try:
            configuration = self._configuration()
        except Exception as exc:  # a half-written renewal: keep the last good certificate
            emit("tls_reload_failed", files=list(self.paths), error=f"{type(exc).__name__}: "
                 f"{exc}", note="the previous certificate stays in use")
            return None
        self.reloads += 1
        emit("tls_reloaded", files=list(self.paths))
        return configuration


def server_credentials(tls) -> grpc.ServerCredentials | None:
    """Credentials for a listener's ``tls`` block (None: plaintext). Files are re-read when they
    change; a block with ``client_ca_file`` requires a client certificate (mutual TLS)."""
    if tls is None:
        return None
    certificates = ReloadingCertificates(tls.cert_file, tls.key_file, tls.client_ca_file)
    return grpc.dynamic_ssl_server_credentials(
        certificates.initial, certificates,
        require_client_authentication=tls.client_ca_file is not None)


def peer_identities(context) -> list[str]:
    """The client certificate's identities (SANs, then the CN), empty without one."""
    try:
        auth = context.auth_context() or {}
    except Exception:  # not a TLS connection
        return []
    names = [*auth.get("x509_subject_alternative_name", ()), *auth.get("x509_common_name", ())]
    seen: dict[str, None] = {}
    for name in names:
        seen.setdefault(name.decode(errors="replace"), None)
    return list(seen)


class CallerCheck:
    """Who may call a control listener, and how the caller is named in events."""

    def __init__(self, listener: str, tls=None):
        self.listener = listener
        self.allowed = frozenset(getattr(tls, "allowed_identities", None) or ())

    def caller(self, context) -> tuple[str, bool]:
        """(the caller's name, whether it is allowed)."""
        identities = peer_identities(context)
        peer = context.peer() or "unknown peer"
        if not self.allowed:
            return (f"{identities[0]} ({peer})" if identities else peer), True
        matched = [i for i in identities if i in self.allowed]
        if matched:
            return f"{matched[0]} ({peer})", True
        return (f"{identities[0] if identities else 'no certificate'} ({peer})"), False

    async def check(self, context, method: str) -> str:
        """The caller's name; aborts with PERMISSION_DENIED (and an event) when not allowed."""
        who, allowed = self.caller(context)
        if not allowed:
            emit("access_denied", listener=self.listener, method=method, caller=who)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED,
                                f"{who}: this client certificate's identity is not in "
                                f"{self.listener}'s allowed_identities")
        return who
