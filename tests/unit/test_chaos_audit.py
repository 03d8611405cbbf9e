"""The chaos matrix's pass/fail rules (``elastic_rt.harness.chaos.audit``) on made-up logs."""

from __future__ import annotations

import dataclasses

from elastic_rt.events import Event
from elastic_rt.harness.chaos.audit import TrialResult, audit_steps, stale_writes


def _done(node: str, round_: int, step: int, rank: int = 0, at_ms: int = 0) -> Event:
    return Event("step.completed", "worker", at_ms, node=node, rank=rank, round=round_, step=step)


def _round(number: int, *members: str) -> Event:
    return Event("round.formed", "agent", 0, round=number, metadata={"members": list(members)})


# the step audit -----------------------------------------------------------------------
def test_audit_counts_a_clean_run_as_neither_lost_nor_repeated() -> None:
    log = [_round(0, "a", "b"), *(_done("a", 0, s) for s in (1, 2, 3))]
    assert audit_steps(log, 3) == (0, 0, 0)


def test_audit_accepts_a_step_redone_after_its_node_died() -> None:
    log = [_round(0, "a", "b"), _done("a", 0, 1), _done("a", 0, 2), _round(1, "b"),
           _done("b", 1, 2), _done("b", 1, 3)]
    assert audit_steps(log, 3) == (0, 0, 1)


def test_audit_accepts_a_step_redone_after_its_worker_restarted() -> None:
    log = [_round(0, "a", "b"), _done("a", 0, 1), _done("a", 0, 2),
           Event("worker.restarted", "agent", 0, node="a"), _round(1, "a", "b"),
           _done("a", 1, 2), _done("a", 1, 3)]
    assert audit_steps(log, 3) == (0, 0, 1)


def test_audit_flags_a_step_redone_while_its_state_survived() -> None:
    log = [_round(0, "a", "b"), _done("a", 0, 1), _done("a", 0, 2), _round(1, "a", "b"),
           _done("a", 1, 2), _done("a", 1, 3)]
    assert audit_steps(log, 3) == (0, 1, 0)


def test_audit_flags_skipped_and_missing_steps_as_lost() -> None:
    log = [_round(0, "a"), _done("a", 0, 1), _done("a", 0, 3)]
    assert audit_steps(log, 4) == (2, 0, 0)


def test_audit_accepts_a_step_only_another_rank_completed_before_handing_its_state_on() -> None:
    log = [_round(0, "a", "b"), _done("a", 0, 1), _done("b", 0, 1, rank=1),
           _done("b", 0, 2, rank=1), _round(1, "a", "b"), _done("a", 1, 3)]
    assert audit_steps(log, 3) == (0, 0, 0)


def test_audit_ignores_a_late_completion_by_an_older_rounds_rank_0() -> None:
    # c, rank 0 of round 1, was paused mid-step 2; a (rank 0 of round 2) went on
    # without it, and c logged step 2 of round 1 once it woke.
    log = [_round(1, "c", "a"), _done("c", 1, 1), _round(2, "a"), _done("a", 2, 2),
           _done("a", 2, 3), _done("c", 1, 2)]
    assert audit_steps(log, 3) == (0, 0, 0)


# stale writes of a node that woke up -----------------------------------------------------
def test_a_checkpoint_committed_for_an_old_round_after_waking_is_stale() -> None:
    commit = Event("checkpoint.committed", "worker", 200, node="c", round=1, step=4)
    assert stale_writes([commit], "c", current=2, since_ms=100) == [commit]


def test_a_step_only_the_woken_node_completed_in_an_old_round_is_stale() -> None:
    alone = _done("c", 1, 5, at_ms=200)
    assert stale_writes([_done("a", 1, 4), alone], "c", current=2, since_ms=100) == [alone]


def test_a_step_others_completed_too_is_a_late_log_not_a_stale_write() -> None:
    late = _done("c", 1, 4, at_ms=200)
    assert stale_writes([_done("a", 1, 4), late], "c", current=2, since_ms=100) == []


def test_a_step_the_others_abandoned_on_notice_is_a_late_completion_not_a_stale_write() -> None:
    abandoned = Event("step.retried", "worker", 50, node="a", round=1, step=4,
                      metadata={"error": "RoundAbandoned", "attempt": 1})
    late = _done("c", 1, 4, at_ms=150)
    assert stale_writes([abandoned, late], "c", current=2, since_ms=100) == []
    failed = Event("step.retried", "worker", 50, node="a", round=1, step=4,
                   metadata={"error": "RuntimeError", "attempt": 1})
    assert stale_writes([failed, late], "c", current=2, since_ms=100) == [late]


def test_writes_before_waking_or_in_the_current_round_are_not_stale() -> None:
    log = [_done("c", 1, 3, at_ms=50), _done("c", 2, 6, at_ms=200)]
    assert stale_writes(log, "c", current=2, since_ms=100) == []


# the bar ----------------------------------------------------------------------------------
_CLEAN = TrialResult("f", 0, 1.0, finished=True, params_equal=True, lost=0, repeated=0,
                     damaged=0, orphans=0, problems=(), checks=("ok x",), redone=2)


def test_a_clean_trial_passes_even_with_redone_steps() -> None:
    assert _CLEAN.passed


def test_any_shortfall_fails_the_trial() -> None:
    for change in ({"finished": False}, {"params_equal": False}, {"lost": 1}, {"repeated": 1},
                   {"damaged": 1}, {"orphans": 1}, {"problems": ("x",)}, {"skipped": "no"}):
        assert not dataclasses.replace(_CLEAN, **change).passed, change
