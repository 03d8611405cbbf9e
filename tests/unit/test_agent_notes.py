"""What reaches the agent's loop from elsewhere: other threads' notes, and worker acks."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

from elastic_rt.acks import read_acks
from agents.inbox import Inbox
from elastic_rt.acks import ack_path


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
    assert inbox.leave_signal == signal.SIGTERM and not inbox.dirty


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
