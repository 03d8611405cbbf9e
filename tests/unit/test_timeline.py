"""The timeline reads recoveries out of events and draws them to a real image file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from elastic_rt.errors import ConfigError, NoEventsError
from elastic_rt.events import Event
from elastic_rt.ops.timeline import describe, duration_text, find_recoveries, load_events
from elastic_rt.ops.timeline_draw import draw, draw_timeline

T0 = 1_700_000_000_000


def _event(name: str, at_s: float, node: str, *, source: str = "agent", rank: int | None = None,
           round: int | None = None, step: int | None = None, **metadata: object) -> Event:
    return Event(name=name, source=source, timestamp_ms=T0 + int(at_s * 1000), run_id="demo",
                 node=node, rank=rank, round=round, step=step, metadata=dict(metadata))  # fmt: skip


def _steps(node: str, rank: int, start_s: float, end_s: float, first_step: int) -> list[Event]:
    count = int((end_s - start_s) / 0.25)
    return [_event("step.completed", start_s + 0.25 * i, node, source="worker", rank=rank,
                   step=first_step + i) for i in range(count)]  # fmt: skip


def in_process_run() -> list[Event]:
    """Three nodes; c dies at 6 s and is dropped at 8 s; d joins at 12 s; done at 16 s."""
    events = [_event("node.joined", 0.0, n, host="127.0.0.1", nproc=1) for n in "abc"]
    events += [_event("round.formed", 0.5, "a", round=0, world_size=3, members=list("abc"),
                      reason="all nodes joined")]  # fmt: skip
    events += [_event("worker.started", 0.6, n, round=0, world_size=3) for n in "abc"]
    for rank, node in enumerate("abc"):
        events += _steps(node, rank, 1.0, 6.0 if node == "c" else 6.1, 1)
    events += [_event("step.retried", 6.3, n, source="worker", rank=r) for r, n in enumerate("ab")]
    events += [_event("node.lost", 8.0, "a", round=1, lost="c"),
               _event("round.formed", 8.0, "a", round=1, world_size=2, members=list("ab"),
                      reason="lost c")]  # fmt: skip
    for name, at in (("groups.reformed", 8.3), ("state.restored", 8.6), ("step.resumed", 8.8)):
        events += [_event(name, at + 0.05 * r, n, source="worker", rank=r, round=1)
                   for r, n in enumerate("ab")]  # fmt: skip
    for rank, node in enumerate("ab"):
        events += _steps(node, rank, 9.0, 12.0, 21)
    events += [_event("node.joined", 12.0, "d", host="127.0.0.1", nproc=1),
               _event("round.formed", 12.1, "a", round=2, world_size=3, members=list("abd"),
                      reason="admitting d"),
               _event("worker.started", 12.2, "d", round=2, world_size=3)]  # fmt: skip
    for name, at in (("groups.reformed", 12.6), ("state.restored", 12.9), ("step.resumed", 13.0)):
        events += [_event(name, at, n, source="worker", rank=r, round=2)
                   for r, n in enumerate("abd")]  # fmt: skip
    for rank, node in enumerate("abd"):
        events += _steps(node, rank, 13.2, 16.0, 33)
    events += [_event("job.finished", 16.1, n, round=2) for n in "abd"]
    return events


def restart_run(*, worker_events: bool = True) -> list[Event]:
    """Restart mode, as the issue saw it: c is killed after its step at 4.75 s; a's worker
    fails 3.7 s later and a restart round forms with c still a member (its lease holds);
    no worker starts in it before c's lease expires and round 2 drops c; a and b restart
    and train again from 14 s (importing torch takes seconds). e joins at 15 s and is
    never admitted; its agent leaves at 18 s, after the job ended at 16.5 s."""
    events = [_event("node.joined", 0.0, n, host="127.0.0.1", nproc=1) for n in "abc"]
    events += [_event("round.formed", 0.5, "a", round=0, world_size=3, members=list("abc"),
                      reason="all nodes joined")]  # fmt: skip
    events += [_event("worker.started", 0.6, n, round=0, world_size=3) for n in "abc"]
    for rank, node in enumerate("abc"):
        events += _steps(node, rank, 1.0, 5.1, 1)
    events += [_event("checkpoint.committed", 3.05, "a", source="worker", rank=0, step=9)]
    events += [_event("worker.failed", 8.8, "a", round=0, local_rank=0, exitcode=1),
               _event("round.formed", 8.85, "a", round=1, world_size=3, members=list("abc"),
                      reason="a's worker failed (restart 1/3)"),
               _event("node.lost", 10.2, "a", round=2, lost="c"),
               _event("round.formed", 10.2, "a", round=2, world_size=2, members=list("ab"),
                      reason="lost c")]  # fmt: skip
    events += [_event("worker.restarted", 10.4 + 0.05 * r, n, round=2, world_size=2)
               for r, n in enumerate("ab")]  # fmt: skip
    for rank, node in enumerate("ab"):
        events += _steps(node, rank, 14.0, 16.5, 9)
    events += [_event("job.finished", 16.5, n, round=2) for n in "ab"]
    events += [_event("node.joined", 15.0, "e", host="127.0.0.1", nproc=1),
               _event("agent.exited", 18.0, "e")]  # fmt: skip
    if not worker_events:
        events = [e for e in events if e.source == "agent"]
    return sorted(events, key=lambda e: e.timestamp_ms)


def _write(path: Path, events: list[Event]) -> str:
    path.write_text("".join(e.to_json() + "\n" for e in events))
    return str(path)


def test_recoveries_are_timed_from_the_first_fault_through_each_phase() -> None:
    first, second = find_recoveries(sorted(in_process_run(), key=lambda e: e.timestamp_ms))
    assert (first.round, first.cause, first.world_before, first.world_after) == (1, "lost c", 3, 2)
    assert [p.label for p in first.phases] == [
        "detect + rendezvous", "re-form groups", "restore state", "resume step"]  # fmt: skip
    # c's last step: it died after that (the survivors reported at 6.3 s, the lease at 8 s)
    assert first.start_ms == T0 + 5750
    assert first.end_ms == T0 + 8850  # the slowest rank resumed
    assert second.cause == "admitting d" and second.start_ms == T0 + 12000
    assert describe(first).startswith("round 1: lost c, world 3 -> 2, 3.1 s")


def test_a_growth_counts_the_survivors_pause_not_the_newcomers_start() -> None:
    """In-process, a newcomer's workers start before it is admitted while the survivors
    train on: the growth's recovery starts at their last step, not at the join."""
    events = [_event("node.joined", 10.0, "d", host="127.0.0.1", nproc=1)
              if e.name == "node.joined" and e.node == "d" else e for e in in_process_run()]
    _, second = find_recoveries(sorted(events, key=lambda e: e.timestamp_ms))
    assert second.start_ms == T0 + 11750  # a and b's last step of round 1


def test_worker_round_events_do_not_stand_for_the_agents_rounds() -> None:
    """Workers report round.formed (without members) as they notice a round."""
    events = in_process_run() + [_event("round.formed", 12.15, "a", source="worker", rank=0,
                                        round=2, world_size=3)]  # fmt: skip
    _, second = find_recoveries(sorted(events, key=lambda e: e.timestamp_ms))
    assert second.cause == "admitting d" and second.world_before == 2


def test_a_killed_node_without_reports_is_dated_by_its_last_step() -> None:
    events = [e for e in in_process_run() if e.name != "step.retried"]
    first = find_recoveries(sorted(events, key=lambda e: e.timestamp_ms))[0]
    assert first.start_ms == T0 + 5750 and first.is_start_seen


def test_agent_events_alone_say_the_detection_time_is_not_seen() -> None:
    events = [e for e in in_process_run() if e.source == "agent"]
    first = find_recoveries(events)[0]
    assert not first.is_start_seen
    assert "+ detection" in describe(first)


def test_draws_a_png_from_agent_and_worker_files(tmp_path: Path) -> None:
    events = in_process_run()
    agent = _write(tmp_path / "agent.jsonl", [e for e in events if e.source == "agent"])
    worker = _write(tmp_path / "worker.jsonl", [e for e in events if e.source == "worker"])
    out = draw_timeline([agent, worker, agent], str(tmp_path / "run.png"))
    data = Path(out).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 30_000  # a drawn figure, not an empty canvas


def test_draws_agent_events_alone_as_svg(tmp_path: Path) -> None:
    agent = _write(tmp_path / "agent.jsonl", [e for e in in_process_run() if e.source == "agent"])
    text = Path(draw_timeline([agent], str(tmp_path / "run.svg"))).read_text()
    assert "<svg" in text and "lost" in text


def test_load_merges_files_in_time_order_without_duplicates(tmp_path: Path) -> None:
    events = in_process_run()
    a = _write(tmp_path / "a.jsonl", events[::2])
    b = _write(tmp_path / "b.jsonl", events[1::2] + events[:3])
    merged = load_events([a, b])
    assert len(merged) == len(events)
    assert [e.timestamp_ms for e in merged] == sorted(e.timestamp_ms for e in events)


@pytest.mark.parametrize("content", [None, "", "not json\n"])
def test_a_missing_or_empty_events_file_is_one_clear_error(
    tmp_path: Path, content: str | None
) -> None:
    path = tmp_path / "events.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(NoEventsError) as caught:
        draw_timeline([str(path)], str(tmp_path / "run.png"))
    assert "\n" not in caught.value.one_line()
    assert str(path) in caught.value.one_line()


def test_an_unknown_image_format_is_a_config_error(tmp_path: Path) -> None:
    agent = _write(tmp_path / "agent.jsonl", in_process_run()[:5])
    with pytest.raises(ConfigError, match="png"):
        draw_timeline([agent], str(tmp_path / "run.txt"))


def test_a_restart_round_overtaken_before_its_workers_ran_is_part_of_the_next() -> None:
    (recovery,) = find_recoveries(restart_run())
    assert recovery.round == 2 and (recovery.world_before, recovery.world_after) == (3, 2)
    assert recovery.cause == "a's worker failed (restart 1/3), then lost c"
    assert recovery.start_ms == T0 + 4750  # c's last step, not a's report 4 s later
    assert recovery.end_ms == T0 + 14000  # the first step after the restart
    assert [p.label for p in recovery.phases] == ["detect + rendezvous", "restart workers",
                                                  "first step"]  # fmt: skip
    assert describe(recovery).startswith("round 2: a's worker failed (restart 1/3), then lost c, "
                                         "world 3 -> 2, 9.")  # fmt: skip


def test_agent_events_alone_say_what_a_restart_leaves_uncounted() -> None:
    (recovery,) = find_recoveries(restart_run(worker_events=False))
    assert recovery.start_ms == T0 + 8800 and recovery.end_ms == T0 + 10450
    assert not recovery.is_end_seen
    assert duration_text(recovery) == "1.6 s + detection + start-up"


def _axes(figure: Any) -> dict[str, Any]:
    return {ax.get_ylabel().split(" ")[0] or ax.get_title(loc="left"): ax for ax in figure.axes}


def test_the_picture_titles_a_restart_with_its_true_length_and_names_the_waiting_node() -> None:
    events = restart_run()
    figure = draw(events, find_recoveries(events))
    title = figure.get_suptitle()
    assert "1 recovery (9.2 s)" in title and "e never admitted" in title


def test_a_node_never_admitted_gets_no_bar_and_no_lane_past_the_jobs_end() -> None:
    events = restart_run()
    axes = _axes(draw(events, find_recoveries(events)))
    nodes = axes["node"]
    assert "e\n(never admitted)" in [t.get_text() for t in nodes.get_yticklabels()]
    assert nodes.get_xlim()[1] < 17.0  # the job ended at 16.5 s; e's agent left at 18 s
    lane_e = 0  # e sorts last, so its lane is the lowest
    solid = [bar for bar in nodes.collections if bar.get_hatch() is None]
    assert not any(abs(path.vertices[:, 1].mean() - lane_e) < 0.3
                   for bar in solid for path in bar.get_paths())  # fmt: skip


def test_checkpoints_are_drawn_at_their_step() -> None:
    events = restart_run()
    steps = _axes(draw(events, find_recoveries(events)))["step"]
    marks = [line for line in steps.get_lines() if line.get_marker() == "d"]
    assert [(float(m.get_xdata()[0]), float(m.get_ydata()[0])) for m in marks] == [(3.05, 9.0)]


def test_a_short_recovery_gets_a_zoomed_panel_in_milliseconds() -> None:
    events = restart_run(worker_events=False)
    events += [_event("job.finished", 100.0, n, round=2) for n in "ab"]
    zoomed = [ax for ax in draw(events, find_recoveries(events)).axes
              if "zoomed" in ax.get_title(loc="left")]  # fmt: skip
    (ax,) = zoomed
    assert ax.get_title(loc="left") == "round 2 zoomed: 1.6 s + detection + start-up"
    assert ax.get_xlim()[1] == pytest.approx(1650 * 1.05)


def test_step_lines_of_workers_in_lockstep_are_drawn_apart() -> None:
    events = in_process_run()  # a and b complete step 1 at 1.0 s: the same data point
    steps = _axes(draw(events, find_recoveries(events)))["step"]
    starts = [line.get_transform().transform((line.get_xdata()[0], line.get_ydata()[0]))
              for line in steps.get_lines()
              if line.get_xdata()[0] == 1.0 and line.get_marker() in ("None", None)]  # fmt: skip
    heights = sorted(float(y) for _, y in starts)
    assert len(heights) == 3  # a, b, c
    gap = 2.5 * steps.figure.dpi / 72
    assert heights[1] - heights[0] == pytest.approx(gap)
    assert heights[2] - heights[1] == pytest.approx(gap)


def preempted_run() -> list[Event]:
    """Three nodes; c is told to leave at 5.1 s, leaves after its step at 6 s; a and b go on."""
    events = [_event("node.joined", 0.0, n, host="127.0.0.1", nproc=1) for n in "abc"]
    events += [_event("round.formed", 0.5, "a", round=0, world_size=3, members=list("abc"),
                      reason="all nodes joined")]  # fmt: skip
    events += [_event("worker.started", 0.6, n, round=0, world_size=3) for n in "abc"]
    for rank, node in enumerate("abc"):
        events += _steps(node, rank, 1.0, 6.1, 1)
    events += [_event("node.preempting", 5.1, "c", round=0, source="SIGTERM", at_boundary=True),
               _event("round.formed", 5.9, "c", round=1, world_size=2, members=list("ab"),
                      reason="left c after step 20 (SIGTERM)"),
               _event("node.left", 6.0, "c", round=0, step=20, source="SIGTERM",
                      at_boundary=True)]  # fmt: skip
    for name, at in (("groups.reformed", 6.0), ("state.restored", 6.05), ("step.resumed", 6.3)):
        events += [_event(name, at, n, source="worker", rank=r, round=1)
                   for r, n in enumerate("ab")]  # fmt: skip
    for rank, node in enumerate("ab"):
        events += _steps(node, rank, 6.3, 9.0, 21)
    events += [_event("job.finished", 9.1, n, round=1) for n in "ab"]
    return sorted(events, key=lambda e: e.timestamp_ms)


def test_a_leave_on_notice_is_timed_from_the_boundary_not_the_notice(tmp_path: Path) -> None:
    (leave,) = find_recoveries(preempted_run())
    assert leave.cause == "left c after step 20 (SIGTERM)"
    assert leave.start_ms == T0 + 5750  # c's last step: it trained on after the notice
    assert (leave.world_before, leave.world_after) == (3, 2)
    text = Path(draw_timeline([_write(tmp_path / "e.jsonl", preempted_run())],
                              str(tmp_path / "run.svg"))).read_text()
    assert "told to leave" in text and "c left" in text
