"""This round's torch process groups, built from the layout, and their teardown.

This is the only module that creates or destroys torch process groups. Each round gets a
fresh set: the default (world) group bootstraps from ``PrefixStore(prefix, store)`` with a
per-round prefix such as ``/elastic_rt/<run_id>/round-<k>/`` (torchft's per-quorum prefix),
so keys left by an earlier round, or by a worker of that round still shutting down, can never
be mistaken for this round's. Then one group per mesh axis (``pp``, ``dp``, ``tp``) is built
with ``new_group`` and the three are wrapped in a :class:`DeviceMesh` for DTensor. A sharded
layout (``shard > 1``) also gets the mesh FSDP2 shards over: 1-D ``("shard",)`` over the
data-parallel group (FSDP), or 2-D ``("replicate", "shard")`` (HSDP), whose two groups are made
here too.

Guarantees: :func:`init_groups` can be called again in the same process after
:func:`destroy_groups`, any number of times, with another world size and layout.
:func:`destroy_groups` never raises and never waits on a peer, so it is safe after a peer died.
:func:`abandon_groups` lets go of a round whose collective may still be blocked on a hung peer,
and :func:`release_abandoned` destroys it once its collectives have finished.

Does not guarantee: that the groups survive a peer's death; a collective on a broken group
fails (or times out after ``timeout``) and the caller re-forms.

Backends, per group (see :mod:`elastic_rt.accelerator` for why): the world and axis groups
are gloo without CUDA, as :mod:`elastic_rt.noticed_gloo` groups (gloo whose every wait,
FSDP's and the user's too, ends when the round is abandoned), and mixed with it
(``cpu:gloo,cuda:nccl``: gradients over NCCL, the CPU tensors of state and shard sync and
the loss sum over gloo). Side groups
(:func:`side_group`, checkpoint coordination) are always gloo: they carry CPU objects
only, and must not queue behind training work on the NCCL stream. :func:`abort_groups`
aborts NCCL communicators from any thread (a round abandoned while a collective blocks
in NCCL); gloo groups are left to :func:`destroy_groups`.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh

from elastic_rt import noticed_gloo
from elastic_rt.accelerator import GLOO, backend_from_env, uses_nccl
from elastic_rt.layout import AXES, Layout

logger = logging.getLogger(__name__)

_SETTLE_POLL_S = 0.005


@dataclass(frozen=True)
class Groups:
    """The process groups of one round, as seen by one rank.

    Attributes:
        layout: the round's layout; ``world.size() == layout.world_size``.
        rank: this worker's rank in ``world``.
        world: the default group of the round (all ranks).
        dp: the ranks holding replicas of this rank's shard (same ``pp`` and ``tp``).
        pp: the pipeline stages of this rank's replica (same ``dp`` and ``tp``).
        tp: the ranks sharing this rank's stage by tensor split (same ``pp`` and ``dp``).
        mesh: a ``("pp", "dp", "tp")`` mesh over the same groups, for DTensor; for HSDP
            with pp or tp, ``("pp", "replicate", "shard", "tp")`` (dp split in two).
        backend: torch's name: ``noticed_gloo.BACKEND`` (gloo), or ``"cpu:gloo,cuda:nccl"``
            (mixed).
        shard_mesh: the mesh ``fully_shard`` shards over when ``layout.shard > 1``: one
            ``"shard"`` axis (FSDP), or ``("replicate", "shard")`` (HSDP); else None. With
            pp or tp it is a slice of ``mesh`` (FSDP2 needs one root for both).
    """

    layout: Layout
    rank: int
    world: dist.ProcessGroup
    dp: dist.ProcessGroup
    pp: dist.ProcessGroup
    tp: dist.ProcessGroup
    mesh: DeviceMesh | None
    backend: str
    shard_mesh: DeviceMesh | None = None

    def axis(self, name: str) -> dist.ProcessGroup:
        """The group along mesh axis ``name`` (``"pp"``, ``"dp"`` or ``"tp"``)."""
        return {"pp": self.pp, "dp": self.dp, "tp": self.tp}[name]


def pick_backend() -> str:
    """This process's backend: mixed NCCL/gloo when CUDA is available, else gloo.

    ``ELASTIC_RT_BACKEND`` overrides it (:func:`elastic_rt.accelerator.choose_backend`).

    Raises:
        ConfigError: ``ELASTIC_RT_BACKEND`` is unknown, or ``nccl`` without CUDA.
    """
    return backend_from_env()


def init_groups(
    store: dist.Store,
    *,
    rank: int,
    world_size: int,
    layout: Layout,
    prefix: str,
    timeout: timedelta,
    backend: str | None = None,
    join_timeout: timedelta | None = None,
) -> Groups:
    """Create this round's world group, one group per mesh axis, and the mesh. Collective.

    Every rank of the round must call this with the same ``layout``, ``prefix`` and
    ``world_size``; it returns once all of them have joined.

    Args:
        store: the round's store (shared by all ranks); only keys under ``prefix`` are used.
        rank: this worker's rank in the round.
        world_size: the number of ranks in the round; must equal ``layout.world_size``.
        layout: how the ranks split into ``pp``, ``dp`` and ``tp``.
        prefix: a key prefix unique to the round, e.g. ``/elastic_rt/<run_id>/round-<k>/``.
        timeout: how long any collective (including this set-up) waits for a peer.
        backend: ``"gloo"``, ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``; :func:`pick_backend`
            when ``None``.
        join_timeout: how long the world group (and its collectives) wait; ``timeout``
            when ``None``. Longer for a round that waits on a new node still starting.

    Raises:
        ValueError: ``world_size`` does not match the layout, or ``rank`` is out of range.
        RuntimeError: groups already exist in this process (call :func:`destroy_groups` first),
            or a peer did not join within ``timeout``.
    """
    if world_size != layout.world_size or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} of world {world_size} does not fit layout {layout}")
    if dist.is_initialized():
        raise RuntimeError("process groups exist already; destroy_groups() the last round's first")
    release_abandoned()
    backend = backend or pick_backend()
    if backend == GLOO:
        backend = noticed_gloo.BACKEND
    try:
        groups = _create(store, rank, layout, prefix, timeout, join_timeout or timeout, backend)
    except BaseException:
        # A half-made round (a peer never came, or the round was abandoned while its
        # groups connected) must not block the next attempt, nor name its groups: torch
        # counted the group it was making, and a rank that counts one group more than
        # its peers looks for the next round's keys under another name (seen: a whole
        # round waiting in gloo's connect for keys nobody wrote).
        abandon_groups(None)
        raise
    logger.info("Process groups ready: rank %s of %s, layout %s, backend %s",
                rank, world_size, layout, backend)
    return groups


def _create(store: dist.Store, rank: int, layout: Layout, prefix: str, timeout: timedelta,
            join_timeout: timedelta, backend: str) -> Groups:
    # Joining waits for the slowest rank of the round, e.g. a new node's workers still
    # importing torch, which can take far longer than any collective should; so the
    # world group may wait longer while the per-axis groups, which carry the training
    # collectives, keep the short ``timeout`` that frees survivors of a hung peer.
    dist.init_process_group(backend, store=dist.PrefixStore(prefix, store), rank=rank,
                            world_size=layout.world_size, timeout=join_timeout)
    mine = {axis: _axis_group(layout, axis, rank, timeout, backend) for axis in AXES}
    mesh = DeviceMesh.from_group(
        [mine[axis] for axis in AXES],
        "cuda" if uses_nccl(backend) else "cpu",
        mesh=torch.arange(layout.world_size).reshape(layout.pp, layout.dp, layout.tp),
        mesh_dim_names=AXES,
    )
    # WORLD is Optional in torch's types; init_process_group has just set it.
    world = cast(dist.ProcessGroup, dist.group.WORLD)
    shard_mesh: DeviceMesh | None
    if layout.shard > 1 and layout.pp * layout.tp > 1:
        mesh, shard_mesh = _model_parallel_shard_mesh(layout, rank, mine, mesh, timeout, backend)
    else:
        shard_mesh = _shard_mesh(layout, rank, mine["dp"], timeout, backend)
    return Groups(layout=layout, rank=rank, world=world, mesh=mesh, backend=backend,
                  shard_mesh=shard_mesh, **mine)


def _model_parallel_shard_mesh(layout: Layout, rank: int, mine: dict[str, dist.ProcessGroup],
                               mesh: DeviceMesh, timeout: timedelta,
                               backend: str) -> tuple[DeviceMesh, DeviceMesh]:
    """The round's mesh and FSDP's, for a sharded layout with pp or tp.

    FSDP2 joins a tensor-parallel DTensor's mesh and its own into one (``_concatenate``),
    which needs both sliced from one root mesh: FSDP's is the root's ``"dp"`` axis; for
    HSDP the root is ``("pp", "replicate", "shard", "tp")`` (the dp axis split in two, its
    groups made here) and FSDP's mesh its ``("replicate", "shard")`` slice.
    """
    if layout.replicas == 1:
        return mesh, mesh["dp"]
    pieces = [_member_group(groups, rank, timeout, backend)
              for groups in (layout.replicate_groups(), layout.shard_groups())]
    root = DeviceMesh.from_group(
        [mine["pp"], *pieces, mine["tp"]], "cuda" if uses_nccl(backend) else "cpu",
        mesh=torch.arange(layout.world_size).reshape(layout.pp, layout.replicas, layout.shard,
                                                     layout.tp),
        mesh_dim_names=("pp", "replicate", "shard", "tp"),
    )
    return root, root["replicate", "shard"]


def _shard_mesh(layout: Layout, rank: int, dp: dist.ProcessGroup, timeout: timedelta,
                backend: str) -> DeviceMesh | None:
    """FSDP's mesh: the dp group itself, or HSDP's replicate x shard groups (made here)."""
    if layout.shard == 1:
        return None
    device = "cuda" if uses_nccl(backend) else "cpu"
    if layout.replicas == 1:
        return DeviceMesh.from_group(dp, device, mesh_dim_names=("shard",))
    pieces = [_member_group(groups, rank, timeout, backend)
              for groups in (layout.replicate_groups(), layout.shard_groups())]
    return DeviceMesh.from_group(
        pieces, device, mesh=torch.tensor(layout.shard_groups()),
        mesh_dim_names=("replicate", "shard"),
    )


def _member_group(all_ranks: list[list[int]], rank: int, timeout: timedelta,
                  backend: str) -> dist.ProcessGroup:
    """Every group of ``all_ranks`` made (collective), the one holding ``rank`` kept."""
    groups = [dist.new_group(ranks, timeout=timeout, backend=backend) for ranks in all_ranks]
    return next(group for ranks, group in zip(all_ranks, groups) if rank in ranks)


def _axis_group(layout: Layout, axis: str, rank: int, timeout: timedelta,
                backend: str) -> dist.ProcessGroup:
    # new_group is collective over the whole world: every rank creates every group of the
    # axis, in the same order, and keeps the one it belongs to.
    all_ranks = layout.all_groups(axis)
    groups = [dist.new_group(ranks, timeout=timeout, backend=backend) for ranks in all_ranks]
    return groups[all_ranks.index(layout.group_ranks(axis, rank))]


def destroy_groups(groups: Groups | None) -> None:
    """Destroy every process group in this process (default group included). Never raises.

    Safe on groups broken by a dead peer: gloo's teardown only closes sockets, and NCCL
    communicators are aborted, which does not wait for a peer. With ``None`` it still
    destroys whatever exists, so the loop can call it before its first round or after a
    round that failed half-way.
    """
    if not dist.is_initialized():
        return
    what = f"layout {groups.layout}" if groups is not None else "an unfinished round"
    try:
        if uses_nccl(dist.get_backend()):
            # destroy would wait for outstanding work, which never ends when a peer is gone.
            dist.distributed_c10d._abort_process_group()
        else:
            dist.destroy_process_group()
    except Exception:  # a broken group may fail its own shutdown; the next round must still start
        logger.warning("Destroying the process groups of %s failed; continuing", what,
                       exc_info=True)
    _forget_sharding_cache()
    logger.info("Process groups of %s destroyed", what)


_abandoned: list[list[dist.ProcessGroup]] = []
"""The groups of every abandoned round not yet released, kept so that no destructor runs
while one of their collectives may still be blocked (see below)."""


def abandon_groups(groups: Groups | None) -> None:
    """Let go of this round's groups while a collective may still be blocked in them.

    NCCL communicators are aborted (:func:`abort_groups`), which frees a blocked
    collective: what NCCL offers for this. gloo (alone, or the CPU half of a mixed group):
    torch 2.13's ``abort()`` returns without freeing a thread blocked on a hung
    (SIGSTOPped) peer, and ``shutdown()`` or the group's destructor would join that
    thread, so the groups are only forgotten: torch's registry is cleared the way
    ``destroy_process_group`` clears it, minus the shutdown, and the group objects are
    kept for the life of the process, and past it: each gets one reference nobody ever
    drops, or the interpreter's shutdown would run the destructor, which waits for the
    blocked thread (seen: a finished worker's exit hung until its peer died, then
    aborted). Their blocked work ends when the peer is stopped or its timeout passes,
    writing only into that round's buffers; then :func:`release_abandoned` lets them go.
    The next :func:`init_groups` starts afresh (its store prefix is the new round's).
    """
    abort_groups()
    world = c10d._world
    if world.pg_map:
        for group in world.pg_map:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
            _drop_finished(group)
        _abandoned.append(list(world.pg_map))
    c10d._update_default_pg(None)
    for registry in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                     world.pg_to_tag, world.tags_to_pg, world.pg_coalesce_state):
        registry.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0
    _forget_sharding_cache()
    what = f"layout {groups.layout}" if groups is not None else "an unfinished round"
    logger.info("Process groups of %s abandoned (a collective may be blocked on a hung peer)",
                what)


def _drop_finished(group: dist.ProcessGroup) -> None:
    """Let an abandoned group's finished collectives go now, and the buffers they hold
    (a peer copy's send of 400 MB at 1.2 GB of FSDP state): a group lists its works until
    its next collective, and an abandoned one has none, so they stayed until the group
    was released at the next re-form."""
    if isinstance(group, noticed_gloo.NoticedGloo):
        group.is_idle()


def release_abandoned(settle_s: float = 0.0) -> int:
    """Let go of every abandoned round whose collectives have all finished; how many groups.

    ``settle_s``: wait up to that long for them to finish. A survivor's old collective
    usually fails moments after the new round forms (its peer released its own copy of the
    round, which closes their sockets), and a caller that must otherwise allocate afresh
    (400 MB of gradient buckets at 100M parameters) gains by waiting that moment; a round
    blocked on a hung peer does not finish, and costs the caller the whole wait.

    Why: each abandoned round holds gloo's threads (two per group, and a loop thread per
    device), its sockets and its store client; kept for the life of the process, a worker
    gained 8-9 threads per fault (29 -> 150 over 14 faults in a soak). A round's
    collectives finish once the peer they waited on is gone: its sockets close when it is
    killed, or when its agent stops a fenced node's workers. Then no gloo thread of the
    round is busy, and dropping our reference lets torch's destructor join its idle
    threads at once. Only :class:`~elastic_rt.noticed_gloo.NoticedGloo` groups say whether
    they are idle: a round with another kind (a plain gloo side group, NCCL's) is kept.
    Called by :func:`init_groups`, on the thread that trains, before the next round's groups.
    """
    deadline = time.monotonic() + settle_s
    while _abandoned and time.monotonic() < deadline and not all(
            _is_idle(groups) for groups in _abandoned):
        time.sleep(_SETTLE_POLL_S)
    kept: list[list[dist.ProcessGroup]] = []
    released = 0
    for groups in _abandoned:
        if _is_idle(groups):
            for group in groups:
                ctypes.pythonapi.Py_DecRef(ctypes.py_object(group))
            released += len(groups)
        else:
            kept.append(groups)
    _abandoned[:] = kept
    if released:
        logger.info("released %d process groups of abandoned rounds (%d still held)",
                    released, abandoned_group_count())
    return released


def _is_idle(groups: list[dist.ProcessGroup]) -> bool:
    """Whether no collective of these groups can still run (only NoticedGloo can say so)."""
    return all(isinstance(g, noticed_gloo.NoticedGloo) and g.is_idle() for g in groups)


def abandoned_group_count() -> int:
    """How many groups of abandoned rounds this process still holds."""
    return sum(len(groups) for groups in _abandoned)


def abort_groups() -> int:
    """Abort every NCCL communicator of this process; callable from any thread. Never raises.

    A collective blocked in NCCL on a dead or hung peer returns (with an error) once its
    communicator is aborted; a blocked gloo collective does not need this (its peer's
    sockets close, or :func:`destroy_groups` closes ours). Gloo-only groups are not
    touched, so calling this on CPU, or twice, is harmless. The groups stay registered:
    the thread that runs the loop still calls :func:`destroy_groups` (which aborts again,
    a no-op for a communicator already aborted) before the next round's groups.

    Returns:
        How many groups had NCCL communicators aborted.
    """
    if not dist.is_available():
        return 0
    aborted = 0
    # A snapshot: the loop's thread may be destroying groups meanwhile.
    for group in list(dist.distributed_c10d._world.pg_map):
        if not _has_nccl(group):
            continue
        try:
            group.abort()
            aborted += 1
        except Exception:  # an already destroyed group; the next one must still be aborted
            logger.warning("aborting a process group failed; continuing", exc_info=True)
    if aborted:
        logger.info("aborted the NCCL communicators of %d process groups", aborted)
    return aborted


def _has_nccl(group: dist.ProcessGroup) -> bool:
    if not dist.is_nccl_available():
        return False
    try:
        backend = group._get_backend(torch.device("cuda"))
    except RuntimeError:  # no backend for CUDA tensors in this group
        return False
    nccl_class = getattr(dist.distributed_c10d, "ProcessGroupNCCL", None)
    return nccl_class is not None and isinstance(backend, nccl_class)


def side_group(training: dist.ProcessGroup | None, timeout: timedelta) -> dist.ProcessGroup | None:
    """A gloo group over the ranks of ``training`` (default: the world), for work beside
    training such as checkpoint coordination, so it never queues behind, or breaks, the
    training collectives. None in a single process without torch.distributed.

    Only the ranks of ``training`` take part (``use_local_synchronization``).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = dist.get_process_group_ranks(training if training is not None else dist.group.WORLD)
    return dist.new_group(ranks=ranks, backend="gloo", timeout=timeout,
                          use_local_synchronization=True)


def destroy_side_group(group: dist.ProcessGroup) -> None:
    """Destroy a group made by :func:`side_group`; never raises (its peers may be gone)."""
    if not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except Exception as exc:  # the training group may already be gone
        logger.debug("could not destroy a side group: %s", exc)


def abandon_side_group(group: dist.ProcessGroup) -> None:
    """Let go of one group made by :func:`side_group` while its work may be blocked on a hung
    peer: :func:`abandon_groups` for a single group (forgotten by torch's registry, never shut
    down, kept alive for the life of the process). Never raises."""
    world = c10d._world
    if group not in world.pg_map:
        return
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    _abandoned.append([group])
    _drop_finished(group)
    for registry in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config,
                     world.pg_to_tag, world.pg_coalesce_state):
        registry.pop(group, None)
    for tagged in world.tags_to_pg.values():
        if group in tagged:
            tagged.remove(group)
    c10d._unregister_process_group(group.group_name)
    logger.info("A side group was abandoned (its work may be blocked on a hung peer)")


def group_timeout(group: dist.ProcessGroup) -> timedelta:
    """How long ``group``'s collectives wait for a peer (for a side group beside it)."""
    if isinstance(group, noticed_gloo.NoticedGloo):
        return group.timeout
    return group._get_backend(group._device_types[0]).options._timeout


def _forget_sharding_cache() -> None:
    # DTensor caches sharding decisions keyed by mesh equality, and a new round's mesh of the
    # same shape compares equal to the old one. A cached output spec carries the old round's
    # mesh, which knows this process by its old rank; an in-place op (every optimizer step)
    # writes that spec onto the parameter, so after a re-form that moved ranks the state's
    # DTensors would name the wrong rows (checkpoint offsets, clipping, gathers). The
    # caches live in Python and, in recent torch, in C++ too (its DTensor fast path): all
    # are cleared. A process that never loaded DTensor (0.5-1 s of a worker's start, which
    # a data-parallel job without checkpoints is spared) has none.
    if "torch.distributed.tensor" not in sys.modules:
        return
    from torch.distributed.tensor import DTensor, _redistribute

    propagator = DTensor._op_dispatcher.sharding_propagator
    for cached in vars(propagator).values():
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    for clear in (getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
                  getattr(_redistribute, "clear_redistribute_planner_cache", None)):
        if clear is not None:
            clear()
