"""SIGKILL in the middle of a checkpoint write, in a real child process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.checkpoint.commit import PARTIAL_GRACE_S
from elastic_rt.checkpoint.inspect import verify
from elastic_rt.checkpoint.manifest import MANIFEST_FILE
from tests.checkpoint_tamper import age

pytestmark = pytest.mark.slow

# Saves steps 1, 2, 3... back to back; every tensor of step s holds the value s.
_CHILD = textwrap.dedent("""
    import sys, torch
    from elastic_rt.checkpoint import Checkpointer
    ckpt = Checkpointer(sys.argv[1], keep=2, async_save=False)
    state = {f"w{i}": torch.zeros(256, 1024) for i in range(16)}
    for step in range(1, 100000):
        for tensor in state.values():
            tensor.fill_(float(step))
        ckpt.save(step, state, extra={"step": step})
        print(step, flush=True)
""")
_DEADLINE_S = 60.0


def _partials(root: Path) -> list[Path]:
    """Folders that hold written data but no manifest: a save caught mid-write."""
    found = []
    for folder in root.glob("step-*"):
        try:
            names = {p.name: p.stat().st_size for p in folder.iterdir()}
        except FileNotFoundError:
            continue  # removed by retention while we looked
        if MANIFEST_FILE not in names and any(n.endswith(".distcp") and s > 0
                                              for n, s in names.items()):
            found.append(folder)
    return found


def _kill_mid_write(root: Path, child: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + _DEADLINE_S
    assert child.stdout is not None
    assert child.stdout.readline().strip() == b"1", "the child committed no first checkpoint"
    while time.monotonic() < deadline:
        if _partials(root):
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
            if _partials(root):
                return
            raise AssertionError("the save finished between the check and the kill")
    raise AssertionError("no write in progress was seen before the deadline")


def test_a_save_killed_mid_write_stays_invisible_and_is_cleaned_up(tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(root)], stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _kill_mid_write(root, child)
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait(timeout=10)
    (partial,) = _partials(root)

    ckpt = Checkpointer(str(root), keep=2, async_save=False)
    listed = {i.name: i.committed for i in ckpt.list()}
    assert listed[partial.name] is False and any(listed.values())
    state = {f"w{i}": torch.zeros(256, 1024) for i in range(16)}
    info = ckpt.load(state)
    assert info.step < int(partial.name.split("-")[1])
    assert all(torch.all(t == float(info.step)) for t in state.values())
    assert verify(str(root))[0]

    ckpt.save(info.step + 1000, state)
    assert partial.exists()  # until nothing changed in it for the grace period
    age(partial, PARTIAL_GRACE_S + 60)
    ckpt.save(info.step + 1001, state)
    assert not partial.exists()
    assert all(i.committed for i in ckpt.list())
