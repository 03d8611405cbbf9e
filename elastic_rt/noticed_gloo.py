"""gloo groups whose every wait ends when the round is abandoned, whoever issued the collective.

Why: the runtime waits on its own collectives through the round's notice
(``worker/abort.py``), but FSDP's all-gathers and reduce-scatters, a pipeline's send/recv,
DTensor's redistributions and a user's own ``dist.all_reduce`` wait inside gloo, and torch
2.13's gloo has no abort that frees them (``abort()`` and ``shutdown()`` return without
waking a blocked thread; closing its sockets from outside aborts the process). A survivor
that is not the dead node's ring neighbour then sat in FSDP's forward until gloo's timeout:
6-8 s with the default, ten minutes with a ten-minute timeout.

So on CPU every group of a round is a :class:`NoticedGloo`: a Python ``ProcessGroup``,
torch's own extension point for third-party backends (``Backend.register_backend``), over
an ordinary gloo group. Every collective goes straight to gloo; what changes is the wait.
:meth:`NoticedWork.wait` waits on gloo's work in slices of :data:`SLICE` and, between
slices, asks the notice whether the round is over; if it is, it raises
:class:`~elastic_rt.errors.RoundAbandoned`, which the loop handles as for any failed
collective (the groups are abandoned, the step is retried in the new round). The
collective itself stays in gloo's thread and, should it ever finish, writes only into that
round's buffers, which the new round does not use. A finished collective wakes its waiter at
once (gloo signals completion); only the notice is seen up to one slice late. A send or
recv is waited on by a thread of its own (gloo's cannot be waited on in slices), and so is
the group's construction, which connects to every peer (:func:`_connected`).

Does not cover: a wait made in C++ on the work's future (DDP's reducer calls
``getFuture()->wait()``: that one waits for gloo), and groups that mix NCCL and gloo: a
Python group replaces torch's whole group, so it cannot carry NCCL beside it; there the
notice aborts the NCCL communicators (``process_groups.abort_groups``), and gloo carries
only the runtime's CPU collectives, which it waits on through the notice itself.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import GroupName

from elastic_rt.errors import RoundAbandoned

logger = logging.getLogger(__name__)

BACKEND = "elastic_gloo"
"""torch's name for the backend (``init_process_group(BACKEND, ...)``, ``new_group``)."""

SLICE = timedelta(milliseconds=20)
"""How long a wait blocks in gloo before it looks at the notice again: the latest a
notice is seen. A slice that ends costs one caught exception (microseconds)."""

_SLICE_ENDED = "Operation timed out!"
"""What torch's ``Work.wait(timeout)`` raises when the timeout passed first."""

_round_is_over: Callable[[], bool] = lambda: False  # noqa: E731 - set by the loop's notice


def end_waits_when(round_is_over: Callable[[], bool]) -> None:
    """Make every wait on a :class:`NoticedGloo` group end once ``round_is_over()``.

    Called once by ``worker/abort.py`` with its notice; thread-safe to read from any
    thread. Without it a wait is a plain wait.
    """
    global _round_is_over
    _round_is_over = round_is_over


class NoticedWork(dist._Work):
    """gloo's work for one collective, whose wait gives up when the round is over.

    Two ways to wait, because gloo has two kinds of work. A collective's can be waited on
    for a while and then again: it waits in slices. A send's or a recv's cannot (a wait
    that times out completes it with the timeout's error), so it is waited on whole by a
    thread of its own, and the caller waits for that thread in slices; on notice that
    thread is left blocked in gloo with the abandoned round (one per abandoned send/recv)
    until the peer's sockets close, or this process exits (:func:`end_blocked_waits`).
    """

    def __init__(self, gloo_work: dist.Work, *,
                 point_to_point: tuple[dist.ProcessGroup, int | None] | None = None) -> None:
        """``point_to_point``: for a send or a recv, its group and peer (None: any)."""
        super().__init__()
        self._work = gloo_work
        # Started at once, not at the first wait: a send that nobody waits on (its round
        # abandoned first) must still finish, so that its group can be released.
        self._waiter = _Waiter(gloo_work, *point_to_point) if point_to_point else None
        self._waited_out = False  # a wait returned: finished, whatever the work says

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait until the collective completes, the round is over, or ``timeout`` passes.

        Raises:
            RoundAbandoned: the round was abandoned first (the collective is left to gloo).
            RuntimeError: the collective failed (e.g. a peer's connection closed), or
                ``timeout`` passed first (gloo's "Operation timed out!").
        """
        deadline = None if not timeout else time.monotonic() + timeout.total_seconds()
        while True:
            if _round_is_over() and not self.is_completed():
                raise RoundAbandoned(
                    "a newer round dropped a member of ours; a gloo ProcessGroup's collective "
                    "was abandoned")
            waited = SLICE.total_seconds()
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(_SLICE_ENDED)
                waited = min(waited, left)
            if self._waiter is not None:
                if self._waiter.wait(waited):
                    return True
                continue
            try:
                done = self._work.wait(timedelta(seconds=waited))
                self._waited_out = True
                return done
            except RuntimeError as exc:
                # torch's own words for a wait that ran out (gloo's errors have others);
                # the work may have completed just after it: the next wait says how
                if _SLICE_ENDED in str(exc):
                    continue
                raise

    def is_completed(self) -> bool:
        """Whether the work has finished. Some of torch's works never say so themselves
        (the ``Work`` a collective built on others returns, e.g. FSDP's reduce-scatter on
        gloo): those finish once a wait returned, or their future is done."""
        if self._waiter is not None:
            return self._waiter.is_done()
        if self._waited_out or self._work.is_completed():
            return True
        try:
            return self._work.get_future().done()
        except RuntimeError:  # a work without a future
            return False

    def is_success(self) -> bool:
        return self._work.is_success()

    def exception(self) -> Any:
        return self._work.exception()

    def result(self) -> list[torch.Tensor]:
        return self._work.result()

    def source_rank(self) -> int:
        return self._work.source_rank()

    def synchronize(self) -> None:
        self._work.synchronize()

    def get_future(self) -> torch.futures.Future[Any]:
        """gloo's own future: the runtime waits on it through the notice (``abort.wait``)."""
        return self._work.get_future()


class _Waiter:
    """One send's or recv's whole wait, in a thread of its own, started at once.

    ``gloo`` and ``peer`` (the rank it sends to or receives from; None: any) are kept
    so that :func:`end_blocked_waits` can end the wait at the process's exit.
    """

    def __init__(self, work: dist.Work, gloo: dist.ProcessGroup, peer: int | None) -> None:
        self._work = work
        self.gloo = gloo
        self.peer = peer
        self._done = threading.Event()
        self._error: BaseException | None = None
        with _blocked_lock:
            _blocked.add(self)
        threading.Thread(target=self._run, name="noticed-gloo-p2p", daemon=True).start()

    def _run(self) -> None:
        try:
            self._work.wait()
        except BaseException as exc:  # noqa: B902 - handed to the waiting thread
            self._error = exc
        finally:
            self._done.set()
            with _blocked_lock:
                _blocked.discard(self)

    def wait(self, seconds: float) -> bool:
        """Whether the work finished within ``seconds``; raises the work's own error."""
        if not self._done.wait(seconds):
            return False
        if self._error is not None:
            raise self._error
        return True

    def is_done(self) -> bool:
        return self._done.is_set()

    def ended(self, seconds: float) -> bool:
        """Whether the wait came back within ``seconds`` (with or without an error)."""
        return self._done.wait(seconds)


_blocked: set[_Waiter] = set()
"""Every send's or recv's wait still blocked in gloo (an abandoned round's, mostly)."""
_blocked_lock = threading.Lock()

_ENDING_TAG = 2**31 - 1
"""The tag of the receive that :func:`end_blocked_waits` lets time out (no one sends it)."""


def end_blocked_waits(within_s: float = 2.0) -> int:
    """End every send's or recv's wait still blocked in gloo; how many are left blocked.

    Why: such a wait ends when its peer's process exits, which at a job's end is about
    when this one exits too. A thread that comes back from C++ while the interpreter
    finalizes is ended by CPython (``pthread_exit``), and its unwinding through pybind11's
    GIL guard, a ``noexcept`` destructor, aborts the process: "terminate called without an
    active exception", SIGABRT, after the job's last step (1 run in 6 of an FSDP kill test,
    whose peer copies are point to point; the agent counted a failed worker). gloo's own
    way out is used instead: a receive on the same group that times out fails every pair
    of that group, which wakes every wait on it with an error (and the peer's, whose
    socket closes). Registered with ``atexit``, which runs before finalization; only
    groups with a blocked wait are touched, and at exit those would fail anyway.

    Does not cover a round still connecting at exit (``noticed-gloo-connect``): gloo's
    constructor has no wait to wake.
    """
    with _blocked_lock:
        waiters = list(_blocked)
    if not waiters:
        return 0
    deadline = time.monotonic() + within_s
    by_group: dict[int, list[_Waiter]] = {}
    for waiter in waiters:
        by_group.setdefault(id(waiter.gloo), []).append(waiter)
    for group_waiters in by_group.values():
        gloo = group_waiters[0].gloo
        known = list(dict.fromkeys(w.peer for w in group_waiters if w.peer is not None))
        others = [r for r in range(gloo.size()) if r != gloo.rank() and r not in known]
        for peer in known + others:  # a dead peer's pair fails at once, without the timeout
            _fail_every_pair(gloo, peer)
            if all(w.ended(_PAIRS_FAIL_S) for w in group_waiters):
                break
    left = sum(not w.ended(max(0.0, deadline - time.monotonic())) for w in waiters)
    if left:
        logger.warning("%d point-to-point waits of gloo are still blocked at exit", left)
    else:
        logger.info("ended %d point-to-point waits of gloo still blocked at exit", len(waiters))
    return left


_PAIRS_FAIL_S = 0.2
"""How long a failed group's waits get to come back before the next peer is tried."""


def _fail_every_pair(gloo: dist.ProcessGroup, peer: int) -> None:
    """Post a receive from ``peer`` that nobody sends and let it time out: gloo then fails
    every pair of the group (its answer to a timed-out point-to-point wait)."""
    try:
        gloo.recv([torch.empty(1)], peer, _ENDING_TAG).wait(timedelta(milliseconds=1))
    except RuntimeError:
        pass  # the timeout (or the pair had already failed): either way the pairs are done
    except Exception:  # at exit, never in the way of the exit itself
        logger.warning("could not end the waits of a gloo group at exit", exc_info=True)


atexit.register(end_blocked_waits)


class NoticedGloo(dist.ProcessGroup):
    """A gloo group whose collectives return :class:`NoticedWork`.

    It holds a plain torch ``ProcessGroup`` with gloo as its CPU backend and forwards each
    collective, under the name torch calls it by (from Python, ``distributed_c10d``; from
    C++, the functional collectives DTensor uses), to the same method there.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: timedelta) -> None:
        super().__init__(rank, size)  # type: ignore[call-arg] # the trampoline's own form
        self._gloo = _connected(store, rank, size, timeout)
        self._group = dist.ProcessGroup(store, rank, size)
        gloo_type = dist.ProcessGroup.BackendType.GLOO
        self._group._set_default_backend(gloo_type)
        self._group._register_backend(torch.device("cpu"), gloo_type, self._gloo)
        self._name = GroupName("")
        self._desc = ""
        self.timeout = timeout
        self._unfinished: list[NoticedWork] = []
        self._unfinished_lock = threading.Lock()

    def is_idle(self) -> bool:
        """Whether every collective issued on this group has finished (or failed): then no
        gloo thread of it is busy, and its destructor, which joins them, returns at once."""
        with self._unfinished_lock:
            self._unfinished = [w for w in self._unfinished if not w.is_completed()]
            return not self._unfinished

    def _issued(self, work: NoticedWork) -> NoticedWork:
        """List ``work`` until it finishes. Finished ones are dropped at every issue: a work
        holds its collective's buffers, and keeping up to 64 finished ones (until
        2026-12-06) kept FSDP's all-gathered parameters of many steps alive, 640 MB more
        per step for a 200 MB model (a few in flight are all a group lists now)."""
        with self._unfinished_lock:
            self._unfinished = [w for w in self._unfinished if not w.is_completed()]
            self._unfinished.append(work)
        return work

    # torch sets and reads the group's name and description through these (C++ asks
    # the backend, and this group has none registered with torch).
    def setGroupName(self, name: GroupName) -> None:  # noqa: N802 - torch's C++ name
        self._name = name
        self._group._set_group_name(name)

    def getGroupName(self) -> GroupName:  # noqa: N802 - torch's C++ name
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - torch's C++ name
        self._desc = desc
        self._group._set_group_desc(desc)

    def getGroupDesc(self) -> str:  # noqa: N802 - torch's C++ name
        return self._desc

    @property
    def group_name(self) -> GroupName:
        return self._name

    @property
    def group_desc(self) -> str:
        return self._desc

    def getBackendName(self) -> str:  # noqa: N802 - torch's C++ name
        return BACKEND

    @property
    def options(self) -> Any:
        """gloo's options (``_timeout`` among them), as torch's gloo backend has them."""
        return self._gloo.options

    def abort(self) -> None:
        self._group.abort()

    def shutdown(self) -> None:
        self._group.shutdown()


def _connected(store: dist.Store, rank: int, size: int,
               timeout: timedelta) -> dist.ProcessGroupGloo:
    """gloo's group, connected to every peer, unless the round is over first.

    gloo connects its full mesh in the constructor and waits there for every peer, up to
    the whole collective timeout: a peer that died while the round formed held the
    others for ten minutes with a ten-minute timeout (seen in the soak). So the
    constructor runs in a thread of its own, and the caller waits in slices through the
    notice; on notice the thread is left to end with gloo's timeout.

    Raises:
        RoundAbandoned: the round was abandoned before every peer connected.
        RuntimeError: gloo's own error (a peer's connection refused, the timeout).
    """
    made: list[dist.ProcessGroupGloo] = []
    failed: list[BaseException] = []
    done = threading.Event()

    def connect() -> None:
        try:
            made.append(dist.ProcessGroupGloo(store, rank, size, timeout))
        except BaseException as exc:  # noqa: B902 - handed to the waiting thread
            failed.append(exc)
        finally:
            done.set()

    threading.Thread(target=connect, name="noticed-gloo-connect", daemon=True).start()
    while not done.wait(SLICE.total_seconds()):
        if _round_is_over():
            raise RoundAbandoned("a newer round dropped a member of ours while this round's "
                                 "gloo group connected")
    if failed:
        raise failed[0]
    return made[0]


_COLLECTIVES = (
    "allreduce", "allreduce_coalesced", "allgather", "_allgather_base", "allgather_coalesced",
    "allgather_into_tensor_coalesced", "all_gather_single", "all_gather_single_coalesced",
    "broadcast", "reduce", "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_single",
    "reduce_scatter_tensor_coalesced", "reduce_scatter_single_coalesced", "alltoall",
    "alltoall_base", "all_to_all_single", "gather", "scatter", "send", "recv",
    "recv_anysource", "barrier", "monitored_barrier",
)
"""Every collective of torch 2.13's ``ProcessGroup``, by the names torch calls."""


_POINT_TO_POINT = frozenset({"send", "recv", "recv_anysource"})


def _forwarded(name: str) -> Callable[..., NoticedWork]:
    point_to_point = name in _POINT_TO_POINT

    def collective(self: NoticedGloo, *args: Any, **kwargs: Any) -> NoticedWork:
        work = getattr(self._group, name)(*args, **kwargs)
        if not point_to_point:
            return self._issued(NoticedWork(work))
        # torch calls send(tensors, dst, tag), recv(tensors, src, tag), recv_anysource(tensors, tag)
        peer = args[1] if name != "recv_anysource" and len(args) > 1 else None
        return self._issued(NoticedWork(work, point_to_point=(self._group, peer)))

    collective.__name__ = name
    collective.__doc__ = f"gloo's ``{name}``, waited on through the notice."
    return collective


for _name in _COLLECTIVES:
    setattr(NoticedGloo, _name, _forwarded(_name))


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> NoticedGloo:
    return NoticedGloo(store, rank, size, timeout)


dist.Backend.register_backend(BACKEND, _create, devices=["cpu"])
