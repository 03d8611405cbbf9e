"""A plain Lightning script (`strategy="ddp"`, CPU/gloo) that survives node loss in restart mode:

    elastic-rt launch --nnodes 2:3 --nproc-per-node 1 scripts/examples/lightning_ddp.py CKPT_DIR

No elastic-rt imports. Two things make it elastic:

- `devices` and `num_nodes` come from the launcher's environment, not constants:
  Lightning checks `devices * num_nodes == WORLD_SIZE`, so a hard-coded `num_nodes`
  fails with a ValueError as soon as the job restarts at another world size.
- `ModelCheckpoint(save_last=True)` plus `fit(..., ckpt_path="last")`: every start
  resumes from the last checkpoint, if there is one (the first start has none).

With `--progress PATH`, each worker appends a JSON line when it starts (`"start"`: the
step it resumed from) and after each step (`"step"`), with its rank and world size.
"""

import argparse
import json
import os
import time

import lightning as L
import torch


class Regression(L.LightningModule):
    def __init__(self, width: int, step_time: float) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh(),
                                       torch.nn.Linear(width, 1))
        self.step_time = step_time

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        time.sleep(self.step_time)  # simulated compute, so a node can be killed mid-run
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Progress(L.Callback):
    """One JSON line per start and per step, for tests and benchmarks (not needed to train)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _write(self, trainer: L.Trainer, **row: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({**row, "rank": trainer.global_rank,
                                "world_size": trainer.world_size}) + "\n")

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self._write(trainer, start=trainer.global_step)  # already restored from the checkpoint

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        self._write(trainer, step=trainer.global_step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("ckpt_dir")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--ckpt-every", type=int, default=2)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--progress", default=None)
    args = p.parse_args()

    L.seed_everything(0)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(256, 16, generator=g)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True)

    callbacks: list[L.Callback] = [L.pytorch.callbacks.ModelCheckpoint(
        dirpath=args.ckpt_dir, save_last=True, save_top_k=0, every_n_train_steps=args.ckpt_every)]
    if args.progress:
        callbacks.append(Progress(args.progress))
    trainer = L.Trainer(
        accelerator="cpu", strategy="ddp",
        # the two lines: the world size may differ after every restart
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        num_nodes=int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"]),
        max_steps=args.steps, callbacks=callbacks, default_root_dir=args.ckpt_dir,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    trainer.fit(Regression(16, args.step_time), loader, ckpt_path="last")


if __name__ == "__main__":
    main()
