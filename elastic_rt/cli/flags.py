"""Flag types and checks more than one subcommand uses: durations, etcd endpoints and auth.

Each check turns a bad value into a :class:`ConfigError` that names the flag and the fix,
before anything connects or starts: gRPC would report a wrong TLS file later as a
handshake failure that blames the server.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta
from typing import Callable, TypeVar

from elastic_rt import config as cfg
from elastic_rt.errors import ConfigError, UnknownURLSchemeError

_T = TypeVar("_T")


def seconds(text: str) -> timedelta:
    """An argparse type: a flag's value in seconds, kept as a duration from here on."""
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds")
    return timedelta(seconds=seconds)


def add_etcd_auth(p: argparse.ArgumentParser) -> None:
    env = os.environ
    p.add_argument("--etcd-cacert", default=env.get(cfg.ETCD_CACERT_ENV),
                   help="CA of etcd's TLS certificate")
    p.add_argument("--etcd-cert", default=env.get(cfg.ETCD_CERT_ENV), help="client certificate")
    p.add_argument("--etcd-key", default=env.get(cfg.ETCD_KEY_ENV), help="client key")
    p.add_argument("--etcd-user", default=env.get(cfg.ETCD_USER_ENV),
                   help=f"etcd user; the password comes from {cfg.ETCD_PASSWORD_ENV}")


def auth(args: argparse.Namespace, tls: bool = False) -> cfg.EtcdAuth:
    for flag in ("etcd_cacert", "etcd_cert", "etcd_key"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise ConfigError(f"--{flag.replace('_', '-')} {path} does not exist",
                              "Pass the path of a PEM file.")
    if bool(args.etcd_cert) != bool(args.etcd_key):
        raise ConfigError("--etcd-cert and --etcd-key go together", "Pass both or neither.")
    _check_pem(args.etcd_cacert, args.etcd_cert, args.etcd_key)
    password = os.environ.get(cfg.ETCD_PASSWORD_ENV)
    if args.etcd_user and not password:
        raise ConfigError(f"--etcd-user {args.etcd_user} has no password",
                          f"Set {cfg.ETCD_PASSWORD_ENV}.")
    return cfg.EtcdAuth(
        cacert=args.etcd_cacert, cert=args.etcd_cert, key=args.etcd_key,
        user=args.etcd_user, password=password if args.etcd_user else None, tls=tls,
    )  # fmt: skip


def _check_pem(cacert: str | None, cert: str | None, key: str | None) -> None:
    """Load the TLS files as the client will, so a wrong file is named before any
    connection (gRPC would report it later as a handshake failure, blaming the server)."""
    import ssl

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cacert:
        try:
            context.load_verify_locations(cafile=cacert)
        except (ssl.SSLError, OSError):
            raise ConfigError(f"--etcd-cacert {cacert} cannot be read as a PEM certificate",
                              "Pass the CA certificate that signed etcd's server "
                              "certificate (a file with -----BEGIN CERTIFICATE-----).") from None
    if cert and key:
        try:
            context.load_cert_chain(cert, key, password="")
        except (ssl.SSLError, OSError):
            raise ConfigError(f"--etcd-cert {cert} and --etcd-key {key} cannot be read as a PEM "
                              "certificate and its unencrypted private key",
                              "Pass the client certificate and the key it was issued "
                              "for, both PEM.") from None


def parse_endpoint(text: str) -> tuple[str, bool]:
    """``etcd://host:port``, ``etcds://host:port`` (TLS) or ``host:port`` -> (host:port, tls).

    Several members of one etcd cluster are separated by commas
    (``etcd://h1:2379,h2:2379,h3:2379``) and come back the same way.
    """
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "etcd", text
    if scheme not in ("etcd", "etcds", "http", "https"):
        raise UnknownURLSchemeError(
            f"rendezvous endpoint {text!r} has the unknown scheme {scheme!r}",
            "Use etcd://host:port (or etcds://host:port for TLS).",
        )
    members = [member.strip().rstrip("/") for member in rest.rstrip("/").split(",")]
    for member in members:
        host, _, port = member.rpartition(":")
        if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ConfigError(f"rendezvous endpoint {text!r} is not host:port with a port 1-65535",
                              "Use etcd://host:port (a cluster: etcd://h1:2379,h2:2379,h3:2379).")
    return ",".join(members), scheme in ("etcds", "https")


def flag(fix: str, parse: Callable[[], _T]) -> _T:
    """A parser's ValueError (it names the flag and value) plus ``fix`` -> a ConfigError."""
    try:
        return parse()
    except ValueError as exc:
        raise ConfigError(str(exc), fix) from None
