"""Shared helpers for tests that run ``elastic-rt launch`` process trees."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable

from elastic_rt.events import Event, read_events
from elastic_rt.harness import PYTHON, REPO, ProcessLedger, child_env, wait_until

TORCHRUN_SCRIPT = str(REPO / "scripts" / "examples" / "torchrun_ddp.py")
TRAIN_SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")


def launch_args(endpoint: str, run_id: str, nnodes: str, events: Path, *, node_id: str,
                nproc: int = 1, extra: tuple[str, ...] = ()) -> list[str]:
    return [
        "launch", "--nnodes", nnodes, "--nproc-per-node", str(nproc),
        "--rdzv-endpoint", f"etcd://{endpoint}", "--run-id", run_id,
        "--node-id", node_id, "--events-file", str(events), "--lease-ttl", "3",
        "--last-call", "0.5", *extra,
    ]  # fmt: skip


def scrape(url: str, timeout: float = 30) -> dict[tuple[str, str], float]:
    """A Prometheus endpoint's samples as {(name, cause or source label): value}.

    A read that fails (seen once: a reset mid-response on a loaded box) is tried again
    until ``timeout``: the endpoint serves a snapshot, so a later read is as good."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    def read() -> str | None:
        try:
            with urlopen(url, timeout=5) as response:
                return response.read().decode()
        except OSError:
            return None

    text = wait_until(read, timeout, f"a read of {url}")
    return {(s.name, s.labels.get("cause", s.labels.get("source", ""))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if "le" not in s.labels}


def progress(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def events(path: Path) -> list[Event]:
    return list(read_events(str(path)))


def release_pace_when_training(events_file: Path, release: Path, node: str,
                               since: Callable[[Event], bool] = lambda e: True,
                               timeout: float = 180) -> None:
    """Create ``release`` (the examples' ``--step-time-until``) once ``node``'s workers have
    completed a step after the first event matching ``since``: the job kept its slow pace only
    so that ``node``, starting late, came in before the end. (Not the round's own event: the
    agent that forms a round writes it, and a round listing ``node`` can form just before the
    one that takes it back.)"""
    def training() -> bool:
        log = events(events_file)
        start = next((i for i, e in enumerate(log) if since(e)), None)
        return start is not None and any(e.name == "step.completed" and e.node == node
                                         for e in log[start:])

    wait_until(training, timeout, f"{node}'s workers training")
    release.touch()


def exit_code(node: subprocess.Popen[bytes], timeout: float, log: Path, events_file: Path) -> int:
    """The node's exit code; if it runs past ``timeout``, a failure that shows its log's
    tail and the run's last events, so a hang in CI says where it stopped."""
    try:
        return node.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        tail = log.read_text(errors="replace")[-4000:] if log.exists() else "(no log)"
        last = [f"{e.timestamp_ms} {e.name} {e.node} r{e.rank} round={e.round} step={e.step} "
                f"{json.dumps(e.metadata)[:160]}" for e in events(events_file)[-40:]]
        raise AssertionError(f"{log.stem} still runs after {timeout:.0f} s\n--- its log:\n"
                             f"{tail}\n--- the run's last events:\n" + "\n".join(last)) from None


def train_node(tree: ProcessLedger, endpoint: str, run_id: str, tmp: Path, name: str,
               nnodes: str, *script_args: str,
               env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """One ``elastic-rt launch`` node of ``elastic_train.py`` writing ``tmp``'s event log,
    log file (``<name>.log``) and final parameters (``params.pt``)."""
    args = launch_args(endpoint, run_id, nnodes, tmp / "events.jsonl", node_id=name)
    script = [TRAIN_SCRIPT, "--out", str(tmp / "params.pt"), *script_args]
    return tree.start([PYTHON, "-m", "elastic_rt.cli", *args, *script],
                      env=env or child_env(), log=str(tmp / f"{name}.log"))


def latest_step(events_file: Path) -> int:
    """The newest step any worker completed (0 before the first)."""
    return max((e.step or 0 for e in events(events_file) if e.name == "step.completed"),
               default=0)
