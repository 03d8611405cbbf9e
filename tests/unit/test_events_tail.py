"""JsonLinesTail: following a JSON-lines file while a writer appends to it."""

from __future__ import annotations

from pathlib import Path

from elastic_rt.events import JsonLinesTail


def test_each_poll_returns_the_whole_rows_added_since_the_last(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    tail = JsonLinesTail(path)
    assert tail.poll() == []  # no file yet
    with open(path, "a") as handle:
        handle.write('{"a": 1}\n{"b": 2}\n{"c"')  # the writer is mid-line
    assert tail.poll() == [{"a": 1}, {"b": 2}]
    with open(path, "a") as handle:
        handle.write(': 3}\nnot json\n')
    assert tail.poll() == [{"c": 3}]  # the torn line, whole now; garbage skipped
    assert tail.poll() == []
