"""The agent's round I/O: write a proposed round, agree on its store, report a root cause.

Each function carries out one action the policy (:mod:`agents.policy`) decided and
says what happened in events; what it learned goes back to the policy as an
observation (see :mod:`agents.dispatch`).
"""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Callable

from agents import policy
from agents.etcd_retry import again
from elastic_rt.errors import RendezvousTimeoutError, StoreError
from elastic_rt.etcd_server import free_port
from elastic_rt.events import EventSink
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import NodeInfo, Propose, Round
from elastic_rt.root_cause import RootCause

logger = logging.getLogger(__name__)


def propose_round(write: Callable[[Propose], Round | None], events: EventSink,
                  action: policy.ProposeRound) -> None:
    """Write the round with ``write`` (:meth:`agents.run_watch.RunWatch.propose`) if the
    previous one still stands (one proposer wins), and tell."""
    began = time.monotonic()
    written = write(action.proposal)
    if written is None:
        return
    # From the round it replaces, not the agent's state: a worker failure seen before
    # the peer's key went has already stopped our workers, and node.lost was lost.
    replaced = action.replaced.members if action.replaced else ()
    for node in (m for m in replaced if m not in written.members):
        events.emit("node.lost", round=written.number, lost=node)
    events.emit(
        "round.formed", round=written.number, world_size=written.world_size,
        members=list(written.members), reason=written.reason,
        duration_ms=int((time.monotonic() - began) * 1000),
    )  # fmt: skip
    logger.info("round %d formed: %s (%s)", written.number, ",".join(written.members),
                written.reason)


def agree_on_store(registry: RunRegistry, round_: Round, me: NodeInfo, *, wait: timedelta,
                   sleep: Callable[[float], None]) -> tuple[str, int] | None:
    """The round's first node picks the c10d store's address; the others read it.

    The store lives in that node's rank-0 worker (torchrun's env:// rendezvous) and is
    re-hosted by the first member of every new round, so it never outlives the node
    it depends on. A member with no ranks (its workers are being replaced, see
    :class:`policy.ReplaceWorkers`) hosts nothing: the first member with ranks does.
    Returns (host, port); None when the round is gone or has no host.

    None sends the agent back to its loop, which re-forms without a first node that
    left before publishing, or follows the round that replaced this one.
    """
    host = _store_host(round_)
    deadline = time.monotonic() + wait.total_seconds()
    if host == me.node_id:
        address = f"{me.host}:{free_port(me.host)}"
        try:  # a reset stream raised out of here once and ended the agent (finding 17)
            again(lambda: registry.publish_store(round_, address),
                  f"to publish round {round_.number}'s store", within=wait.total_seconds(),
                  sleep=sleep, poll=0.05)
        except StoreError as exc:
            logger.warning("round %d's store not published (%s); waiting for the next round",
                           round_.number, exc)
            return None

    def gone() -> bool:
        current = registry.current_round()
        if current is None or current.number != round_.number:
            return True
        return not registry.is_registered(host)

    left = timedelta(seconds=max(0.0, deadline - time.monotonic()))
    try:
        return registry.await_store(round_.number, left, gone=gone, sleep=sleep, poll=0.05)
    except RendezvousTimeoutError:
        logger.warning("no store address for round %d; waiting for the next round",
                       round_.number)
        return None


def _store_host(round_: Round) -> str:
    """The member whose first worker is the round's rank 0."""
    return next((m for m, n in zip(round_.members, round_.nprocs) if n > 0), round_.members[0])


def report_root_cause(registry: RunRegistry, cause: RootCause, *, claimed: bool
                      ) -> policy.Failed | None:
    """Store ``cause`` as the run's root cause where it supersedes the stored one, and
    print torchrun's table: once per failure, by the node whose worker failed first.

    Returns a :class:`policy.Failed` when it repeats the previous attempt's failure.
    """
    if not policy.should_report(cause, claimed=claimed):
        return None
    while True:
        stored, revision = registry.root_cause()
        if not policy.supersedes(cause, stored):
            return None
        if registry.put_root_cause(cause, revision):
            break
    logger.error("worker failed; root cause:\n%s", cause.table())
    return policy.repeated_failure(cause, stored)
