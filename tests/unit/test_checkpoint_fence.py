"""A checkpoint's commit is judged by the round its state was saved in, not the loop's.

The save carries its round's ``Fence``; the run's pointer (``FencedPointer`` over the
run's keys) compares that round's token with the round key when the commit lands,
which for an async save may be after the loop has moved on or let go of its round.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.checkpoint.pointer import Fence
from elastic_rt.errors import FencedOutError
from elastic_rt.events import EventSink, read_events
from elastic_rt.rendezvous.checkpoint_pointer import FencedPointer
from elastic_rt.rendezvous.kv import KeyValue
from elastic_rt.rendezvous.registry import RunRegistry


class _KV:
    """The three calls the pointer makes, with etcd's revisions (unit tests only)."""

    def __init__(self) -> None:
        self.items: dict[str, KeyValue] = {}
        self.revision = 0

    def get(self, key: str) -> KeyValue | None:
        return self.items.get(key)

    def put(self, key: str, value: bytes, *, lease: int | None = None) -> int:
        self.revision += 1
        old = self.items.get(key)
        self.items[key] = KeyValue(key, value, self.revision,
                                   old.create_revision if old else self.revision, lease or 0)
        return self.revision

    def put_if(self, key: str, value: bytes, *, expect: dict[str, int],
               lease: int | None = None) -> int | None:
        for name, revision in expect.items():
            item = self.items.get(name)
            if (item.mod_revision if item else 0) != revision:
                return None
        return self.put(key, value, lease=lease)


class _Run:
    """A run's keys with rounds written one after another; its rounds' tokens."""

    def __init__(self) -> None:
        self.registry = RunRegistry(_KV(), "fence-test")  # type: ignore[arg-type]
        self.tokens: list[int] = []

    def next_round(self) -> Fence:
        """The agents write round k+1 (its token is the round key's new revision)."""
        token = self.registry.kv.put(self.registry.key("round"), b"{}")
        self.tokens.append(token)
        return Fence(round=len(self.tokens) - 1, token=token)

    def pointed_at(self) -> str | None:
        return FencedPointer(self.registry, "").read()


class _MovesOnWhileCommitting(FencedPointer):
    """The loop moves to the next round while the save is still being written."""

    def __init__(self, run: _Run, url: str) -> None:
        super().__init__(run.registry, url)
        self.run = run

    def commit(self, name: str, *, step: int, token: int | None) -> None:
        self.run.next_round()
        super().commit(name, step=step, token=token)


def _state(value: float) -> dict:
    return {"w": torch.full((3, 2), value)}


def _for_run(url: str, pointer: FencedPointer, events: EventSink,
             round_of: int | None) -> Checkpointer:
    return Checkpointer(url, keep=0).for_run(
        pointer=pointer, events=events, collective_timeout=timedelta(seconds=30),
        round_of=lambda: round_of)


def test_a_save_of_round_k_committed_after_round_k_plus_1_formed_is_refused_with_ks_token(
        tmp_path: Path) -> None:
    run, url = _Run(), str(tmp_path / "ckpt")
    events = EventSink(str(tmp_path / "events.jsonl"), source="worker")
    round_k = run.next_round()
    # The loop already trains in round k+1 when the commit lands: that round must not
    # make round k's state current.
    ckpt = _for_run(url, _MovesOnWhileCommitting(run, url), events, round_of=round_k.round + 1)
    ckpt.save(4, _state(4.0), fence=round_k)
    with pytest.raises(FencedOutError, match=f"round token {round_k.token} "):
        ckpt.wait()
    assert run.pointed_at() is None


def test_a_save_committed_while_the_loop_holds_no_round_is_judged_by_its_own_round(
        tmp_path: Path) -> None:
    run, url = _Run(), str(tmp_path / "ckpt")
    events = EventSink(str(tmp_path / "events.jsonl"), source="worker")
    run.next_round()
    round_k = run.next_round()  # the worker started in round 0; its state is round 1's
    # Between two rounds the loop holds none (round_of() is None); the commit still
    # checks round k's token, which is current: the good checkpoint is not refused.
    ckpt = _for_run(url, FencedPointer(run.registry, url), events, round_of=None)
    ckpt.save(6, _state(6.0), fence=round_k)
    info = ckpt.wait()
    assert info is not None and run.pointed_at() == info.name
    (committed,) = [e for e in read_events(events.path or "") if e.name == "checkpoint.committed"]
    assert committed.round == round_k.round and committed.step == 6


def test_a_fenced_pointer_refuses_a_save_that_carries_no_round(tmp_path: Path) -> None:
    run, url = _Run(), str(tmp_path / "ckpt")
    run.next_round()
    ckpt = _for_run(url, FencedPointer(run.registry, url), EventSink(None, source="worker"),
                    round_of=0)
    ckpt.save(2, _state(2.0))
    with pytest.raises(FencedOutError, match="carries no round token"):
        ckpt.wait()
    assert run.pointed_at() is None


def test_for_run_keeps_the_users_settings_and_leaves_the_users_checkpointer_as_it_was(
        tmp_path: Path) -> None:
    run, url = _Run(), str(tmp_path / "ckpt")
    users = Checkpointer(url, every_steps=5, keep=2, async_save=False)
    derived = users.for_run(pointer=FencedPointer(run.registry, url),
                            events=EventSink(None, source="worker"),
                            collective_timeout=timedelta(seconds=30), round_of=lambda: None)
    assert derived is not users
    assert (derived.url, derived.every_steps, derived.keep, derived.async_save) == (
        users.url, 5, 2, False)
    fence = run.next_round()
    derived.save(5, _state(5.0), fence=fence)
    assert run.pointed_at() == derived.wait().name  # type: ignore[union-attr]
    users.save(10, _state(10.0))  # standalone: the manifest alone commits, no pointer
    assert run.pointed_at() != users.wait().name  # type: ignore[union-attr]
    assert [i.step for i in users.list() if i.committed] == [5, 10]
