"""torchrun's ``--rdzv-endpoint`` and ``--rdzv-conf`` as an etcd endpoint and EtcdAuth.

Kept free of torch so it can be unit-tested and imported from the entry point at no cost.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from elastic_rt.config import EtcdAuth

DEFAULT_PORT = 2379
"""etcd's client port, used when the endpoint names none."""

_TLS_SCHEMES = ("https", "etcds")
_PLAIN_SCHEMES = ("http", "etcd")
AUTH_KEYS = ("cacert", "cert", "key", "user", "password")
"""The ``--rdzv-conf`` keys mapped onto :class:`EtcdAuth`."""


class EndpointError(ValueError):
    """An ``--rdzv-endpoint`` we cannot read; its message names the value and the fix."""


@dataclass(frozen=True)
class EtcdTarget:
    """Where etcd is and how to talk to it."""

    endpoint: str
    """``host:port`` or ``host:port,host:port,...`` (what EtcdKV takes)."""
    auth: EtcdAuth


def parse_target(endpoint: str, conf: Mapping[str, object],
                 env: Mapping[str, str] = os.environ) -> EtcdTarget:
    """Read ``host:port``, ``http(s)://host:port`` or a comma-separated list of them.

    An ``https://`` (or ``etcds://``) member, or a ``cacert``/``cert`` key, turns TLS on
    for the whole cluster; mixing TLS and plaintext members is refused. A key missing
    from ``conf`` falls back to elastic-rt's ``ELASTIC_RT_ETCD_*`` variables, so that a
    password need not be on torchrun's command line.
    """
    text = endpoint.strip()
    if not text:
        raise EndpointError(
            "--rdzv-endpoint is empty for --rdzv-backend etcd-v3; "
            "pass the etcd client address, e.g. --rdzv-endpoint 127.0.0.1:2379"
        )
    members: list[str] = []
    schemes: set[bool] = set()
    for raw in text.split(","):
        item = raw.strip().rstrip("/")
        if not item:
            continue
        tls = False
        if "://" in item:
            scheme, _, item = item.partition("://")
            scheme = scheme.lower()
            if scheme in _TLS_SCHEMES:
                tls = True
            elif scheme not in _PLAIN_SCHEMES:
                raise EndpointError(
                    f"--rdzv-endpoint {endpoint!r}: scheme {scheme}:// is not etcd's; "
                    "use host:port, http://host:port or https://host:port"
                )
            schemes.add(tls)
        members.append(_host_port(item, endpoint))
    if not members:
        raise EndpointError(f"--rdzv-endpoint {endpoint!r} names no etcd member")
    if len(schemes) > 1:
        raise EndpointError(
            f"--rdzv-endpoint {endpoint!r} mixes http:// and https:// members; "
            "one cluster speaks one of them"
        )
    auth = _auth(conf, EtcdAuth.from_env(env), tls=True in schemes)
    return EtcdTarget(endpoint=",".join(members), auth=auth)


def _host_port(item: str, endpoint: str) -> str:
    host, sep, port = item.rpartition(":")
    if not sep:
        host, port = item, str(DEFAULT_PORT)
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointError(
            f"--rdzv-endpoint {endpoint!r}: {item!r} is not host:port; "
            "use e.g. 127.0.0.1:2379"
        )
    return f"{host}:{int(port)}"


def _auth(conf: Mapping[str, object], fallback: EtcdAuth, *, tls: bool) -> EtcdAuth:
    def value(key: str) -> str | None:
        raw = conf.get(key)
        given = str(raw) if raw not in (None, "") else None
        return given if given is not None else getattr(fallback, key)

    return EtcdAuth(
        cacert=value("cacert"),
        cert=value("cert"),
        key=value("key"),
        user=value("user"),
        password=value("password"),
        tls=tls or fallback.tls,
    )
