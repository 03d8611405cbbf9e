"""A plain Hugging Face Accelerate loop (CPU/gloo) that survives node loss in restart mode:

    elastic-rt launch --nnodes 2:3 --nproc-per-node 1 scripts/examples/accelerate_loop.py CKPT_DIR

No elastic-rt imports, and no setting tied to the world size: Accelerate reads torchrun's
environment each start. What makes it elastic is the checkpoint recipe:

- `accelerator.save_state(dir)` every `--ckpt-every` steps writes the model, the
  optimizer, each process's RNG state and every object passed to
  `register_for_checkpointing` (here the step counter) into a new folder;
- only once every process has written its part does the main process point `latest`
  at that folder (written to a temporary name, then renamed), so a node killed mid-save
  never leaves a half-written checkpoint behind the pointer;
- at start, `accelerator.load_state(...)` on the folder `latest` names, if any.

After a restart at another world size the data loader starts a fresh pass over the
data; for exactly-once samples across world sizes use `elastic_rt.run` instead.
With `--progress PATH`, each worker appends a JSON line when it starts (`"start"`: the
step it resumed from) and after each step (`"step"`), with its rank and world size.
"""

import argparse
import json
import os
import shutil
import time

import torch
from accelerate import Accelerator
from accelerate.utils import set_seed


class Step:
    """The step counter, saved and restored by Accelerate with the rest of the state."""

    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict[str, int]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.value = state["value"]


def save(accelerator: Accelerator, ckpt_dir: str, step: int) -> None:
    folder = f"step-{step:06d}"
    accelerator.save_state(os.path.join(ckpt_dir, folder))
    accelerator.wait_for_everyone()  # every rank's random state is in the folder
    if accelerator.is_main_process:
        previous = latest(ckpt_dir)
        pointer = os.path.join(ckpt_dir, "latest")
        with open(pointer + ".tmp", "w") as f:
            f.write(folder)
        os.replace(pointer + ".tmp", pointer)
        if previous is not None:
            shutil.rmtree(os.path.join(ckpt_dir, previous))


def latest(ckpt_dir: str) -> str | None:
    pointer = os.path.join(ckpt_dir, "latest")
    if not os.path.exists(pointer):
        return None
    with open(pointer) as f:
        return f.read()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt_dir")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--progress", default=None)
    args = p.parse_args()

    accelerator = Accelerator(cpu=True)
    set_seed(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    step = Step()
    accelerator.register_for_checkpointing(step)

    found = latest(args.ckpt_dir)
    if found is not None:
        accelerator.load_state(os.path.join(args.ckpt_dir, found))  # restores step too
    report(args.progress, accelerator, start=step.value)
    while step.value < args.steps:
        for x, y in loader:
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            time.sleep(args.step_time)  # simulated compute, so a node can be killed mid-run
            step.value += 1
            report(args.progress, accelerator, step=step.value)
            if step.value % args.ckpt_every == 0:
                save(accelerator, args.ckpt_dir, step.value)
            if step.value == args.steps:
                break
    accelerator.end_training()


def report(path: str | None, accelerator: Accelerator, **row: int) -> None:
    """One JSON line per start and per step, for tests and benchmarks (not needed to train)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({**row, "rank": accelerator.process_index,
                                "world_size": accelerator.num_processes}) + "\n")


if __name__ == "__main__":
    main()
