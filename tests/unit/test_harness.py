"""The shared harness (``elastic_rt.harness``): waits, the process ledger, and who imports it."""

from __future__ import annotations

import ast
import signal
import time
import sys
from pathlib import Path

import psutil
import pytest

from elastic_rt.harness import REPO, ProcessLedger, WaitTimeout, wait_until

# A parent that starts a child in a session of its own (as agents start workers),
# prints the child's PID, and sleeps.
_PARENT_AND_CHILD = (
    "import subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'],"
    " start_new_session=True)\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def test_wait_until_returns_the_first_truthy_value() -> None:
    values = iter([0, None, "", 7])
    assert wait_until(lambda: next(values), 5, "a value", interval=0.001) == 7


def test_wait_until_names_what_it_waited_for_at_the_deadline() -> None:
    with pytest.raises(WaitTimeout, match="waiting for the moon"):
        wait_until(lambda: False, 0.05, "the moon", interval=0.01)


def _start_parent(ledger: ProcessLedger, tmp_path: Path) -> tuple[int, int]:
    """(parent PID, child PID) of a parent whose child lives in its own session."""
    log = tmp_path / "parent.log"
    parent = ledger.start([sys.executable, "-c", _PARENT_AND_CHILD], log=log)
    text = wait_until(lambda: log.read_text().strip(), 30, "the child's PID")
    return parent.pid, int(text)


def test_close_kills_a_descendant_in_another_session_too(tmp_path: Path) -> None:
    ledger = ProcessLedger()
    parent, child = _start_parent(ledger, tmp_path)
    assert {p.pid for p in ledger.tree(parent)} == {parent, child}
    ledger.close()
    assert not ledger.alive()
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def test_the_sampling_thread_sees_descendants_without_being_asked(tmp_path: Path) -> None:
    ledger = ProcessLedger(sample_every=0.02)
    try:
        _start_parent(ledger, tmp_path)
        wait_until(lambda: ledger.seen_count == 2, 10, "the child seen by the sampler")
    finally:
        ledger.close()
    assert not ledger.alive()


def test_signal_tree_reaches_every_group_of_the_tree(tmp_path: Path) -> None:
    ledger = ProcessLedger()
    try:
        parent, child = _start_parent(ledger, tmp_path)
        ledger.signal_tree(parent, signal.SIGSTOP)
        stopped = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP}
        wait_until(lambda: all(psutil.Process(p).status() in stopped for p in (parent, child)),
                   10, "both processes stopped")
    finally:
        ledger.close()  # SIGCONT before SIGKILL: a stopped tree dies too
    assert not ledger.alive()


def test_close_twice_is_harmless(tmp_path: Path) -> None:
    ledger = ProcessLedger()
    _start_parent(ledger, tmp_path)
    ledger.close()
    ledger.close()
    assert not ledger.alive()


def test_library_and_agents_never_import_the_harness() -> None:
    """The harness is for tests, scripts and benchmarks; shipping code must not lean on it."""
    offenders = []
    for root in ("elastic_rt", "agents"):
        for path in (REPO / root).rglob("*.py"):
            if "harness" in path.relative_to(REPO).parts:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                         else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(n == "elastic_rt.harness" or n.startswith("elastic_rt.harness.")
                       for n in names):
                    offenders.append(str(path.relative_to(REPO)))
    assert not offenders


def test_simulated_compute_pauses_until_its_release_file_exists(tmp_path: Path) -> None:
    from elastic_rt.harness.pace import SimulatedCompute

    release = tmp_path / "released"
    compute = SimulatedCompute(0.05, str(release))
    began = time.monotonic()
    compute()
    assert time.monotonic() - began >= 0.05 and not compute.released
    release.touch()
    began = time.monotonic()
    for _ in range(100):
        compute()
    assert compute.released and time.monotonic() - began < 0.05
