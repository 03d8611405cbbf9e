"""The main demo: an elastic training job survives a node kill, then grows again.

What it does, all on this machine:
  1. starts an embedded etcd (`elastic-rt etcd`),
  2. starts 3 nodes (`elastic-rt launch`, one worker each) running
     scripts/examples/elastic_train.py, which uses the elastic_rt library,
  3. SIGKILLs one node's whole process tree mid-training,
  4. starts a 4th node later, which is taken in at a step boundary,
  5. shows what happened: the recovery's phases with timings, world size over time,
     the checkpoints, and a picture of the run (timeline.png).

Run it with `bash scripts/dev.sh demo` (sets up .venv first).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic_rt.checkpoint import inspect as checkpoint_inspect  # noqa: E402
from elastic_rt.events import Event, read_events  # noqa: E402

PY = sys.executable
MODEL_WIDTH, MODEL_HIDDEN = 1024, 4096


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--kill-at", type=int, default=40, help="step at which a node is SIGKILLed")
    p.add_argument("--join-at", type=int, default=80, help="step at which a new node starts")
    p.add_argument("--out", default=None, help="folder for events, checkpoints, logs, picture")
    return p.parse_args()


class Demo:
    def __init__(self, out: Path, steps: int) -> None:
        self.out = out
        self.steps = steps
        self.events_file = out / "events.jsonl"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.endpoint = ""

    def start_etcd(self) -> None:
        proc = subprocess.Popen([PY, "-m", "elastic_rt.cli", "etcd"], stdout=subprocess.PIPE,
                                stderr=open(self.out / "etcd.log", "wb"), start_new_session=True)
        self.procs["etcd"] = proc
        assert proc.stdout is not None
        self.endpoint = proc.stdout.readline().decode().strip()  # etcd://127.0.0.1:PORT
        if not self.endpoint.startswith("etcd://"):
            raise SystemExit(f"etcd did not start; see {self.out / 'etcd.log'}")
        say(f"embedded etcd at {self.endpoint}")

    def start_node(self, name: str) -> None:
        command = [
            PY, "-m", "elastic_rt.cli", "launch",
            "--nnodes", "2:4", "--nproc-per-node", "1",
            "--rdzv-endpoint", self.endpoint, "--run-id", "demo", "--node-id", name,
            "--lease-ttl", "3", "--events-file", str(self.events_file),
            str(REPO / "scripts" / "examples" / "elastic_train.py"),
            "--steps", str(self.steps), "--step-time", "0.05",
            "--width", str(MODEL_WIDTH), "--hidden", str(MODEL_HIDDEN),
            "--checkpoint", f"file://{self.out / 'checkpoints'}", "--every", "25",
            "--out", str(self.out / "final_params.pt"),
        ]  # fmt: skip
        log = open(self.out / f"{name}.log", "wb")
        self.procs[name] = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True, env=dict(os.environ))
        say(f"started {name} (agent pid {self.procs[name].pid})")

    def events(self) -> list[Event]:
        return list(read_events(str(self.events_file)))

    def step(self) -> int:
        return max((e.step or 0 for e in self.events() if e.name == "step.completed"), default=0)

    def wait_for_step(self, step: int, timeout: float = 300) -> None:
        deadline, shown = time.monotonic() + timeout, -1
        while self.step() < step:
            if time.monotonic() > deadline:
                raise SystemExit(
                    f"no progress to step {step} within {timeout:.0f} s; see {self.out}"
                )
            current = self.step()
            if current // 10 != shown // 10:
                shown = current
                say(f"  training... step {current}, world size {self.world_size()}")
            time.sleep(0.2)

    def world_size(self) -> int:
        done = [e for e in self.events() if e.name == "step.completed"]
        return int(done[-1].metadata["world_size"]) if done else 0

    def kill(self, name: str) -> float:
        when = time.time()
        os.killpg(self.procs[name].pid, signal.SIGKILL)  # agent and its workers: a dead node
        say(f"SIGKILL {name} at step {self.step()}")
        return when

    def wait_finished(self, nodes: list[str], timeout: float = 300) -> dict[str, int]:
        deadline = time.monotonic() + timeout
        codes = {}
        for name in nodes:
            codes[name] = self.procs[name].wait(timeout=max(1.0, deadline - time.monotonic()))
        return codes

    def stop_all(self) -> None:
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGTERM if proc.poll() is None else 0)
            except (ProcessLookupError, PermissionError):
                pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def say(text: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {text}", flush=True)


def report(demo: Demo, killed_at: float) -> None:
    events = demo.events()
    print("\nWhat happened (from the JSON-lines events):")
    t0 = events[0].timestamp_ms
    interesting = {"node.joined", "round.formed", "node.lost", "groups.reformed", "state.restored",
                   "step.retried", "step.resumed", "checkpoint.committed", "job.finished"}
    for e in events:
        if e.name not in interesting or (e.source == "worker" and e.rank not in (0, None)):
            continue
        extra = {k: v for k, v in e.metadata.items() if k in ("world_size", "reason", "lost",
                 "duration_ms", "downtime_ms", "source", "name", "members")}
        who = (e.node or "") + (f"/rank{e.rank}" if e.rank is not None else "")
        print(f"  {(e.timestamp_ms - t0) / 1000:7.2f}s  {e.name:20s} {who:12s} round={e.round} "
              f"step={e.step} {json.dumps(extra)}")
    resumed = [e for e in events if e.name == "step.resumed" and e.timestamp_ms > killed_at * 1000]
    if resumed:
        first = min(resumed, key=lambda e: e.timestamp_ms)
        took = first.timestamp_ms / 1000 - killed_at
        print(f"\nKill -> survivors' next completed step: {took:.2f} s "
              f"(no worker restarted, 0 steps lost: resumed at step {first.step})")
    report_growth(events, "node-d")
    sizes: list[tuple[int | None, int]] = []
    for e in events:
        if e.name == "step.completed" and (not sizes or sizes[-1][1] != e.metadata["world_size"]):
            sizes.append((e.step, e.metadata["world_size"]))
    print("World size over the run: " + " -> ".join(f"{w} (from step {s})" for s, w in sizes))
    print("\nCheckpoints (elastic-rt checkpoint ls):")
    for line in checkpoint_inspect.ls(f"file://{demo.out / 'checkpoints'}"):
        print("  " + line)


def report_growth(events: list, joiner: str) -> None:
    """How long the survivors paused to admit ``joiner``: the longest gap between two
    of rank 0's completed steps from the joiner's start to the end of the run."""
    joined = [e.timestamp_ms for e in events if e.name == "node.joined" and e.node == joiner]
    admitted = [e for e in events if e.name == "round.formed" and e.source == "agent"
                and joiner in e.metadata.get("members", ())]
    if not joined or not admitted:
        return
    steps = [e for e in events if e.name == "step.completed" and e.rank == 0
             and e.timestamp_ms >= joined[0]]
    gaps = [(b.timestamp_ms - a.timestamp_ms, b.step) for a, b in zip(steps, steps[1:])]
    if not gaps:
        return
    pause_ms, at_step = max(gaps)
    print(f"{joiner} joined -> admitted: {(admitted[0].timestamp_ms - joined[0]) / 1000:.2f} s "
          f"(its workers started before it joined; the survivors kept training); survivors' "
          f"longest pause while growing: {pause_ms / 1000:.2f} s (before step {at_step})")


def main() -> None:
    args = parse_args()
    out = Path(args.out or REPO / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    demo = Demo(out, args.steps)
    try:
        demo.start_etcd()
        params = MODEL_WIDTH * MODEL_HIDDEN + 2 * MODEL_HIDDEN + 1
        say(f"model: {params / 1e6:.1f}M parameters, {params * 16 / 2**20:.0f} MB of state per "
            "replica (weights, gradients and AdamW's two moments)")
        for name in ("node-a", "node-b", "node-c"):
            demo.start_node(name)
        demo.wait_for_step(args.kill_at)
        killed_at = demo.kill("node-c")
        demo.wait_for_step(args.join_at)
        demo.start_node("node-d")
        codes = demo.wait_finished(["node-a", "node-b", "node-d"])
        say(f"job finished; agents' exit codes: {codes} (node-c: {demo.procs['node-c'].wait()})")
        report(demo, killed_at)
        picture = out / "timeline.png"
        subprocess.run([PY, "-m", "elastic_rt.cli", "timeline", str(demo.events_file),
                        "-o", str(picture)], check=False, capture_output=True)
        print(f"\nA picture of the run: {picture}\nEvents, logs and checkpoints: {out}")
        if any(codes.values()):
            raise SystemExit(1)
    finally:
        demo.stop_all()


if __name__ == "__main__":
    main()
