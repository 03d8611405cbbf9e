"""The soak's pure rules (``elastic_rt.harness.soak``): where a fault may land, which
faults the job survived, and a worker's footprint curve, on made-up fleets and logs."""

from __future__ import annotations

import random
import time

from elastic_rt.events import Event
from elastic_rt.harness.soak.audit import (Injection, Verdict, longest_stall, loss_gap,
                                           unprovoked, verdicts)
from elastic_rt.harness.soak.fleet import Fleet
from elastic_rt.harness.soak.footprint import curves, longest_lived, slope
from elastic_rt.harness.soak.plan import FleetView, Hold, Inject, place


def _view(members: str, holders: str | None = None, netns: str = "", minimum: int = 2
          ) -> FleetView:
    return FleetView(tuple(members), frozenset(members if holders is None else holders),
                     frozenset(netns), minimum, etcd_members=3)


# where a fault lands ---------------------------------------------------------------------
def test_a_loss_waits_at_the_minimum_and_lands_above_it() -> None:
    rng = random.Random(0)
    assert isinstance(place("node-kill", _view("ab"), rng), Hold)
    placed = place("node-kill", _view("abc"), rng)
    assert isinstance(placed, Inject) and placed.victim in "abc"


def test_a_worker_kill_may_land_at_the_minimum() -> None:
    assert isinstance(place("worker-kill", _view("ab"), random.Random(0)), Inject)


def test_the_last_member_holding_the_state_is_never_hit() -> None:
    rng = random.Random(0)
    for _ in range(20):
        placed = place("node-kill", _view("abcd", holders="b"), rng)
        assert isinstance(placed, Inject) and placed.victim != "b"
    assert isinstance(place("worker-kill", _view("ab", holders="a"), rng), Inject)
    assert isinstance(place("worker-kill", _view("a", holders="a", minimum=1), rng), Hold)


class _Log:
    """The job's event log as the fleet reads it (``Job.events``)."""

    def __init__(self) -> None:
        self.lines: list[Event] = []

    def events(self) -> list[Event]:
        return self.lines


def test_a_node_the_soak_hit_holds_no_state_before_its_agent_says_so() -> None:
    """Seed 11 lost the state: n103's worker was killed, its agent sat 4 s in an etcd call
    during a member restart before it said so, and the soak meanwhile killed the other
    holder's worker, taking n103 for a holder still."""
    log = _Log()
    fleet = Fleet(log, minimum=2, etcd_members=3, use_netns=False)  # type: ignore[arg-type]
    now = int(time.time() * 1000)
    log.lines += [_round(now - 50, 7, "a", "b"), _done(now - 40, "a", 7, 5),
                  _done(now - 40, "b", 7, 5)]
    assert fleet.view().holders == {"a", "b"}
    fleet.hit("b")
    log.lines.append(_done(now - 30, "b", 7, 6))  # its old worker's last step, read late
    assert fleet.view().holders == {"a"}
    assert place("worker-kill", fleet.view(), random.Random(0)) == Inject("worker-kill", "b")
    log.lines.append(_done(int(time.time() * 1000) + 1, "b", 8, 7))  # its new worker's step
    assert fleet.view().holders == {"a", "b"}


def test_a_cut_lands_only_on_a_member_inside_the_namespace() -> None:
    rng = random.Random(0)
    assert place("netns-cut", _view("abc", netns="c"), rng) == Inject("netns-cut", "c")
    assert isinstance(place("netns-cut", _view("abc", netns="d"), rng), Hold)


def test_an_etcd_restart_always_lands_on_a_member_index() -> None:
    placed = place("etcd-restart", _view("a", holders=""), random.Random(0))
    assert isinstance(placed, Inject) and placed.victim in {"0", "1", "2"}


# survival ---------------------------------------------------------------------------------
def _round(at: int, number: int, *members: str) -> Event:
    return Event("round.formed", "agent", at, round=number, metadata={"members": list(members)})


def _done(at: int, node: str, round_: int, step: int) -> Event:
    return Event("step.completed", "worker", at, node=node, rank=0, round=round_, step=step)


AS_DESIGNED, ONLY_SURVIVED = Verdict(True, True), Verdict(True, False)
NOT_SURVIVED = Verdict(False, False)


def test_a_kill_went_as_designed_when_a_later_round_leaves_the_node_out() -> None:
    kill = Injection("node-kill", "c", at_ms=100, round=0)
    log = [_round(0, 0, "a", "b", "c"), _round(150, 1, "a", "b"), _done(200, "a", 1, 5)]
    assert verdicts([kill], log) == [AS_DESIGNED]
    assert verdicts([kill], log[:2]) == [NOT_SURVIVED]  # no step after it
    assert verdicts([kill], [log[0], log[2]]) == [ONLY_SURVIVED]  # no round without it


def test_a_stopped_node_goes_as_designed_when_it_fences_itself_and_rejoins() -> None:
    stop = Injection("node-stop", "c", at_ms=100, round=0, back_ms=300, round_at_back=1)
    fenced = Event("agent.fenced", "agent", 320, node="c")
    log = [_round(0, 0, "a", "b", "c"), _round(150, 1, "a", "b"), fenced,
           _round(400, 2, "a", "b", "c"), _done(450, "a", 2, 9)]
    assert verdicts([stop], log) == [AS_DESIGNED]
    assert verdicts([stop], [e for e in log if e is not fenced]) == [ONLY_SURVIVED]
    assert verdicts([stop], log[:3] + log[4:]) == [ONLY_SURVIVED]  # never rejoined


def test_a_stopped_node_that_trains_on_alone_in_its_old_round_is_not_survived() -> None:
    stop = Injection("node-stop", "c", at_ms=100, round=0, back_ms=300, round_at_back=1)
    alone = Event("step.completed", "worker", 310, node="c", rank=0, round=0, step=7)
    log = [_round(0, 0, "a", "c"), _round(150, 1, "a"), alone, _done(450, "a", 1, 7)]
    assert verdicts([stop], log) == [NOT_SURVIVED]


def test_a_join_went_as_designed_once_the_new_node_is_a_member() -> None:
    join = Injection("node-join", "d", at_ms=100, round=1)
    log = [_round(300, 2, "a", "d"), _done(400, "a", 2, 3)]
    assert verdicts([join], log) == [AS_DESIGNED]
    assert verdicts([join], [_round(300, 2, "a"), log[1]]) == [ONLY_SURVIVED]


def test_a_fault_whose_own_check_failed_is_not_survived() -> None:
    leave = Injection("agent-leave", "b", at_ms=100, round=0, ok=False, detail="exit code 1")
    log = [Event("node.left", "agent", 120, node="b"), _round(150, 1, "a"), _done(200, "a", 1, 2)]
    assert verdicts([leave], log) == [NOT_SURVIVED]
    assert verdicts([Injection("agent-leave", "b", at_ms=100, round=0)], log) == [AS_DESIGNED]


def test_the_longest_stall_is_the_widest_gap_between_completed_steps() -> None:
    log = [_done(0, "a", 0, 1), _done(100, "a", 0, 2), _done(2600, "a", 1, 3),
           Event("job.finished", "agent", 2700)]
    assert longest_stall(log) == (2.5, 3)


def test_a_job_that_hung_ends_in_a_stall_no_step_ended() -> None:
    log = [_done(0, "a", 0, 1), _done(100, "a", 0, 2), _round(9100, 5, "a", "b")]
    assert longest_stall(log) == (9.0, -1)


def test_an_eviction_no_fault_explains_is_unprovoked() -> None:
    stop = Injection("node-stop", "c", at_ms=1000, round=0, back_ms=3000)
    evicted_c = Event("node.evicted", "agent", 1500, node="a", metadata={"evicted": "c"})
    fenced_c = Event("agent.fenced", "agent", 3100, node="c")
    evicted_b = Event("node.evicted", "agent", 1500, node="a", metadata={"evicted": "b"})
    late = Event("agent.fenced", "agent", 60_000, node="c")
    assert unprovoked([stop], [evicted_c, fenced_c, evicted_b, late]) == [evicted_b, late]


def test_the_loss_gap_compares_each_steps_batch_mean_in_its_newest_round() -> None:
    def done(node: str, round_: int, step: int, loss: float | None, world: int = 2) -> Event:
        return Event("step.completed", "worker", 0, node=node, round=round_, step=step,
                     metadata={"loss": loss, "world_size": world})

    ref = [done("solo", 0, 1, 0.5, 1), done("solo", 0, 2, 0.25, 1), done("solo", 0, 3, 0.1, 1)]
    log = [done("a", 0, 1, 0.4), done("b", 0, 1, 0.6),  # the mean of two halves
           done("a", 0, 2, 9.0),  # abandoned in round 0, done again in round 1
           done("a", 1, 2, 0.25), done("c", 1, 2, None),  # c sat the step out
           done("a", 1, 3, 0.7)]  # only a logged step 3: not compared
    assert loss_gap(log, ref) == (2, 0.0)
    assert loss_gap(log[:2], [done("solo", 0, 1, 0.5 + 1e-3, 1)])[1] > 9e-4


# footprint -------------------------------------------------------------------------------
def _started(at: int, node: str, pid: int, restarted: bool = False) -> Event:
    return Event("worker.restarted" if restarted else "worker.started", "agent", at, node=node,
                 metadata={"pids": [pid]})


def _reformed(at: int, node: str, threads: int) -> Event:
    return Event("groups.reformed", "worker", at, node=node, metadata={"footprint": {
        "threads": threads, "open_fds": 10, "rss_bytes": 1 << 20, "abandoned_groups": 0}})


def test_each_worker_gets_the_re_forms_since_its_agent_started_it() -> None:
    log = [_started(0, "a", 11), _started(0, "b", 22), _reformed(1, "a", 5), _reformed(1, "b", 5),
           _reformed(2, "a", 6), _started(3, "b", 33, restarted=True), _reformed(4, "b", 7),
           _reformed(4, "a", 7)]
    found = {(c.node, c.pid): c.values("threads") for c in curves(log)}
    assert found == {("a", 11): [5, 6, 7], ("b", 22): [5], ("b", 33): [7]}
    longest = longest_lived(curves(log))
    assert longest is not None and (longest.pid, longest.reforms) == (11, 2)


def test_the_slope_is_growth_per_re_form() -> None:
    assert slope([30, 38, 46, 54]) == 8.0
    assert slope([30, 31, 30, 31, 30]) == 0.0
    assert slope([7]) == 0.0
