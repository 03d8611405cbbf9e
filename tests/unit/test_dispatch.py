"""The one dispatcher: each action to one method of a node's hands, results fed back."""

from __future__ import annotations

import typing
from datetime import timedelta
from typing import Any, Callable

from agents import policy
from agents.dispatch import Driver, Exited, Hands, Result, carry_out, dispatch
from agents.policy import AgentState, Observation, Phase, Settings
from agents.worker_state import WorkerState
from elastic_rt.rendezvous.rounds import Limits, NodeInfo, Round, Snapshot

SETTINGS = Settings(node_id="a", limits=Limits(min_nodes=2, max_nodes=3, last_call=5.0),
                    monitor_interval=timedelta(seconds=0.1))
R1 = Round(number=1, members=("a", "b"), nprocs=(1, 1), hosts=("h-a", "h-b"), token=50)
NODES = {n: NodeInfo(node_id=n, host=f"h-{n}", nproc=1, joined_revision=10 + i)
         for i, n in enumerate("ab")}


class Recorder:
    """Hands that record which method carried out which action, answering from ``replies``."""

    def __init__(self, **replies: Callable[[Any], Result]) -> None:
        self.calls: list[tuple[str, object]] = []
        self.replies = replies

    def __getattr__(self, name: str) -> Callable[[object], Result]:
        def method(action: object) -> Result:
            self.calls.append((name, action))
            reply = self.replies.get(name)
            return reply(action) if reply else None
        return method


def _sample(kind: Any) -> policy.Action:
    """Any instance of ``kind``: dispatch only looks at the type."""
    sample: policy.Action = object.__new__(kind)
    return sample


def test_every_action_has_its_own_method_of_the_hands() -> None:
    kinds = typing.get_args(policy.Action)
    methods = {n for n in vars(Hands) if not n.startswith("_")}
    hands = Recorder()
    for kind in kinds:
        dispatch(hands, _sample(kind))  # type: ignore[arg-type]
    used = [name for name, _ in hands.calls]
    assert len(used) == len(kinds) and len(set(used)) == len(kinds)  # one method per action
    assert set(used) == methods  # and every method of the hands is some action's


def test_a_result_is_decided_on_before_the_rest_of_the_decision_runs() -> None:
    # A new round for restart-mode workers: stop them, start them again (the start's
    # result moves the state), in that order.
    state = AgentState(phase=Phase.RUNNING, round=R1, ever_ran=True)
    r2 = Round(number=2, members=("a", "b"), nprocs=(1, 1), hosts=("h-a", "h-b"), token=60)
    hands = Recorder(start_workers=lambda a: policy.WorkersStarted(a.round))
    driver = Driver(SETTINGS)
    driver.state = state
    look = Observation(now=1.0, snapshot=Snapshot(round=r2, nodes=NODES),
                       workers=WorkerState.RUNNING)
    assert carry_out(hands, driver, look) is None  # type: ignore[arg-type]
    assert [name for name, _ in hands.calls] == ["stop_workers", "start_workers"]
    assert (driver.state.phase, driver.state.round) == (Phase.RUNNING, r2)


def test_nothing_more_is_carried_out_once_the_node_exited() -> None:
    look = Observation(now=1.0, snapshot=Snapshot(round=R1, nodes={"a": NODES["a"]},
                                                  completing=True))
    hands = Recorder(close_run=lambda a: Exited(5))
    driver = Driver(SETTINGS)
    assert carry_out(hands, driver, look) == 5  # type: ignore[arg-type]
    assert [name for name, _ in hands.calls] == ["close_run"]  # the Exit after it never ran
    assert driver.next_action() is None
