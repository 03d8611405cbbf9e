"""A plain torchrun DDP script: no elastic-rt imports at all.

It runs the same under ``torchrun`` and ``elastic-rt launch`` (restart mode). It
saves a checkpoint with ``torch.save`` every ``--ckpt-every`` steps and resumes
from it at start, which is all a script needs to survive node loss in restart mode.
Each completed step appends ``{"step", "rank", "world_size", "time"}`` to
``--progress`` so benchmarks and tests can see progress without parsing logs.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--ckpt", default="/tmp/torchrun_ddp.pt")
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--step-time", type=float, default=0.05,
                   help="extra seconds per step (simulated compute)")
    p.add_argument("--progress", default=None)
    p.add_argument("--width", type=int, default=64)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.Tanh(),
                                    torch.nn.Linear(args.width, 1)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    if os.path.exists(args.ckpt):
        # this is how torchrun scripts resume: everyone loads the last saved state
        state = torch.load(args.ckpt, weights_only=True)
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"])
    for step in range(start + 1, args.steps + 1):
        generator = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(16, args.width, generator=generator)
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        time.sleep(args.step_time)
        # The step is reported before it is checkpointed, so a checkpoint never names a
        # step the progress file has not seen (a worker stopped between the two).
        if args.progress:
            with open(args.progress, "a") as f:
                f.write(json.dumps({"step": step, "rank": rank, "world_size": world,
                                    "time": time.time(), "pid": os.getpid()}) + "\n")
        if rank == 0 and step % args.ckpt_every == 0:
            tmp = args.ckpt + ".tmp"
            torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                        "step": step}, tmp)
            os.replace(tmp, args.ckpt)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
