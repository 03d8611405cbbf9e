"""Root causes: read from the error file torch's @record writes, stored, and shown."""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import record

from elastic_rt.root_cause import RootCause, read_error_file, write_error_file


def _fail_deep() -> None:
    raise ValueError("bad shape (3, 4)")


@record
def _main() -> None:
    _fail_deep()


def test_reads_the_error_file_torchs_record_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    with pytest.raises(ValueError):
        _main()
    record_ = read_error_file(str(path))
    assert record_ is not None
    assert record_.error == "ValueError: bad shape (3, 4)"
    assert "in _fail_deep" in record_.traceback and record_.time_s is not None
    assert record_.step is None


def test_our_error_file_is_torchs_format_plus_the_step(tmp_path: Path) -> None:
    path = tmp_path / "error.json"
    try:
        _fail_deep()
    except ValueError as exc:
        assert write_error_file(str(path), exc, step=12)
        assert not write_error_file(str(path), RuntimeError("later"), step=13)  # first stays
    assert not write_error_file("", RuntimeError("no file to write"))
    record_ = read_error_file(str(path))
    assert record_ is not None and record_.step == 12
    assert record_.error == "ValueError: bad shape (3, 4)" and "_fail_deep" in record_.traceback


@pytest.mark.parametrize("content", ["", "not json", "[1, 2]", '{"message": 3}'])
def test_an_unreadable_error_file_is_no_record(tmp_path: Path, content: str) -> None:
    path = tmp_path / "error.json"
    path.write_text(content)
    assert read_error_file(str(path)) is None
    assert read_error_file(str(tmp_path / "missing.json")) is None


def test_a_cause_round_trips_and_shows_torchruns_fields() -> None:
    cause = RootCause(round=3, rank=5, node="node-b", host="10.0.0.2", time_ms=1_700_000_000_000,
                      exitcode=1, error="ValueError: bad", step=40,
                      traceback='Traceback:\n  File "train.py", line 9, in step\n')
    assert RootCause.from_json(cause.to_json()) == cause
    table = cause.table()
    for field in ("rank      : 5 (round 3)", "host      : 10.0.0.2", "exitcode  : 1",
                  "step      : 40", "ValueError: bad", 'File "train.py", line 9'):
        assert field in table
    assert cause.summary() == "rank 5 on 10.0.0.2 (node-b) at step 40: ValueError: bad"


@pytest.mark.parametrize("stored", [b"", b"garbage", b"[1]", b'{"round": 1}'])
def test_a_stored_value_that_is_not_a_cause_reads_as_none(stored: bytes) -> None:
    assert RootCause.from_json(stored) is None
