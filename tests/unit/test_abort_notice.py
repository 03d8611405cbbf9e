"""Abort on notice: a wait on a collective ends when a newer round drops a member."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.futures import Future

from elastic_rt.rendezvous.rounds import Round
from elastic_rt.errors import RoundAbandoned
from elastic_rt.worker.abort import (RoundNotice, drops_a_member, loses_a_rank, round_notice,
                                     stop_compute_on_notice)
from elastic_rt.worker.failures import user_code


def _round(number: int, *members: str, nprocs: tuple[int, ...] | None = None) -> Round:
    return Round(number=number, members=members, nprocs=nprocs or (1,) * len(members),
                 hosts=("127.0.0.1",) * len(members))


@pytest.mark.parametrize("newer, drops", [
    (_round(2, "a", "b"), True),                        # c lost
    (_round(2, "a", "b", "c"), True),                   # same members: something failed
    (_round(2, "a", "b", "c", nprocs=(1, 1, 0)), True),  # c gives fewer ranks
    (_round(2, "a", "b", "c", "d"), False),             # d admitted: our collectives complete
])
def test_only_a_round_that_drops_a_rank_of_ours_is_a_notice(newer: Round, drops: bool) -> None:
    assert drops_a_member(_round(1, "a", "b", "c"), newer) is drops


@pytest.mark.parametrize("newer, loses", [
    (_round(2, "a", "b"), True),                        # c lost
    (_round(2, "a", "b", "c"), False),                  # a restart round: nobody gone
    (_round(2, "a", "b", "c", nprocs=(1, 1, 0)), True),  # c's worker is being replaced
    (_round(2, "a", "b", "c", "d"), False),             # d admitted
])
def test_a_failed_step_is_forgiven_only_when_a_rank_was_lost(newer: Round, loses: bool) -> None:
    """``max_failed_steps`` counts a step's failed tries, except those a lost rank explains."""
    assert loses_a_rank(_round(1, "a", "b", "c"), newer) is loses


def test_a_member_given_back_its_ranks_is_no_notice() -> None:
    """At the minimum node count a node whose worker died stays a member with no ranks;
    the round that gives them back only adds ranks (a notice there once cut a survivor's
    last all-reduce short after its peer's had completed: the two disagreed on the step)."""
    sitting_out = _round(2, "a", "c", "b", nprocs=(1, 0, 1))
    assert not drops_a_member(sitting_out, _round(3, "a", "c", "b"))
    assert drops_a_member(sitting_out, _round(3, "a", "c", "b", nprocs=(0, 1, 1)))


def test_a_completed_collective_returns_its_value() -> None:
    notice = RoundNotice()
    notice.train_in(_round(1, "a", "b"))
    future: Future[torch.Tensor] = Future()
    future.set_result(torch.ones(2))
    assert notice.wait(future).tolist() == [1.0, 1.0]


def test_a_failed_collective_raises_its_error() -> None:
    notice = RoundNotice()
    future: Future[torch.Tensor] = Future()
    future.set_exception(RuntimeError("Connection closed by peer"))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="closed by peer"):
        notice.wait(future)


def test_a_newer_round_without_a_member_cuts_a_blocked_wait_short() -> None:
    notice = RoundNotice()
    notice.train_in(_round(1, "a", "b", "c"))
    never: Future[torch.Tensor] = Future()  # a collective blocked on a hung peer
    watch = threading.Timer(0.05, notice.observe, args=(_round(2, "a", "b"),))
    watch.start()
    with pytest.raises(RoundAbandoned):
        notice.wait(never)
    watch.join()
    assert notice.is_given
    notice.train_in(_round(2, "a", "b"))  # the next round starts with no notice
    assert not notice.is_given


def test_a_round_that_only_grows_is_no_notice() -> None:
    notice = RoundNotice()
    notice.train_in(_round(1, "a", "b"))
    notice.observe(_round(2, "a", "b", "c"))
    notice.observe(_round(1, "a"))  # older than ours: not news
    assert not notice.is_given


def test_a_notice_frees_collectives_it_does_not_wait_on_once() -> None:
    """The hook (NCCL's abort in the worker) runs once per notice, never for growth."""
    aborted: list[int] = []
    notice = RoundNotice(on_given=lambda: aborted.append(1))
    notice.train_in(_round(1, "a", "b", "c"))
    notice.observe(_round(2, "a", "b", "c", "d"))  # growth: no notice
    assert aborted == []
    notice.observe(_round(2, "a", "b"))
    notice.observe(_round(3, "a"))  # already given for this round
    assert aborted == [1]


def test_a_replicated_step_stops_computing_once_a_newer_round_drops_a_member() -> None:
    """The step is retried in the new round, so the rest of its forward and backward is
    waste (1.7 s of a 2.7 s step at 1.2 GB): it stops at the next module or parameter,
    and the user's-code guard passes it on as the failed collective it stands for."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    ran: list[str] = []
    model[2].register_forward_hook(lambda *_: ran.append("last layer"))
    stop_compute_on_notice(model)
    stop_compute_on_notice(model)  # once per model
    assert len(model[0]._forward_pre_hooks) == 1
    notice = round_notice()
    notice.train_in(_round(1, "a", "b"))
    try:
        loss = model(torch.randn(3, 4)).sum()  # no notice: the step computes
        assert ran == ["last layer"]
        notice.observe(_round(2, "a"))
        with pytest.raises(RoundAbandoned), user_code(rank=0, step=1):
            loss.backward()
        assert model[0].weight.grad is None  # stopped before the first layer's gradient
        with pytest.raises(RoundAbandoned):
            model(torch.randn(3, 4))
        assert ran == ["last layer"]
        notice.train_in(_round(2, "a"))  # the new round's retry computes again
        model(torch.randn(3, 4)).sum().backward()
        assert ran == ["last layer"] * 2 and model[0].weight.grad is not None
    finally:
        notice.train_in(None)
