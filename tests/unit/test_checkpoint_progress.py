"""A long checkpoint write reports how far it has got."""

from __future__ import annotations

import logging

import pytest

from elastic_rt.checkpoint import sharded
from elastic_rt.harness import wait_until


class _Counting:
    written = 0


def test_a_slow_write_logs_bytes_written_so_far(caplog: pytest.LogCaptureFixture) -> None:
    fs = _Counting()
    caplog.set_level(logging.INFO, logger="elastic_rt.checkpoint.sharded")
    url = "file:///ckpt/step-00000001-abcdef"
    with sharded._progress(fs, url, 4_000_000, every=0.05):  # type: ignore[arg-type]
        fs.written = 2_000_000
        wait_until(lambda: "2.0 of 4.0 MB" in caplog.text, 10, "the progress line",
                   interval=0.01)
    assert "writing checkpoint file:///ckpt/step-00000001-abcdef: 2.0 of 4.0 MB" in caplog.text
