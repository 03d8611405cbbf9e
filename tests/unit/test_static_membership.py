"""Outside ``elastic-rt launch`` the loop's membership is fixed, and answers as the
follower would for the round it was started in."""

from __future__ import annotations

import dataclasses
from datetime import timedelta

import pytest

from agents.worker_env import round_envs
from elastic_rt.config import WorkerEnv
from elastic_rt.errors import ElasticError
from elastic_rt.rendezvous.rounds import Round
from elastic_rt.worker.membership import Membership, RoundFollower
from elastic_rt.worker.static_membership import StaticMembership

ROUND = Round(number=3, members=("a", "b", "c"), nprocs=(2, 1, 2), hosts=("ha", "hb", "hc"),
              token=77)


def _follower(env: WorkerEnv) -> RoundFollower:
    """A follower without its etcd client: the loop's questions that need none."""
    follower = RoundFollower.__new__(RoundFollower)
    follower.env, follower.registry = env, None  # type: ignore[assignment]
    return follower


def _workers(node: str) -> list[WorkerEnv]:
    """Each worker's environment as the agent writes it for ``ROUND``."""
    base = WorkerEnv(node_id=node, run_id="r", endpoint="127.0.0.1:2379")
    return round_envs(base, ROUND, master=("ha", 29400), restart_count=0)


def _torchrun(env: WorkerEnv) -> WorkerEnv:
    """The same worker under plain torchrun: no etcd, no agent."""
    return dataclasses.replace(env, endpoint="", node_id="", run_id="", agent_dir="")


def test_both_memberships_implement_the_protocol_the_loop_uses() -> None:
    env = _workers("b")[0]
    assert isinstance(StaticMembership(_torchrun(env)), Membership)
    assert isinstance(_follower(env), Membership)


@pytest.mark.parametrize("node", ["a", "b", "c"])
def test_every_worker_gets_the_rank_the_follower_gives_it_in_its_first_round(node: str) -> None:
    for env in _workers(node):
        static = StaticMembership(_torchrun(env))
        first = static.current()
        assert static.rank_in(first) == _follower(env).rank_in(ROUND) == env.rank
        assert (first.number, first.token, first.world_size) == (
            ROUND.number, ROUND.token, ROUND.world_size)


def test_its_store_is_the_one_the_environment_names_as_for_the_followers_first_round() -> None:
    env = _torchrun(_workers("c")[1])
    static = StaticMembership(env)
    # join() asks a membership for the address only for a round it was not started in;
    # for the first round both use MASTER_ADDR:MASTER_PORT, and so does the static one.
    assert static.current().number == env.round
    assert static.store_address(static.current(), timedelta(seconds=1)) == ("ha", 29400)


def test_no_newer_round_ever_forms_so_a_failed_collective_ends_the_job() -> None:
    static = StaticMembership(_torchrun(_workers("a")[0]))
    current = static.current()
    assert not static.has_newer_round(current.number)
    assert not static.has_newer_round(-1)
    static.report_failure(current)
    with pytest.raises(ElasticError, match="outside elastic-rt launch; cannot recover"):
        static.wait_for_round(current.number, timedelta(seconds=1))


def test_it_has_no_run_keys_and_tells_no_agent() -> None:
    static = StaticMembership(_torchrun(_workers("a")[1]))
    assert static.registry is None  # nothing published, fenced or closed
    static.announce()
    static.acknowledge(static.current())
    static.close()


def test_a_bare_process_is_rank_0_of_a_world_of_1_in_round_0() -> None:
    static = StaticMembership(WorkerEnv.from_env({}))
    assert static.rank_in(static.current()) == 0
    assert (static.current().number, static.current().world_size) == (0, 1)
