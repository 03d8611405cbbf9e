"""The ``torchrun.handlers`` entry point: ``--rdzv-backend etcd-v3``.

torch's registry loads the entry point's object and *calls it with no arguments*; what
that returns is registered as the creator (``RendezvousParameters`` -> handler). So the
entry point names :func:`handler_creator`, which returns :func:`create_handler`.

The registry runs while ``torch.distributed.elastic.rendezvous`` is still being
imported, so this module imports nothing of torch at the top: the creator does, when
torchrun calls it.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous.api import (
        RendezvousHandler,
        RendezvousParameters,
    )

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5
"""Default seconds for one etcd call (``--rdzv-conf etcd_timeout=``)."""
CREDENTIALS_FIX = (
    "Pass --rdzv-conf user=NAME with the password in ELASTIC_RT_ETCD_PASSWORD, or "
    "cacert=, cert= and key= for TLS; a run's user needs readwrite on "
    "/elastic_rt/torchrun/<run_id>/ (docs/etcd-security.md)"
)
"""The fix for a refused login or permission, in torchrun's flags."""
STORE_TIMEOUT_S = 60
"""Default seconds an agent waits for a key of its peers (``--rdzv-conf read_timeout=``)."""


def handler_creator() -> Callable[["RendezvousParameters"], "RendezvousHandler"]:
    """What torch's registry calls to learn the creator (see the module docstring)."""
    return create_handler


def create_handler(params: "RendezvousParameters") -> "RendezvousHandler":
    """torch's dynamic rendezvous over etcd v3 for ``params`` (torchrun's flags).

    Raises:
        RendezvousConnectionError: etcd cannot be reached, refuses us, or the
            endpoint is not one; the message names the endpoint and the fix.
    """
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    from elastic_rt.errors import CredentialsError, ElasticError
    from elastic_rt.rendezvous.etcd_kv import EtcdKV
    from elastic_rt.torchrun.backend import EtcdV3RendezvousBackend
    from elastic_rt.torchrun.endpoint import EndpointError, parse_target
    from elastic_rt.torchrun.generation import open_generation
    from elastic_rt.torchrun.handler import FreshStoreAddressHandler
    from elastic_rt.torchrun.store import EtcdStore

    try:
        target = parse_target(params.endpoint, params.config)
    except EndpointError as exc:
        raise RendezvousConnectionError(str(exc)) from None
    etcd_timeout = params.get_as_int("etcd_timeout", CONNECT_TIMEOUT_S) or CONNECT_TIMEOUT_S
    read_timeout = params.get_as_int("read_timeout", STORE_TIMEOUT_S) or STORE_TIMEOUT_S
    try:
        kv = EtcdKV(target.endpoint, auth=target.auth, timeout=float(etcd_timeout))
        prefix = open_generation(kv, params.run_id)
    except CredentialsError as exc:
        # The store's own fix names elastic-rt launch's flags; torchrun's are --rdzv-conf.
        raise RendezvousConnectionError(
            f"etcd-v3 rendezvous: {exc.problem}. {CREDENTIALS_FIX}") from None
    except ElasticError as exc:
        # `from None`: the gRPC chain says nothing the line does not; torchrun prints
        # its own traceback for the error in any case.
        raise RendezvousConnectionError(
            f"etcd-v3 rendezvous: {str(exc).rstrip('.')}. Check that etcd serves its client "
            f"port at {target.endpoint} (start one with `elastic-rt etcd`), and pass "
            "--rdzv-endpoint host:port, https://host:port or a comma-separated list"
        ) from None
    logger.info("etcd-v3 rendezvous %s at %s (%s)", params.run_id, target.endpoint, prefix)
    backend = EtcdV3RendezvousBackend(kv, prefix)
    store = EtcdStore(kv, prefix, timedelta(seconds=read_timeout))
    return FreshStoreAddressHandler(dynamic_rendezvous.create_handler(store, backend, params))
