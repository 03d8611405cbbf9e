"""One rendezvous per (run id, generation), so that a run id can be used again.

torch's dynamic rendezvous marks its state ``closed`` when a job ends and refuses every
later join with that flag. The state lives in etcd, which outlives the job, so a second
job with the same ``--rdzv-id`` would exit at once. Instead each job opens the newest
generation of its run id: when that generation's state is closed, the first agent to
notice moves the run to the next one (a compare-and-set on the generation key, so
racing agents agree) and deletes the old generation's keys.

Layout under ``/elastic_rt/torchrun/<run_id>/``: ``generation`` (a decimal number) and
``g<n>/state`` (torch's state, base64) and ``g<n>/store/<key>`` (the agents' Store).
"""

from __future__ import annotations

import base64
import binascii
import logging
import pickle  # noqa: S403 - torch's own state format; torch unpickles it in any case

from elastic_rt.rendezvous.kv import Get, KVStore

logger = logging.getLogger(__name__)

ROOT = "/elastic_rt/torchrun"


def run_prefix(run_id: str) -> str:
    return f"{ROOT}/{run_id}"


def open_generation(kv: KVStore, run_id: str) -> str:
    """The key prefix (no trailing slash) of the generation this agent joins.

    Raises:
        StoreConnectionError, CredentialsError: from the store, untranslated.
    """
    gen_key = f"{run_prefix(run_id)}/generation"
    while True:
        current = kv.get(gen_key)
        number = int(current.value) if current is not None else 0
        revision = current.mod_revision if current is not None else 0
        prefix = f"{run_prefix(run_id)}/g{number}"
        # Read the state only if the generation is still the one read above, so that an
        # agent that just moved the run on (and deleted this state) is not mistaken for
        # an empty, open generation.
        read = kv.txn({gen_key: revision}, [Get(f"{prefix}/state")])
        if not read.succeeded:
            continue
        state = read.reads[0]
        if not state or not is_closed(state[0].value):
            return prefix
        moved = kv.put_if(gen_key, str(number + 1).encode(), expect={gen_key: revision})
        if moved is not None:
            logger.info("rendezvous %s generation %d is closed; opening %d",
                        run_id, number, number + 1)
            kv.delete_prefix(prefix + "/")
            return f"{run_prefix(run_id)}/g{number + 1}"


def is_closed(encoded: bytes) -> bool:
    """Whether torch's rendezvous state says the job ended.

    Unreadable state counts as open: torch's handler reports it as corrupt itself.
    """
    try:
        state = pickle.loads(base64.b64decode(encoded, validate=True))  # noqa: S301
    except (binascii.Error, pickle.UnpicklingError, ValueError, EOFError, AttributeError,
            ImportError, TypeError, IndexError):
        return False
    return bool(getattr(state, "closed", False))
