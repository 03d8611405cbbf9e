"""Abort on notice: a wait on a collective that a newer round cuts short.

NCCL does not fail a collective whose peer died or hung: it blocks until the
collective timeout (users report survivors sitting in NCCL for 30 minutes), and gloo
does the same for a hung (SIGSTOPped) peer, whose sockets stay open. So the runtime
never blocks inside the backend: every collective the loop waits on is issued with
``async_op=True`` and waited on here, where the wait ends either when the work
completes or when the notice arrives that a round newer than ours dropped one of its
members. The notice comes from the worker's own etcd watch on the run's round key
(``worker/membership.py``): it fires within milliseconds of the agents writing the
round, with no extra hop through the agent, and it is the same watch the loop already
trusts at every step boundary.

On notice :meth:`RoundNotice.wait` raises :class:`RoundAbandoned`, which the loop
treats as a failed collective: as after any failed collective, the round's groups are
*abandoned*, not destroyed (``process_groups.abandon_groups``; torch 2.13's gloo
``abort()`` returns without freeing a thread blocked on a stopped peer, and destroying
the group would join it), and the step is retried in the new round. A late completion
of abandoned work writes only into that round's buffers: gradient buckets are rebuilt
at every re-form and state broadcasts receive into fresh tensors. A replica's transfer
receives in place, but a late byte there is the same byte of the same step
(``trainers/replica_transfer.py``).

Collectives the runtime does not wait on itself (FSDP's all-gathers, a pipeline's
send/recv, DTensor's, the user's own) are freed by the notice too. On NCCL it aborts
the process's NCCL communicators at once, from the watch thread, and a blocked NCCL
collective then returns with an error (``process_groups.abort_groups``). gloo has no
such abort (torch 2.13's returns without freeing a blocked thread, and shutting its
sockets from outside aborts the process), so on CPU the round's groups are
``noticed_gloo`` groups, whose every wait asks this notice between short slices.

A round that only *adds* members (a node admitted) is no notice: our collectives
will complete, and the loop re-forms at the next step boundary as before.

The notice is process-wide, like the process groups it guards (one elastic loop per
process). Outside the loop it is never given, and a wait is a plain wait.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Callable, TypeVar

import torch
from torch.futures import Future

from elastic_rt import noticed_gloo
from elastic_rt.errors import RoundAbandoned
from elastic_rt.process_groups import abort_groups
from elastic_rt.rendezvous.rounds import Round

__all__ = ["RoundAbandoned", "RoundNotice", "drops_a_member", "round_notice",
           "stop_compute_on_notice", "wait", "waited_seconds"]

T = TypeVar("T")
_POLL_S = 0.001
"""How often a wait looks at its future; the notice itself wakes it at once."""


def drops_a_member(ours: Round, newer: Round) -> bool:
    """Whether ``newer`` lacks a member of ``ours`` or gives one fewer ranks.

    Pure. Only a round that keeps every rank of ours and adds ranks is no notice: a node
    admitted, or a member given back the ranks it sat out with while its worker restarted
    (then every collective of ours completes). A round with the same ranks (a restart
    round after a failure) counts as dropping: something failed, and a collective may
    wait on it.
    """
    theirs = dict(zip(newer.members, newer.nprocs))
    kept = all(theirs.get(m, 0) >= n for m, n in zip(ours.members, ours.nprocs))
    return not (kept and newer.world_size > ours.world_size)


def loses_a_rank(ours: Round, newer: Round) -> bool:
    """Whether ``newer`` lacks a member of ``ours`` or gives one fewer ranks: a rank of
    ours was lost. Pure. Unlike :func:`drops_a_member`, a restart round with the same
    ranks is no loss (something failed, but nobody is gone)."""
    theirs = dict(zip(newer.members, newer.nprocs))
    return any(theirs.get(m, 0) < n for m, n in zip(ours.members, ours.nprocs))


class RoundNotice:
    """Whether the round our groups belong to is over; waits that end on either.

    Thread-safe: :meth:`observe` is called from the etcd watch thread, work futures
    complete on the backend's threads, and :meth:`wait` runs on the training thread.
    """

    def __init__(self, on_given: Callable[[], object] = lambda: None) -> None:
        """``on_given`` runs once per notice, on the watching thread, after waits are woken."""
        self._on_given = on_given
        self._cond = threading.Condition()
        self._training: Round | None = None
        self._given = False

    def train_in(self, round_: Round | None) -> None:
        """Our groups now belong to ``round_`` (None: no round, never a notice)."""
        with self._cond:
            self._training, self._given = round_, False

    def observe(self, newest: Round) -> None:
        """The run's round is now ``newest`` (from the watch)."""
        with self._cond:
            ours = self._training
            if (ours is None or self._given or newest.number <= ours.number
                    or not drops_a_member(ours, newest)):
                return
            self._given = True
            self._cond.notify_all()
        self._on_given()

    @property
    def is_given(self) -> bool:
        with self._cond:
            return self._given

    def wait(self, future: Future[T]) -> T:
        """The future's value, unless the notice comes first.

        Raises:
            RoundAbandoned: the notice came before the work completed.
            RuntimeError: the work failed (e.g. a peer's connection closed).
        """
        # Polled, not called back: an abandoned collective may complete while the
        # interpreter shuts down (when its hung peer is finally stopped), and a Python
        # callback then kills the process ("terminate called without an active exception").
        began = time.perf_counter()
        try:
            with self._cond:
                while not future.done() and not self._given:
                    self._cond.wait(_POLL_S)
                if not future.done():
                    ours = self._training.number if self._training else None
                    raise RoundAbandoned(
                        f"a newer round dropped a member of round {ours}; the ProcessGroup's "
                        "collective was abandoned")
            return future.wait()
        finally:
            _waits.seconds = waited_seconds() + time.perf_counter() - began


_notice = RoundNotice(on_given=abort_groups)
noticed_gloo.end_waits_when(lambda: _notice.is_given)


_waits = threading.local()


def waited_seconds() -> float:
    """Seconds this thread has spent waiting on collectives here, in all (what a rank's
    step spent blocked on its peers, not working: ``worker/stragglers.py``)."""
    return float(getattr(_waits, "seconds", 0.0))


def round_notice() -> RoundNotice:
    """The process's notice (the loop feeds it; collectives wait through it)."""
    return _notice


def stop_compute_on_notice(model: torch.nn.Module) -> None:
    """Make ``model``'s forward and backward stop at the next module or parameter once
    the notice is given, with :class:`RoundAbandoned`.

    A survivor hears of a lost peer a few hundred milliseconds after the kill, but the
    step it is in would compute on to its first collective, and that step is retried in
    the new round anyway: a kill right after a step threw away the whole next forward and
    backward (at 1.2 GB of replica state on 0.6 CPU a node, kill -> next step 1.7 s beyond
    a normal step of 2.7 s). Checked at each module's forward and each parameter's
    gradient, one lock-free read each. For replicated models only: a sharded model's
    forward is stopped in its all-gathers (``noticed_gloo``), with FSDP's own hooks
    around them. Once per model.
    """
    if model in _stopping:
        return
    _stopping.add(model)
    for module in model.modules():
        module.register_forward_pre_hook(_stop_if_given)
    for param in model.parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(_stop_if_given)


_stopping: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _stop_if_given(*_: object) -> None:
    if _notice._given:  # a read of one attribute: the lock is for waits, not for this
        raise RoundAbandoned("a newer round dropped a member of ours; the step's compute "
                             "stopped (its collectives would be abandoned: ProcessGroup)")


def wait(future: Future[T]) -> T:
    """Wait on a collective's future through the process's notice; see :meth:`RoundNotice.wait`."""
    return _notice.wait(future)
