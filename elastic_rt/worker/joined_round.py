"""One worker's part in one round, as a value: formed whole, closed whole.

The rule: everything a worker holds for round k (its place and layout in the
:class:`~elastic_rt.worker.context.Context`, the process groups, the round's c10d store,
the fencing token) lives in one :class:`JoinedRound`, made by :func:`join` and let go by
:func:`close_round`; round k+1 is a new one. A checkpoint saved in round k carries k's
:attr:`JoinedRound.fence`, so its commit is judged by k's token even when it lands after
the loop moved on.

Joining, in order (the ``groups.reformed`` event's timings):

1. ``store_ms``: the round's store address (from etcd for a round we were not started
   in) and a connection to it (rank 0 hosts it, ``worker/round_store.py``);
2. ``ranks_ms``: every rank of the round checked in, however slow its start;
3. ``groups_ms``: the torch process groups built (gloo's mesh) under the round's prefix.

Any step gives up with :class:`~elastic_rt.errors.NewerRound` once a newer round forms.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from elastic_rt.checkpoint.pointer import Fence
from elastic_rt.config import WorkerEnv
from elastic_rt.errors import NewerRound
from elastic_rt.layout import ModelLimits, plan_layout
from elastic_rt.process_groups import Groups, abandon_groups, destroy_groups, init_groups
from elastic_rt.rendezvous.rounds import Round
from elastic_rt.worker.abort import round_notice
from elastic_rt.worker.context import Context, set_context
from elastic_rt.worker.membership import Membership
from elastic_rt.worker.round_store import join_round_store, wait_for_ranks


@dataclass(slots=True, eq=False)
class JoinedRound:
    """The round this worker trains in, with everything it holds for it.

    Only :attr:`ctx` changes, step by step (:meth:`at_step`); the round, its groups
    and store stay those it was joined with until :func:`close_round`.
    """

    round: Round
    ctx: Context
    store: dist.Store
    """The round's c10d store; its server (on rank 0) closes when the last reference goes."""

    @property
    def number(self) -> int:
        return self.ctx.round

    @property
    def groups(self) -> Groups:
        return self.ctx.groups

    @property
    def fence(self) -> Fence:
        """What a checkpoint saved in this round commits against."""
        return Fence(round=self.ctx.round, token=self.ctx.token)

    def at_step(self, step: int) -> None:
        """Publish the step being trained through :func:`elastic_rt.context`."""
        self.ctx = dataclasses.replace(self.ctx, step=step)
        set_context(self.ctx)


def join(round_: Round, *, membership: Membership, env: WorkerEnv, limits: ModelLimits,
         reform_timeout: timedelta,
         collective_timeout: timedelta) -> tuple[JoinedRound, dict[str, int]]:
    """Join ``round_``: its store, every rank checked in, its groups; and the timings.

    Raises:
        NewerRound: a newer round formed first (then join that one).
        RuntimeError, DistError: a peer failed while the groups were built.
    """
    began = time.monotonic()
    rank, world = membership.rank_in(round_), round_.world_size
    layout = plan_layout(world, limits)
    address = (membership.store_address(round_, reform_timeout)
               if round_.number != env.round else (env.master_addr, env.master_port))
    if address is None:
        raise NewerRound()  # the round's first node died before publishing its store

    def newer() -> bool:
        return membership.has_newer_round(round_.number)

    store = join_round_store(address, rank=rank, world_size=world, timeout=reform_timeout,
                             newer_round=newer)
    joined = time.monotonic()
    prefix = f"/elastic_rt/{env.run_id}/round-{round_.number}/"
    wait_for_ranks(store, prefix, world_size=world, timeout=reform_timeout, newer_round=newer)
    round_notice().train_in(round_)
    all_in = time.monotonic()
    groups = init_groups(store, rank=rank, world_size=world, layout=layout, prefix=prefix,
                         timeout=collective_timeout,
                         join_timeout=max(collective_timeout, reform_timeout))
    ctx = Context(rank=rank, world_size=world, local_rank=env.local_rank, node_id=env.node_id,
                  round=round_.number, token=round_.token, layout=layout, groups=groups)
    set_context(ctx)
    timings = {"store_ms": _ms(joined - began), "ranks_ms": _ms(all_in - joined),
               "groups_ms": _ms(time.monotonic() - all_in)}
    return JoinedRound(round=round_, ctx=ctx, store=store), timings


def close_round(joined: JoinedRound | None, *, abandon: bool) -> None:
    """Let go of a round's groups and store at once; None: of whatever groups exist.

    A peer blocked receiving from us is only freed when our sockets close, and gloo
    closes them when the last reference to the group goes. A round that failed (a
    collective raised, or the abort notice cut a wait short) is abandoned instead
    (``abandon``): a collective of ours may still be blocked on a peer, and destroying
    the groups would wait for it (``process_groups.abandon_groups``). A round that
    failed half-way through :func:`join` has no value yet, but may have groups.
    """
    groups = joined.groups if joined is not None else None
    if abandon:
        abandon_groups(groups)
    else:
        destroy_groups(groups)


def collective_timeout(env: WorkerEnv) -> timedelta:
    """How long a training collective may wait for a peer: the lease TTL by default.

    A hung peer keeps its sockets open. The agents' heartbeats evict it in under a
    second and the new round's notice frees the runtime's own collectives (gradient
    averaging, state broadcast: ``worker/abort.py``), whatever this timeout; it is the
    last resort for collectives outside them (an object owning its step on gloo). By
    the time it passes, the peer's lease (renewed last before it hung) has expired too.
    A merely slow peer costs a re-form round, not the job: the agents find every node
    answering and re-form the same members. Joining a round has its own, longer
    timeout (a new node may still be starting). Override with
    ``ELASTIC_RT_COLLECTIVE_TIMEOUT_SEC`` (600, as NCCL users set it, is tested).
    """
    return env.collective_timeout or env.lease_ttl


def _ms(seconds: float) -> int:
    return int(seconds * 1000)
