"""GPU readiness check: what one GPU allows, one PASS/FAIL line per check.

    python scripts/device_check.py            # on a machine with CUDA; exit 1 on any FAIL

The checks, all on GPU 0:
  1. checkpoint: a CUDA model's state is saved asynchronously (staged through pinned
     host memory while the model changes on the GPU), then loaded into another CUDA
     model: same values, on the GPU.
  2. nccl-abort: an NCCL group of one rank carries a CUDA all-reduce, is aborted
     (``abort_groups``, as on a new round's notice), destroyed and re-created.
  3. node-kill: two nodes (``elastic-rt launch``, embedded etcd, one worker each) train
     a CUDA model on GPU 0 over gloo (NCCL refuses two ranks on one GPU); one node is
     SIGKILLed; the survivor recovers in place (its worker is not restarted), trains
     every step once, and ends with the parameters of an uninterrupted one-node run.

Without CUDA it prints one line and exits 0 ("skipped"). ``--cpu`` runs checks 1 and 3
on the CPU instead, to test this script on a machine without a GPU (check 2 needs one).
About a minute on an idle machine with a GPU.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from elastic_rt.checkpoint import Checkpointer  # noqa: E402
from elastic_rt.checkpoint.async_save import Stager  # noqa: E402
from elastic_rt.config import BACKEND_ENV  # noqa: E402
from elastic_rt.etcd_server import EtcdServer  # noqa: E402
from elastic_rt.events import Event, read_events  # noqa: E402
from elastic_rt.harness import PYTHON, ProcessLedger, child_env, wait_until  # noqa: E402
from elastic_rt.layout import Layout  # noqa: E402

SCRIPT = str(REPO / "scripts" / "examples" / "elastic_train.py")
STEPS = 200
STEP_TIME_S = "0.05"


class CheckFailed(Exception):
    """A check's outcome was wrong (not a crash of the check itself)."""


def expect(condition: bool, problem: str) -> None:
    if not condition:
        raise CheckFailed(problem)


# 1. checkpoint ------------------------------------------------------------------------
def check_checkpoint(device: torch.device, out: Path) -> str:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_state_dict, set_state_dict)

    from elastic_rt.worker.trainers.runtime_step import initialize_optimizer_state

    flat = StateDictOptions(flatten_optimizer_state_dict=True)

    def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh(),
                                    torch.nn.Linear(512, 1)).to(device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, optimizer = build(0)
    model(torch.randn(64, 512, device=device)).square().mean().backward()
    optimizer.step()
    want = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}

    staged = Stager().stage(dict(model.state_dict()))
    staged.wait_copied()
    pinned = all(t.is_pinned() for t in staged.tensors.values())
    expect(pinned == (device.type == "cuda"), f"staging buffers pinned={pinned} for {device}")

    ckpt = Checkpointer(f"file://{out / 'checkpoints'}", async_save=True)
    try:
        model_state, optim_state = get_state_dict(model, optimizer, options=flat)
        ckpt.save(1, {"model": model_state, "optimizer": optim_state})
        with torch.no_grad():  # the next step changes the model while the write runs
            for p in model.parameters():
                p.add_(1.0)
        expect(ckpt.wait() is not None, "the save did not commit")

        fresh, fresh_optimizer = build(1)
        initialize_optimizer_state(fresh_optimizer)
        model_state, optim_state = get_state_dict(fresh, fresh_optimizer, options=flat)
        ckpt.load({"model": model_state, "optimizer": optim_state})  # in place
        set_state_dict(fresh, fresh_optimizer, model_state_dict=model_state,
                       optim_state_dict=optim_state, options=flat)
    finally:
        ckpt.close()
    for key, value in fresh.state_dict().items():
        expect(value.device == device, f"{key} loaded to {value.device}, not {device}")
        expect(torch.equal(value.cpu(), want[key]), f"{key} differs from the saved value")
    moments = [s["exp_avg"] for s in fresh_optimizer.state.values()]
    expect(bool(moments) and all(m.device == device for m in moments),
           "the optimizer's moments are not on the model's device")
    return f"{len(want)} tensors, pinned staging: {pinned}"


# 2. nccl-abort ------------------------------------------------------------------------
def check_nccl_abort(device: torch.device, out: Path) -> str:
    import torch.distributed as dist

    from elastic_rt.accelerator import MIXED
    from elastic_rt.process_groups import abort_groups, destroy_groups, init_groups

    store = dist.HashStore()
    sums, aborted = [], 0
    for round_ in (0, 1):
        groups = init_groups(store, rank=0, world_size=1, layout=Layout(dp=1),
                             prefix=f"/device_check/round-{round_}/",
                             timeout=timedelta(seconds=60), backend=MIXED)
        try:
            value = torch.full((4,), float(round_ + 1), device=device)
            dist.all_reduce(value, group=groups.dp)  # opens the NCCL communicator
            torch.cuda.synchronize(device)
            sums.append(float(value.sum()))
            if round_ == 0:
                aborted = abort_groups()
        finally:
            destroy_groups(groups)
    expect(aborted >= 1, "abort_groups found no NCCL communicator to abort")
    expect(sums == [4.0, 8.0], f"all-reduce results {sums}, expected [4.0, 8.0]")
    return f"aborted {aborted} groups, re-created and reduced again"


# 3. node-kill -------------------------------------------------------------------------
def check_node_kill(device: torch.device, out: Path) -> str:
    with EtcdServer() as etcd:  # stopped after every node is gone
        ledger = ProcessLedger(sample_every=0.5)
        try:
            return _node_kill(ledger, etcd.endpoint, device, out)
        finally:
            ledger.close()


def _node_kill(ledger: ProcessLedger, endpoint: str, device: torch.device, out: Path) -> str:
    env = child_env(**{BACKEND_ENV: "gloo"})
    if device.type == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # --cpu: the workers must not find a GPU either

    def node(name: str, run_id: str, nnodes: str) -> tuple[Path, subprocess.Popen[bytes]]:
        folder = out / run_id
        folder.mkdir(exist_ok=True)
        command = [
            PYTHON, "-m", "elastic_rt.cli", "launch", "--nnodes", nnodes,
            "--nproc-per-node", "1", "--rdzv-endpoint", f"etcd://{endpoint}",
            "--run-id", run_id, "--node-id", name, "--lease-ttl", "3", "--last-call", "0.5",
            "--events-file", str(folder / "events.jsonl"),
            SCRIPT, "--steps", str(STEPS), "--step-time", STEP_TIME_S, "--device", "worker",
            "--out", str(folder / "params.pt"),
        ]  # fmt: skip
        return folder, ledger.start(command, env=env, log=folder / f"{name}.log")

    ref_dir, reference = node("solo", "reference", "1")
    job_dir, survivor = node("a", "job", "1:2")
    _, victim = node("b", "job", "1:2")

    def log() -> list[Event]:
        return list(read_events(str(job_dir / "events.jsonl")))

    def steps_at(world: int) -> list[int]:
        return [e.step or 0 for e in log()
                if e.name == "step.completed" and e.metadata.get("world_size") == world]

    # 10 events: 5 steps of each node, both in the round of 2
    wait_until(lambda: len(steps_at(2)) >= 10, 90, "5 steps of both nodes together")
    ledger.signal_tree(victim.pid, signal.SIGKILL)  # the node: agent and worker at once
    killed_at = max(steps_at(2))
    # Deadlines keep a failing run within a few minutes; a passing one takes well under.
    for name, proc, folder, limit in (("a", survivor, job_dir, 90),
                                      ("solo", reference, ref_dir, 30)):
        code = proc.wait(timeout=limit)
        tail = (folder / f"{name}.log").read_text()[-2000:]
        expect(code == 0, f"node {name} exited {code}; its log ends:\n{tail}")

    events = log()
    restarted = [e for e in events if e.name == "worker.restarted" and e.node == "a"]
    expect(not restarted, "the survivor's worker was restarted, not recovered in place")
    done = sorted(e.step for e in events if e.name == "step.completed" and e.node == "a"
                  and e.step is not None)
    expect(done == list(range(1, STEPS + 1)), "the survivor skipped a step or did one twice")
    expect(any(s > killed_at for s in steps_at(1)), "no step after the kill at world size 1")

    got, want = torch.load(job_dir / "params.pt"), torch.load(ref_dir / "params.pt")
    for key, value in got.items():
        expect(value.device.type == device.type, f"{key} trained on {value.device}")
        torch.testing.assert_close(value.cpu(), want[key].cpu(), atol=1e-4, rtol=0)
    resumed = [e.metadata.get("downtime_ms") for e in events if e.name == "step.resumed"]
    return f"killed at step {killed_at}; survivor resumed after {resumed} ms; params match"


# running ------------------------------------------------------------------------------
Check = Callable[[torch.device, Path], str]


def run_checks(checks: list[tuple[str, Check]], device: torch.device, out: Path) -> int:
    """Run each check, print PASS/FAIL with its time; return how many failed."""
    failed = 0
    for name, check in checks:
        began = time.monotonic()
        try:
            detail = check(device, out)
        except Exception as exc:  # a check's crash is its FAIL; the next check still runs
            failed += 1
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            print(f"FAIL  {name} ({time.monotonic() - began:.1f} s): {first}", flush=True)
            if not isinstance(exc, CheckFailed):
                traceback.print_exc()
        else:
            print(f"PASS  {name} ({time.monotonic() - began:.1f} s): {detail}", flush=True)
    return failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true",
                        help="run the checks that do not need a GPU on the CPU")
    parser.add_argument("--out", default=None, help="keep logs and files here (default: temp)")
    args = parser.parse_args()
    if not (args.cpu or torch.cuda.is_available()):
        print(f"device_check: skipped: CUDA is not available (torch {torch.__version__})")
        return 0
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    checks: list[tuple[str, Check]] = [("checkpoint", check_checkpoint)]
    if device.type == "cuda":
        torch.cuda.set_device(device)
        checks.append(("nccl-abort", check_nccl_abort))
    checks.append(("node-kill", check_node_kill))
    print(f"device_check on {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        out = Path(args.out) if args.out else Path(tmp)
        out.mkdir(parents=True, exist_ok=True)
        failed = run_checks(checks, device, out)
    print(f"device_check: {len(checks) - failed} passed, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
