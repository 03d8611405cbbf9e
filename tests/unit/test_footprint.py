"""A worker's footprint: what the soak reads off every re-form."""

from __future__ import annotations

import threading

from elastic_rt.worker.footprint import footprint


def test_footprint_counts_this_process_threads_descriptors_and_memory() -> None:
    before = footprint()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    with open(__file__):
        during = footprint()
    stop.set()
    thread.join()
    assert during["threads"] == before["threads"] + 1  # type: ignore[operator]
    assert during["open_fds"] == before["open_fds"] + 1  # type: ignore[operator]
    assert (during["rss_bytes"] or 0) > 10 << 20  # a Python with torch imported
    assert during["abandoned_groups"] == 0
