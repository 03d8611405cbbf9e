"""Small collectives that keep every rank's checkpoint decisions the same.

A rank that fails alone must not leave the others waiting in the next collective, so
each step that can fail runs locally and then every rank learns every rank's
outcome (:func:`agree`): all go on, or all raise. Errors travel as (class name,
message) strings, never as pickled objects; a rank raises its own error as is, the
others raise the same class with the same message. With ``group=None`` (a single
process) these are plain calls.

The objects sent are our own small Python values between processes of one job, not
data read from storage.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from elastic_rt import errors

logger = logging.getLogger(__name__)

T = TypeVar("T")

_PASSED_ON = (
    errors.CorruptShardError,
    errors.CheckpointMismatchError,
    errors.CheckpointNotFoundError,
    errors.CredentialsError,
    errors.FencedOutError,
    errors.ConfigError,
    errors.UnknownURLSchemeError,
    errors.CheckpointLocationError,
    errors.StorageUnreachableError,
)


def rank_of(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def broadcast(value: T, group: dist.ProcessGroup | None) -> T:
    """Rank 0's ``value`` on every rank."""
    if group is None:
        return value
    box = [value]
    dist.broadcast_object_list(box, group=group, group_src=0)
    return box[0]


def all_gather(value: T, group: dist.ProcessGroup | None) -> list[T]:
    if group is None:
        return [value]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, value, group=group)
    return out


def agree(fn: Callable[[], T], group: dist.ProcessGroup | None, what: str) -> T:
    """Run ``fn`` on every rank; return this rank's result, or raise on all ranks.

    Raises:
        BaseException: this rank's own error, or a copy of the first failed rank's.
    """
    result: Any = None
    error: BaseException | None = None
    try:
        result = fn()
    except BaseException as exc:  # reported to every rank below, then raised
        error = exc
    failures = all_gather(_describe(error), group)
    if error is not None:
        raise error
    for rank, failure in enumerate(failures):
        if failure is not None:
            raise _rebuild(failure, rank, what)
    return result


def agree_name(propose: Callable[[], str], error: BaseException | None,
               group: dist.ProcessGroup | None, what: str) -> str:
    """The first collective of a save: every rank reports whether it is ready, and
    rank 0's ``propose()`` (a fresh folder name) comes back. Raises on every rank if
    one is not ready or the proposal failed.
    """
    proposal: str | None = None
    if error is None and rank_of(group) == 0:
        try:
            proposal = propose()
        except BaseException as exc:  # reported to every rank below, then raised
            error = exc
    proposals = all_gather((proposal, _describe(error)), group)
    if error is not None:
        raise error
    for rank, (_, failure) in enumerate(proposals):
        if failure is not None:
            raise _rebuild(failure, rank, what)
    name = proposals[0][0]
    assert name is not None  # rank 0 proposed or failed
    return name


def _describe(error: BaseException | None) -> tuple[str, str, str] | None:
    if error is None:
        return None
    if isinstance(error, errors.UserError):
        return (type(error).__name__, error.problem, error.fix)
    return (type(error).__name__, str(error), "")


def _rebuild(failure: tuple[str, str, str], rank: int, what: str) -> BaseException:
    name, message, fix = failure
    for cls in _PASSED_ON:
        if cls.__name__ == name:
            return cls(message, fix) if issubclass(cls, errors.UserError) else cls(message)
    return errors.CheckpointError(f"{what} failed on rank {rank}: {name}: {message}")
