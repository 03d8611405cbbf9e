"""etcd's and gRPC's failures as our errors: one line that names the cause and the fix.

A refused certificate, password or permission is a :class:`CredentialsError` (a user
mistake, printed as one line by the CLI); anything else is a
:class:`StoreConnectionError` (retryable: etcd restarting looks the same for a moment).
Only the etcd seam (``etcd_kv``) calls :func:`translate`, and it keeps the cause
(``raise translate(...) from exc``).
"""

from __future__ import annotations

from typing import cast

import grpc

from elastic_rt.config import ETCD_PASSWORD_ENV, EtcdAuth
from elastic_rt.errors import CredentialsError, ElasticError, StoreConnectionError

SECURITY_GUIDE = "docs/etcd-security.md"
"""Where a user reads how to set up etcd's TLS and users."""
# TLS alerts a server sends when it does not accept our client certificate.
_CLIENT_CERT_ALERTS = ("BAD_CERTIFICATE", "CERTIFICATE_REQUIRED", "UNKNOWN_CA")


def translate(exc: BaseException, what: str, *, endpoint: str, auth: EtcdAuth
              ) -> ElasticError:
    """One line that names the cause, for a gRPC error or an etcd3 wrapper of one."""
    rpc = exc if isinstance(exc, grpc.RpcError) else exc.__context__
    has_code = isinstance(rpc, grpc.RpcError) and hasattr(rpc, "code")
    call = cast(grpc.Call, rpc) if has_code else None
    code = call.code() if call is not None else None
    details = (call.details() or "") if call is not None and code is not None else str(exc)
    short = _short(details)
    user = auth.user
    is_handshake = "handshake failed" in details.lower()
    refused = _tls_refusal(details, endpoint, auth) if is_handshake else None
    if refused is not None:
        return refused
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        fix = (
            f"Grant etcd user {user!r} readwrite on its run's prefix /elastic_rt/<run_id>/ "
            f"({SECURITY_GUIDE})."
            if user
            else f"Pass --etcd-user (password in {ETCD_PASSWORD_ENV}) or a client certificate "
            f"whose CN is an etcd user ({SECURITY_GUIDE})."
        )
        return CredentialsError(f"etcd at {endpoint} denied {what}: {short}", fix)
    if code == grpc.StatusCode.INVALID_ARGUMENT and "authentication failed" in details:
        return CredentialsError(
            f"etcd at {endpoint} rejected user {user!r}: wrong user name or password",
            f"Check --etcd-user and {ETCD_PASSWORD_ENV}.",
        )
    if code == grpc.StatusCode.INVALID_ARGUMENT and "user name is empty" in details:
        return CredentialsError(
            f"etcd at {endpoint} requires authentication",
            f"Pass --etcd-user with {ETCD_PASSWORD_ENV}, or a client certificate "
            f"({SECURITY_GUIDE}).",
        )
    if "Socket closed" in details or "Handshake read failed" in details:
        # What a TLS/plaintext mismatch looks like; an etcd restart shows it briefly too.
        short += (
            " (does etcd serve TLS there? We speak TLS)"
            if auth.is_tls
            else " (if etcd serves TLS there, use etcds:// or --etcd-cacert)"
        )
    return StoreConnectionError(f"etcd at {endpoint} failed on {what}: {short}")


def _tls_refusal(details: str, endpoint: str, auth: EtcdAuth) -> CredentialsError | None:
    """A handshake that failed over certificates; None for a torn connection (retryable)."""
    if "CERTIFICATE_VERIFY_FAILED" in details:
        trusted = auth.cacert or "the system's CA bundle"
        return CredentialsError(
            f"etcd at {endpoint} presented a TLS certificate that {trusted} "
            "does not trust",
            "Pass the CA that signed etcd's certificate as --etcd-cacert.",
        )
    if any(alert in details for alert in _CLIENT_CERT_ALERTS):
        given = "" if auth.cert else " (none was given)"
        return CredentialsError(
            f"etcd at {endpoint} refused our TLS client certificate{given}",
            "Pass --etcd-cert and --etcd-key signed by a CA in etcd's --trusted-ca-file.",
        )
    return None


def _short(details: str) -> str:
    """The useful tail of a gRPC message, on one line."""
    text = " ".join(details.split())
    if "last error:" in text:
        text = text.rsplit("last error:", 1)[1].strip()
    text = text.removeprefix("etcdserver: ").removesuffix(": OK")
    return text[:200]
