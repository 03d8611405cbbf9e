"""A complete elastic training script: the user writes `build` and `train_step`, nothing
about failures. Run it with

    elastic-rt launch --nnodes 2:3 --nproc-per-node 1 scripts/examples/elastic_train.py

When a node dies, the surviving workers stay alive: they re-form their process groups,
take the state of the most advanced survivor, re-split the data and retry the step.
The result is the same as a run without failures (the global batch never changes).
"""

import argparse
import json
import time

import torch

import elastic_rt as ert


class Regression(torch.utils.data.Dataset):
    """y = a noisy linear function of x: small, deterministic, fast."""

    def __init__(self, n: int, width: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, width, generator=g)
        true_w = torch.randn(width, 1, generator=g)
        self.y = self.x @ true_w + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=32)
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--step-time", type=float, default=0.0, help="simulated extra compute per step")
    p.add_argument("--checkpoint", default=None, help="URL for checkpoints (optional)")
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--out", default=None, help="rank 0 writes the final parameters here")
    return p.parse_args()


def main() -> None:
    args = parse_args()

    def build(layout: ert.Layout) -> ert.TrainState:
        """Model and optimizer; called once per worker (survivors keep theirs)."""
        torch.manual_seed(0)  # every rank builds the same initial model
        model = torch.nn.Sequential(
            torch.nn.Linear(args.width, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
        )
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return ert.TrainState(model=model, optimizer=optimizer)

    def train_step(state: ert.TrainState, batch) -> torch.Tensor:
        x, y = batch
        if args.step_time:
            time.sleep(args.step_time)
        return torch.nn.functional.mse_loss(state.model(x), y)

    checkpoint = (ert.Checkpointer(args.checkpoint, every_steps=args.every)
                  if args.checkpoint else None)
    state = ert.run(
        build=build,
        step=train_step,
        dataset=Regression(n=args.global_batch * 50, width=args.width),
        global_batch_size=args.global_batch,
        max_steps=args.steps,
        checkpoint=checkpoint,
    )
    # rank 0 of the last round writes the result (after run, context() is the last round's)
    if args.out and ert.context().rank == 0:
        torch.save({k: v.detach().clone() for k, v in state.model.state_dict().items()}, args.out)
        print(json.dumps({"final_loss_params": args.out}))


if __name__ == "__main__":
    main()
