"""The agent's one decision: its next state and actions, from what it just observed."""

from __future__ import annotations

import dataclasses

from agents.policy import failures, leaving, running
from agents.policy import observations as seen
from agents.policy.actions import (
    Decision,
    HandleFailure,
    Sleep,
    StartInStandby,
    StopWorkers,
)
from agents.policy.observations import Observed
from agents.policy.state import AgentState, Phase, Settings


def decide(state: AgentState, obs: Observed, settings: Settings) -> Decision:
    """What the agent does next. Pure, and the only function that returns a new state."""
    match obs:
        case seen.Observation():
            if obs.notice is not None and obs.leave_signal is None:
                return leaving.on_look(state, obs, settings)
            return running.on_look(state, obs, settings)
        case seen.Fenced():
            return Decision(_fenced(state), (StopWorkers("the lease was lost"),))
        case seen.WorkersStarted():
            return Decision(dataclasses.replace(
                state, phase=Phase.RUNNING, round=obs.round, ever_ran=True), ())  # fmt: skip
        case seen.RoundFollowed():
            return Decision(dataclasses.replace(
                state, phase=Phase.REFORMING, round=obs.round,
                ack_deadline=obs.now + settings.reform_timeout.total_seconds()), ())  # fmt: skip
        case seen.JoiningInPlace():
            return Decision(state, (StartInStandby(obs.round, obs.round.restarts,
                                                   first=not state.ever_ran, register=True),))
        case seen.StandbyStarted():
            return _standby_started(state, obs)
        case seen.Registered():
            return Decision(dataclasses.replace(state, registered=True), ())
        case seen.RegisterFailed():
            return Decision(state, (Sleep(settings.retry_after.total_seconds()),))
        case seen.FailureSeen():
            return failures.on_failure_seen(state, obs)
        case seen.PeersProbed():
            return failures.on_peers_probed(state, obs, settings)
        case seen.FailureClaimed():
            return failures.on_failure_claimed(state, obs)
        case seen.RestartCounted():
            return failures.on_counted(state, obs, settings)
        case seen.ReformWritten():
            return failures.on_reform_written(state, obs, settings)
        case seen.LeaveWritten():
            return leaving.on_leave_written(state, obs, settings)


def _fenced(state: AgentState) -> AgentState:
    """The lease thread stopped the workers: remember the round to rejoin."""
    if state.phase is Phase.FENCED:
        # fenced again before rejoining: still the same round to rejoin
        return dataclasses.replace(state, registered=False)
    return dataclasses.replace(state, phase=Phase.FENCED, round=state.running, registered=False,
                               failure=None)


def _standby_started(state: AgentState, obs: seen.StandbyStarted) -> Decision:
    """The workers started outside any round; in standby if they announced themselves.

    Either way they belong to no round yet: the round that admits us (even the current
    one, if it still lists us) then starts through FollowRound and gets its store
    published.
    """
    state = dataclasses.replace(state, ever_ran=True,
                                registered=state.registered or obs.registered)
    if any(e.exitcode != 0 for e in obs.exits):
        # Died before announcing itself (killed while importing): replaced in standby like
        # one dying later. Stopping them and joining the normal way would start restart-mode
        # workers in each round that admits us, every member waiting for them to import
        # torch, and again in the next round before they acknowledge (docs/soak.md, 7).
        outside = dataclasses.replace(obs.round, number=-1)
        return Decision(dataclasses.replace(state, phase=Phase.STANDBY, round=outside),
                        (HandleFailure(outside, obs.exits),))
    if not obs.announced:
        return Decision(running.stopped(state),
                        (StopWorkers("standby workers did not start in time"),))
    return Decision(dataclasses.replace(state, phase=Phase.STANDBY,
                                        round=dataclasses.replace(obs.round, number=-1)), ())
