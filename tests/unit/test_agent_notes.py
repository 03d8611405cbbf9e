"""What reaches the agent's loop from elsewhere: other threads' notes, and worker acks."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from agents.inbox import Inbox
from agents.policy import LeaveNotice
from elastic_rt.acks import (
    ack_path,
    leave_note,
    read_acks,
    read_left,
    write_leave_note,
    write_left,
)


def test_a_fence_from_another_thread_is_taken_once_and_wakes_the_loop() -> None:
    inbox = Inbox()
    poster = threading.Thread(target=inbox.fenced)
    poster.start()
    poster.join(timeout=5)
    began = time.monotonic()
    inbox.sleep(5)
    assert time.monotonic() - began < 1.0  # the note woke the loop
    assert inbox.take_fenced() is True
    assert inbox.take_fenced() is False


def test_reread_marks_the_run_dirty_without_waking_and_a_read_clears_it() -> None:
    inbox = Inbox()
    inbox.mark_read()
    assert not inbox.dirty
    inbox.reread()
    assert inbox.dirty
    inbox.mark_read()
    inbox.leave(signal.SIGTERM)
    assert inbox.notice is not None and not inbox.dirty


def test_a_signal_is_a_notice_and_a_second_one_leaves_at_once() -> None:
    inbox = Inbox()
    assert not inbox.wants_to_leave
    inbox.leave(signal.SIGTERM)
    assert inbox.notice == LeaveNotice(source="SIGTERM", signum=signal.SIGTERM)
    assert inbox.leave_signal is None and inbox.wants_to_leave
    inbox.leave(signal.SIGINT)
    assert inbox.leave_signal == signal.SIGINT
    assert inbox.notice is not None and inbox.notice.signum == signal.SIGTERM  # the first stays


def test_a_signal_after_a_polled_notice_is_no_reason_to_leave_at_once() -> None:
    """A preempted VM's pods get SIGTERM too: the notice from the endpoint stands."""
    inbox = Inbox()
    polled = LeaveNotice(source="http://127.0.0.1:1/preempted", detail="TRUE")
    poster = threading.Thread(target=inbox.preempted, args=(polled,))
    poster.start()
    poster.join(timeout=5)
    began = time.monotonic()
    inbox.sleep(5)
    assert time.monotonic() - began < 1.0  # the notice woke the loop
    inbox.leave(signal.SIGTERM)
    inbox.preempted(LeaveNotice(source="later"))
    assert inbox.notice == polled and inbox.leave_signal is None


def test_leave_notes_and_left_records_go_both_ways_between_agent_and_workers(
        tmp_path: Path) -> None:
    agent_dir = str(tmp_path)
    assert leave_note(agent_dir) is None and leave_note("") is None
    write_leave_note(agent_dir, "SIGTERM")
    assert leave_note(agent_dir) == "SIGTERM"
    me = os.getpid()
    assert read_left(agent_dir, [me, me]) == (None, None)
    write_left(agent_dir, 1, 41)
    assert read_left(agent_dir, [me, me]) == (None, 41)
    assert read_left(agent_dir, [me, me + 1]) == (None, None)  # a replaced worker's is no record


def _write(agent_dir: Path, local_rank: int, payload: object) -> None:
    Path(ack_path(str(agent_dir), local_rank)).write_text(json.dumps(payload))


def test_acks_count_only_for_the_running_worker_and_in_process(tmp_path: Path) -> None:
    me = os.getpid()
    _write(tmp_path, 0, {"pid": me, "round": 3, "in_process": True})
    _write(tmp_path, 1, {"pid": me + 1, "round": 3, "in_process": True})  # a dead predecessor
    _write(tmp_path, 2, {"pid": me, "round": 3, "in_process": False})
    Path(ack_path(str(tmp_path), 3)).write_text("{half a json")
    # local rank 4 wrote nothing yet
    assert read_acks(str(tmp_path), [me] * 5) == (3, None, None, None, None)
    assert read_acks(str(tmp_path), []) == ()
