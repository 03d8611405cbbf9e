"""The loop's look at the run and the workers: join, run, follow or leave a round.

The rules, as :mod:`elastic_rt.rendezvous.rounds` decides rounds: a leave signal comes
first; etcd not answering never stops the workers; a round that lists us starts our
workers (restart mode) or has them re-form by themselves (in-process, every worker
alive and acknowledged); a round of fewer than ``min`` members stops them; a node back
from a fence rejoins before anything else.
"""

from __future__ import annotations

import dataclasses

from agents.policy.actions import (
    Action,
    CloseRun,
    Decision,
    Exit,
    FollowRound,
    HandleFailure,
    JoinTimedOut,
    ProbePeers,
    ProposeRound,
    PublishInProcess,
    Register,
    RevokeLostLease,
    Sleep,
    StartInStandby,
    StartWorkers,
    StopWorkers,
    Succeed,
)
from agents.policy.observations import Observation
from agents.policy.outcomes import Finished, Left, closed_outcome
from agents.policy.state import AgentState, Phase, Settings
from agents.worker_state import WorkerState
from elastic_rt.rendezvous import rounds
from elastic_rt.rendezvous.rounds import Propose, Round, Snapshot, restart_round


def should_read(state: AgentState, *, dirty: bool, since_read: float, settings: Settings) -> bool:
    """Re-read the run only on a change, at least every ``reread_every``, or when not settled.

    Checking local workers every monitor interval costs nothing; reading the whole
    run from etcd that often would, for every node of a large job.
    """
    if dirty or state.phase is not Phase.RUNNING:
        return True
    return since_read >= settings.reread_every.total_seconds()


def acks_in_process(acks: tuple[int | None, ...]) -> bool:
    """Every local worker (alive or not) has announced in-process recovery."""
    return bool(acks) and all(a is not None for a in acks)


def _joined(acks: tuple[int | None, ...], number: int) -> bool:
    return all(a is not None and a >= number for a in acks)


def _follow(obs: Observation) -> bool:
    """Every local worker is alive and recovers in-process.

    A dead worker's ack file outlives it. Following the round with it would make
    the new round wait for a rank that never comes (and when that rank is 0, hosts
    its store), so a node with a dead worker restarts instead.
    """
    return obs.workers is WorkerState.RUNNING and acks_in_process(obs.acks)


def stopped(state: AgentState) -> AgentState:
    return dataclasses.replace(state, phase=Phase.IDLE, round=None, failure=None)


def on_look(state: AgentState, obs: Observation, settings: Settings) -> Decision:
    """One turn of the loop."""
    if obs.leave_signal is not None:
        notice = state.leaving.notice if state.leaving else None
        return Decision(state, (Exit(Left(obs.leave_signal, source=notice.source if notice
                                          else "", why="a second signal" if notice else "")),))
    if obs.store_error:
        return Decision(state, (Sleep(settings.retry_after.total_seconds()),))
    snapshot = obs.snapshot
    if snapshot is None:
        assert state.round is not None, "the run is re-read while not in a round"
        return participate(state, state.round, obs, settings)
    if snapshot.completing and finished_without_us(state, snapshot, obs, settings.node_id):
        return Decision(state, (
            CloseRun(Finished("finished")),
            Exit(Finished("finished: the job completed before this node's workers joined")),
        ))  # fmt: skip
    action = rounds.decide(snapshot, settings.node_id, settings.limits, now=obs.now,
                           quorum_since=state.quorum_since, now_ms=obs.now_ms)
    if isinstance(action, rounds.Closed):
        return Decision(state, (Exit(closed_outcome(action.reason)),), action)
    if state.phase is Phase.STANDBY and obs.workers is WorkerState.FAILED:
        # A standby worker died: replace it now, whatever the round says. Waiting would
        # let a round admit us with a dead worker; the members would then wait for it.
        assert state.round is not None, "standby workers wait for a round"
        return Decision(state, (HandleFailure(state.round, obs.exits),), action)
    if state.phase is Phase.FENCED and not state.registered:
        return Decision(state, _rejoin(state, snapshot), action)
    if isinstance(action, rounds.Propose):
        return Decision(state, (ProposeRound(action, replaced=snapshot.round),), action)
    if isinstance(action, rounds.Wait):
        return dataclasses.replace(_wait(state, action, obs, settings, len(snapshot.nodes)),
                                   rendezvous=action)
    grow = _grow_back(state, action.round, obs, settings, snapshot)
    if grow is not None:
        return Decision(state, (grow,), action)
    if snapshot.alarm and snapshot.alarm[1] > state.alarm_seen:
        state = dataclasses.replace(state, alarm_seen=snapshot.alarm[1])
        if snapshot.alarm[0] == action.round.number:
            return Decision(state, (ProbePeers(action.round),), action)
    return dataclasses.replace(participate(state, action.round, obs, settings), rendezvous=action)


def _rejoin(state: AgentState, snapshot: Snapshot) -> tuple[Action, ...]:
    """Back from a fence. In a job that recovers in place, come back like a new node:
    what is left of the old lease goes (the survivors re-form without us at once, if
    they have not yet) and the workers start in standby. In restart mode, or as the
    job ends, register, and the next round that lists us starts our workers."""
    if snapshot.round is None or not joins_in_standby(snapshot):
        return (Register(),)
    return (RevokeLostLease(), StartInStandby(snapshot.round, snapshot.round.restarts,
                                              first=not state.ever_ran, register=True))


def _grow_back(state: AgentState, round_: Round, obs: Observation, settings: Settings,
               snapshot: Snapshot) -> ProposeRound | None:
    """Our workers are back after a replacement (see :class:`ReplaceWorkers`): ask for
    the ranks the round took from this node.

    With standby workers that have announced themselves they join at the survivors'
    next step boundary; with none (they did not start in time), the round restarts ours.
    Like an admission (``rounds.decide``) it waits until ``round_`` has trained a step,
    unless it has no ranks that could: a round that only adds ranks, formed while the
    current one's ranks still join, splits them between the two.
    """
    me = settings.node_id
    if snapshot.completing or round_.nprocs[round_.group_rank(me)] >= settings.nproc:
        return None
    if sum(round_.nprocs) > 0 and not rounds.trained_in(snapshot, round_):
        return None
    ready = state.phase is Phase.STANDBY and _follow(obs)
    idle = state.phase is Phase.IDLE and obs.workers is WorkerState.IDLE
    if not (ready or idle):
        return None
    return ProposeRound(with_ranks(round_, me, settings.nproc, f"{me}'s workers are back",
                                   obs.now_ms))


def with_ranks(round_: Round, node_id: str, nproc: int, reason: str, now_ms: int, *,
               restarts: int | None = None) -> Propose:
    """The same members in a new round, with ``node_id`` contributing ``nproc`` ranks
    (``restarts``: as :func:`~elastic_rt.rendezvous.rounds.restart_round`)."""
    nprocs = list(round_.nprocs)
    nprocs[round_.group_rank(node_id)] = nproc
    proposal = restart_round(round_, reason, now_ms, restarts=restarts)
    return dataclasses.replace(proposal,
                               round=dataclasses.replace(proposal.round, nprocs=tuple(nprocs)))


def _wait(state: AgentState, action: rounds.Wait, obs: Observation, settings: Settings,
          registered: int) -> Decision:
    state = dataclasses.replace(state, quorum_since=action.quorum_since)
    actions: list[Action] = []
    if (action.stop_workers or state.running is not None) and state.phase is not Phase.STANDBY:
        actions.append(StopWorkers(f"waiting: {action.reason}"))
        state = stopped(state)
    if not state.ever_ran and obs.waited > settings.join_timeout.total_seconds():
        actions.append(JoinTimedOut(registered))
    actions.append(Sleep(settings.wait_poll.total_seconds(), waiting_for=action.reason))
    return Decision(state, tuple(actions))


def participate(state: AgentState, round_: Round, obs: Observation, settings: Settings
                ) -> Decision:
    """Run (or keep running) this node's workers in ``round_``."""
    if state.phase is Phase.FENCED:
        # We stopped our workers while cut off; everyone restarts in a new round.
        cut_from, state = state.round, stopped(state)
        if cut_from is not None and cut_from.number == round_.number:
            why = f"{settings.node_id} rejoined"
            return Decision(state, (ProposeRound(restart_round(round_, why, obs.now_ms)),))
    current = state.running
    if current is None or current.number != round_.number:
        return _new_round(state, current, round_, obs)
    actions: list[Action] = []
    running = obs.workers is WorkerState.RUNNING
    if state.phase is Phase.REFORMING and running:
        if _joined(obs.acks, round_.number):
            state = dataclasses.replace(state, phase=Phase.RUNNING)
        elif obs.now > state.ack_deadline:
            # Restart mode is the fallback, never a hang.
            return Decision(stopped(state), (StopWorkers("in-process re-form timed out"),
                                             Sleep(settings.monitor_interval.total_seconds())))
    if not state.in_process_published and running and acks_in_process(obs.acks):
        state = dataclasses.replace(state, in_process_published=True)
        actions.append(PublishInProcess())
    if obs.workers is WorkerState.SUCCEEDED:
        actions.append(Succeed(state.running))
    elif obs.workers is WorkerState.FAILED:
        actions.append(HandleFailure(round_, obs.exits))
    else:
        actions.append(Sleep(settings.monitor_interval.total_seconds()))
    return Decision(state, tuple(actions))


def _new_round(state: AgentState, current: Round | None, round_: Round, obs: Observation
               ) -> Decision:
    """``round_`` lists us and our workers are in another round, or in none."""
    if current is not None and obs.workers is WorkerState.FAILED:
        # Our own worker died as the round changed: a failure, not a re-form.
        return Decision(state, (HandleFailure(current, obs.exits),))
    if current is not None and obs.workers is WorkerState.SUCCEEDED:
        return Decision(state, (Succeed(current),))  # done as a node was admitted
    if current is not None and _follow(obs):
        return Decision(state, (FollowRound(round_),))
    if current is not None:
        state = stopped(state)
        lost = set(current.members) - set(round_.members)
        why = f"round {round_.number} formed" + (f" without {sorted(lost)}" if lost else "")
        return Decision(state, (StopWorkers(why, grace=not lost),
                                StartWorkers(round_, first=False)))
    return Decision(state, (StartWorkers(round_, first=not state.ever_ran),))


def finished_without_us(state: AgentState, snapshot: Snapshot, obs: Observation, me: str
                        ) -> bool:
    """The job completed in a round that lists us, and every other member has left.

    Seen when a node is admitted just as the others finish their last step: its
    workers would wait for a round store that is gone. It applies when we have no
    workers, or in-process workers that never joined the round (their acks say so);
    a worker that did join may still be writing its outputs, so it is never cut short.
    """
    round_ = snapshot.round
    if round_ is None or me not in round_.members or not snapshot.nodes_known:
        return False  # a follower cannot tell who left; the leader's rounds will
    if any(m in snapshot.nodes for m in round_.members if m != me):
        return False
    if obs.workers is not WorkerState.RUNNING:
        return state.running is None and obs.workers is WorkerState.IDLE
    if not acks_in_process(obs.acks):
        return False
    return not any(a is not None and a >= round_.number for a in obs.acks)


def is_stale_run(snapshot: Snapshot) -> bool:
    """A finished run with nobody left: a new launch with the same id starts afresh."""
    return ((snapshot.closed is not None or snapshot.completing) and snapshot.nodes_known
            and not snapshot.nodes)


def joins_in_standby(snapshot: Snapshot) -> bool:
    """(Re)joining a job that recovers in place: start the workers before registering.

    Admitting us before our workers have imported torch would make every survivor
    wait for them. This holds for a new node, for one back from a fence and for one
    that restarted (the round may still list it, and hold its old registration,
    which the agent revokes first).
    """
    return (snapshot.in_process and snapshot.round is not None
            and not (snapshot.closed or snapshot.completing))
