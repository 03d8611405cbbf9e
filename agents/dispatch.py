"""The one dispatcher: decisions in, actions out to a node's hands, results fed back.

The agent and the simulated nodes (agents/sim/) carry out the same actions in the
same order, each with its own hands (real workers, or none): a :class:`Hands` has one
method per kind of action, :func:`dispatch` is the only place that picks it, and a
:class:`Driver` is the only holder of the node's :class:`~agents.policy.AgentState`.
An action's result (an observation) goes back through
:func:`~agents.policy.decide` at once, and the actions decided from it run before the
rest of the decision that asked for it. Nothing here changes the state by itself, so
no node can disagree with another about what an action did.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Awaitable, Protocol, TypeVar

from agents import policy
from agents.policy import AgentState, Observed, Settings
from elastic_rt.rendezvous import rounds


@dataclass(frozen=True, slots=True)
class Exited:
    """The node ended with exit ``code``: nothing more is carried out."""

    code: int


Result = Observed | Exited | None
"""What carrying out one action returns: an observation for :func:`policy.decide`."""

R = TypeVar("R", covariant=True)


class Hands(Protocol[R]):
    """What a node does for each action; ``R`` is :data:`Result`, or an awaitable of it."""

    def propose(self, action: policy.ProposeRound) -> R: ...
    def start_workers(self, action: policy.StartWorkers) -> R: ...
    def follow_round(self, action: policy.FollowRound) -> R: ...
    def stop_workers(self, action: policy.StopWorkers) -> R: ...
    def publish_in_process(self, action: policy.PublishInProcess) -> R: ...
    def start_in_standby(self, action: policy.StartInStandby) -> R: ...
    def revoke_lost_lease(self, action: policy.RevokeLostLease) -> R: ...
    def unregister(self, action: policy.Unregister) -> R: ...
    def register(self, action: policy.Register) -> R: ...
    def gather_failure(self, action: policy.HandleFailure) -> R: ...
    def probe_peers(self, action: policy.ProbePeers) -> R: ...
    def claim_failure(self, action: policy.ClaimFailure) -> R: ...
    def count_restart(self, action: policy.CountRestart) -> R: ...
    def report_root_cause(self, action: policy.ReportRootCause) -> R: ...
    def leave_round(self, action: policy.LeaveRound) -> R: ...
    def reform_without_us(self, action: policy.ReformWithoutUs) -> R: ...
    def announce_leave(self, action: policy.AnnounceLeave) -> R: ...
    def leave_at_boundary(self, action: policy.LeaveAtBoundary) -> R: ...
    def succeed(self, action: policy.Succeed) -> R: ...
    def close_run(self, action: policy.CloseRun) -> R: ...
    def exit(self, action: policy.Exit) -> R: ...
    def join_timed_out(self, action: policy.JoinTimedOut) -> R: ...
    def sleep(self, action: policy.Sleep) -> R: ...


def dispatch(hands: Hands[R], action: policy.Action) -> R:
    """Carry out ``action`` with the one method of ``hands`` that does it."""
    match action:
        case policy.ProposeRound():
            return hands.propose(action)
        case policy.StartWorkers():
            return hands.start_workers(action)
        case policy.FollowRound():
            return hands.follow_round(action)
        case policy.StopWorkers():
            return hands.stop_workers(action)
        case policy.PublishInProcess():
            return hands.publish_in_process(action)
        case policy.StartInStandby():
            return hands.start_in_standby(action)
        case policy.RevokeLostLease():
            return hands.revoke_lost_lease(action)
        case policy.Unregister():
            return hands.unregister(action)
        case policy.Register():
            return hands.register(action)
        case policy.HandleFailure():
            return hands.gather_failure(action)
        case policy.ProbePeers():
            return hands.probe_peers(action)
        case policy.ClaimFailure():
            return hands.claim_failure(action)
        case policy.CountRestart():
            return hands.count_restart(action)
        case policy.ReportRootCause():
            return hands.report_root_cause(action)
        case policy.LeaveRound():
            return hands.leave_round(action)
        case policy.ReformWithoutUs():
            return hands.reform_without_us(action)
        case policy.AnnounceLeave():
            return hands.announce_leave(action)
        case policy.LeaveAtBoundary():
            return hands.leave_at_boundary(action)
        case policy.Succeed():
            return hands.succeed(action)
        case policy.CloseRun():
            return hands.close_run(action)
        case policy.Exit():
            return hands.exit(action)
        case policy.JoinTimedOut():
            return hands.join_timed_out(action)
        case policy.Sleep():
            return hands.sleep(action)


class Driver:
    """A node's state, and the actions decided but not yet carried out.

    Args:
        settings: the node's fixed rules, for every decision.
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.state = AgentState()
        self.rendezvous: rounds.Action | None = None
        """The last round decision (Wait, Participate, ...) a decision acted on."""
        self.exit_code: int | None = None
        self._todo: collections.deque[policy.Action] = collections.deque()

    def feed(self, observed: Observed) -> None:
        """Decide on ``observed``; its actions run next, before any still pending."""
        decision = policy.decide(self.state, observed, self.settings)
        self.state = decision.state
        if decision.rendezvous is not None:
            self.rendezvous = decision.rendezvous
        self._todo.extendleft(reversed(decision.actions))

    def next_action(self) -> policy.Action | None:
        if self.exit_code is not None or not self._todo:
            return None
        return self._todo.popleft()

    def took(self, result: Result) -> None:
        """What the last action returned."""
        if isinstance(result, Exited):
            self.exit_code = result.code
            self._todo.clear()
        elif result is not None:
            self.feed(result)


def carry_out(hands: Hands[Result], driver: Driver, observed: Observed) -> int | None:
    """Decide on ``observed`` and carry out every action that follows; the exit code
    once the node has ended."""
    driver.feed(observed)
    while (action := driver.next_action()) is not None:
        driver.took(dispatch(hands, action))
    return driver.exit_code


async def carry_out_async(hands: Hands[Awaitable[Result]], driver: Driver,
                          observed: Observed) -> int | None:
    """:func:`carry_out` for hands whose actions are awaited (the swarm's nodes)."""
    driver.feed(observed)
    while (action := driver.next_action()) is not None:
        driver.took(await dispatch(hands, action))
    return driver.exit_code
