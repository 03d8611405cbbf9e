"""Whom the agent's heartbeat watches while its loop waits in an action (docs/soak.md, 6).

The loop retargets the heartbeat between two turns; an action that blocks (agreeing on a
round's store, standby workers importing torch) must not leave the node's successor
unwatched meanwhile. The agent's hands are called here on a stand-in with only the parts
they touch: no etcd, no workers.
"""

from __future__ import annotations

from types import SimpleNamespace

from agents import policy
from agents.agent import Agent
from agents.heartbeat import watched_peer
from agents.policy import AgentState, Phase
from elastic_rt.rendezvous.rounds import Participate, Round, Wait

R2 = Round(number=2, members=("a", "b", "c"), nprocs=(1, 1, 1), hosts=("h", "h", "h"))


class Watch:
    def __init__(self) -> None:
        self.rounds: list[Round | None] = []

    def watch(self, round_: Round | None) -> None:
        self.rounds.append(round_)


def test_the_new_rounds_successor_is_watched_before_the_store_wait() -> None:
    heartbeat, seen = Watch(), []

    def agree(round_: Round) -> None:
        seen.append(list(heartbeat.rounds))  # what is watched while this waits

    agent = SimpleNamespace(heartbeat=heartbeat, _agree_on_store=agree, _waiting_for=None)
    Agent.follow_round(agent, policy.FollowRound(R2))  # type: ignore[arg-type]
    Agent.start_workers(agent, policy.StartWorkers(R2, first=False))  # type: ignore[arg-type]
    assert seen == [[R2], [R2, R2]]


def watched(state: AgentState, decided: object) -> Round | None:
    agent = SimpleNamespace(state=state, driver=SimpleNamespace(rendezvous=decided))
    return Agent._watched_round(agent)  # type: ignore[arg-type]


def test_a_member_waiting_for_its_replacements_ranks_still_watches_its_successor() -> None:
    outside = Round(number=-1, members=R2.members, nprocs=(0, 1, 1), hosts=R2.hosts)
    waiting = AgentState(phase=Phase.STANDBY, round=outside)
    assert watched(waiting, Participate(R2)) == R2
    spare = watched(waiting, Wait("round is full; waiting as a spare"))
    assert watched_peer(spare, "a") is None  # outside any round: nobody
    assert watched(AgentState(phase=Phase.RUNNING, round=R2), Participate(R2)) == R2
