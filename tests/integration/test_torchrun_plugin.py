"""Stock torchrun with ``--rdzv-backend etcd-v3``: three agents, the rank-0 node killed,
the other two re-rendezvousing at world 2 and finishing.

The plugin is found through its ``torchrun.handlers`` entry point (installed by
``pip install -e .``), exactly as a user's torchrun finds it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from elastic_rt.etcd_server import EtcdServer
from elastic_rt.harness import PYTHON
from elastic_rt.harness.env import child_env
from elastic_rt.harness.waits import wait_until
from tests.fixtures.processes import ProcessTree

pytestmark = [pytest.mark.slow, pytest.mark.etcd]

# Each step all-reduces ones and writes world<size>.rank<rank>.agent<agent pid>: the step.
# At the world size given as its second argument it finishes after 5 steps; at any other
# it steps until the test intervenes.
SCRIPT = """
import os, sys, time
from pathlib import Path
import torch
import torch.distributed as dist

out, finish_world = Path(sys.argv[1]), int(sys.argv[2])
dist.init_process_group("gloo")
world, rank = dist.get_world_size(), dist.get_rank()
for step in range(100000):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == world, (t, world)
    mark = out / f"world{world}.rank{rank}.agent{os.getppid()}"
    mark.with_suffix(".tmp").write_text(str(step))
    mark.with_suffix(".tmp").replace(mark)
    if world == finish_world and step >= 5:
        break
    time.sleep(0.05)
dist.destroy_process_group()
"""

RDZV_CONF = ",".join([
    "join_timeout=30", "last_call_timeout=1", "close_timeout=5", "heartbeat=5",
    "keep_alive_interval=1", "keep_alive_max_attempt=2", "read_timeout=20",
])


def _torchrun(endpoint: str, run_id: str, script: Path, out: Path, *, nnodes: str = "1:2",
              finish_world: int = 1) -> list[str]:
    return [
        PYTHON, "-m", "torch.distributed.run", "--rdzv-backend", "etcd-v3",
        "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--rdzv-conf", RDZV_CONF,
        "--nnodes", nnodes, "--nproc-per-node", "1", "--max-restarts", "3",
        "--monitor-interval", "0.2", "--local-addr", "127.0.0.1",
        str(script), str(out), str(finish_world),
    ]


def _env() -> dict[str, str]:
    return child_env(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")


def _marks(out: Path, world: int) -> dict[str, int]:
    found = {}
    for path in out.glob(f"world{world}.rank*"):
        if path.suffix == ".tmp":
            continue
        try:
            found[path.name] = int(path.read_text())
        except (OSError, ValueError):
            continue
    return found


def test_three_agents_lose_the_rank0_node_and_finish_at_world_two(
        etcd_server: EtcdServer, run_id: str, tmp_path: Path,
        process_tree: ProcessTree) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    args = _torchrun(etcd_server.endpoint, run_id, script, out, nnodes="2:3", finish_world=2)
    agents = [process_tree.start(args, env=_env(), log=tmp_path / f"agent{i}.log")
              for i in range(3)]

    def logs() -> str:
        return "\n".join(p.read_text(errors="replace") for p in sorted(tmp_path.glob("*.log")))

    def all_stepping() -> dict[str, int] | None:
        marks = _marks(out, 3)
        return marks if len(marks) == 3 and min(marks.values()) >= 2 else None

    try:
        marks = wait_until(all_stepping, 60, "three agents' workers stepping at world 3")
    except Exception:
        pytest.fail(f"no world 3:\n{logs()[-4000:]}")
    # Kill the node whose worker is rank 0: it hosts the workers' TCPStore, so the new
    # rank 0 starts another and the survivor at rank 1 must be told its new address
    # (torch alone would hand it the dead node's; see elastic_rt/torchrun/handler.py).
    rank0 = next(name for name in marks if ".rank0." in name)
    victim = next(a for a in agents if rank0.endswith(f".agent{a.pid}"))
    survivors = [a for a in agents if a is not victim]
    _kill_node(victim.pid)

    def finished() -> bool:
        return all(a.poll() is not None for a in survivors)

    try:
        wait_until(finished, 60, "the survivors re-rendezvousing at world 2 and finishing")
    except Exception:
        pytest.fail(f"survivors did not finish:\n{logs()[-4000:]}")
    assert [a.returncode for a in survivors] == [0, 0], logs()[-4000:]
    pair = _marks(out, 2)
    assert sorted(pair.values()) == [5, 5], (pair, logs()[-3000:])
    assert {name.split(".agent")[1] for name in pair} == {str(a.pid) for a in survivors}


def _kill_node(agent_pid: int) -> None:
    """SIGKILL an agent's process group and its workers' (torchrun starts each worker in a
    session of its own, so the agent's group alone would leave them stepping)."""
    workers = psutil.Process(agent_pid).children(recursive=True)
    os.killpg(agent_pid, signal.SIGKILL)
    for worker in workers:
        try:
            os.killpg(worker.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_missing_etcd_is_one_clear_line_and_a_failure(tmp_path: Path) -> None:
    endpoint = f"127.0.0.1:{_free_port()}"
    script = tmp_path / "train.py"
    script.write_text("pass\n")
    started = time.monotonic()
    done = subprocess.run(
        _torchrun(endpoint, "no-etcd", script, tmp_path), env=_env(), capture_output=True,
        text=True, timeout=60, start_new_session=True)
    elapsed = time.monotonic() - started
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if "etcd-v3 rendezvous:" in line]
    assert len(lines) == 1, done.stderr[-3000:]
    assert endpoint in lines[0] and "elastic-rt etcd" in lines[0]
    # Ours raises `from None`: no gRPC error chained under torchrun's traceback.
    assert "RpcError" not in done.stderr and "direct cause" not in done.stderr, done.stderr
    assert elapsed < 30, elapsed


def test_a_finished_run_id_runs_again(etcd_server: EtcdServer, run_id: str, tmp_path: Path,
                                      process_tree: ProcessTree) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    for attempt in range(2):
        out = tmp_path / f"out{attempt}"
        out.mkdir()
        log = tmp_path / f"agent{attempt}.log"
        agent = process_tree.start(_torchrun(etcd_server.endpoint, run_id, script, out),
                                   env=_env(), log=log)
        wait_until(lambda: agent.poll() is not None, 45, f"run {attempt} of {run_id} ending")
        assert agent.returncode == 0, log.read_text(errors="replace")[-3000:]
        assert _marks(out, 1) == {f"world1.rank0.agent{agent.pid}": 5}
