"""What a node's agent does next, as pure decisions over values.

The agent (``agents/agent.py``) observes (a snapshot of the run, its workers' state,
their acknowledgements, the clock) and calls :func:`decide`, which answers with the
node's next :class:`AgentState` and the actions to carry out, in order. An action
whose outcome matters comes back as an observation (workers started, standby workers
announced, registered, failure claimed, restart counted...), and :func:`decide` takes
it like the loop's own look: it is the only function that returns a new state, and
settling a worker's failure is one of its phases (failures.py). One dispatcher
(:mod:`agents.dispatch`) carries the actions out for the agent and the simulated
nodes alike. Like :mod:`elastic_rt.rendezvous.rounds`, nothing here sleeps, reads a
clock, touches etcd or starts a process, so every rule is a table test
(tests/unit/test_agent_policy.py).

- ``state``: :class:`AgentState` and its :class:`Phase`; :class:`Settings`.
- ``observations``: the loop's :class:`Observation` and each action's result.
- ``actions``: what to do, and the :class:`Decision` that carries it.
- ``running``: the loop's look (join, run, follow or leave a round).
- ``failures``: settling a failure or an alarm; root-cause rules.
- ``leaving``: leaving on notice, at the workers' next step boundary when they can.
- ``outcomes``: how the agent ends (:func:`exit_code` is the only source of one).
"""

from agents.policy.actions import (
    Action,
    AnnounceLeave,
    ClaimFailure,
    CloseRun,
    CountRestart,
    Decision,
    Exit,
    FollowRound,
    HandleFailure,
    JoinTimedOut,
    LeaveAtBoundary,
    LeaveRound,
    ProbePeers,
    ProposeRound,
    PublishInProcess,
    ReformWithoutUs,
    Register,
    ReportRootCause,
    RevokeLostLease,
    Sleep,
    StartInStandby,
    StartWorkers,
    StopWorkers,
    Succeed,
    Unregister,
)
from agents.policy.decide import decide
from agents.policy.failures import (
    AlarmVerdict,
    FailureStep,
    ReplaceWorkers,
    RestartInStandby,
    alarm_verdict,
    on_restart_counted,
    on_worker_failure,
    repeated_failure,
    should_report,
    supersedes,
)
from agents.policy.observations import (
    FailureClaimed,
    FailureFacts,
    FailureSeen,
    Fenced,
    JoiningInPlace,
    LeaveNotice,
    LeaveWritten,
    Observation,
    Observed,
    PeersProbed,
    ReformWritten,
    Registered,
    RegisterFailed,
    RestartCounted,
    RoundFollowed,
    StandbyStarted,
    WorkersStarted,
)
from agents.policy.outcomes import (
    Failed,
    Finished,
    Left,
    Outcome,
    closed_outcome,
    closed_record,
    exit_code,
)
from agents.policy.running import (
    acks_in_process,
    finished_without_us,
    is_stale_run,
    joins_in_standby,
    should_read,
    with_ranks,
)
from agents.policy.state import AgentState, Leaving, Phase, Settings

__all__ = [
    "Action", "AgentState", "AnnounceLeave", "LeaveAtBoundary", "LeaveNotice", "LeaveWritten",
    "Leaving", "AlarmVerdict", "ClaimFailure", "CloseRun", "CountRestart",
    "Decision", "Exit", "Failed", "FailureClaimed", "FailureFacts", "FailureSeen",
    "FailureStep", "Fenced", "Finished", "FollowRound", "HandleFailure", "JoinTimedOut",
    "JoiningInPlace", "LeaveRound", "Left", "Observation", "Observed", "Outcome", "PeersProbed",
    "Phase", "ProbePeers", "ProposeRound", "PublishInProcess", "ReformWithoutUs",
    "ReformWritten", "Register", "RegisterFailed", "Registered", "ReplaceWorkers",
    "ReportRootCause", "RestartCounted", "RestartInStandby", "RevokeLostLease", "RoundFollowed",
    "Settings", "Sleep", "StandbyStarted", "StartInStandby", "StartWorkers", "StopWorkers",
    "Succeed", "Unregister", "WorkersStarted", "acks_in_process", "alarm_verdict", "closed_outcome",
    "closed_record", "decide", "exit_code", "finished_without_us", "is_stale_run",
    "joins_in_standby", "on_restart_counted", "on_worker_failure", "repeated_failure",
    "should_read", "should_report", "supersedes", "with_ranks",
]
