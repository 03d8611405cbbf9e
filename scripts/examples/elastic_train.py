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
from elastic_rt.harness.pace import SimulatedCompute


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


def make_model(width: int, hidden: int, depth: int = 1) -> torch.nn.Module:
    """The same initial model on every rank (and in the tests' one-process reference).

    ``depth`` hidden layers: a large model is many layers of a few million parameters each,
    not one layer of a hundred million, and the allocator treats the two differently (an
    optimizer's temporaries for a 400 MB tensor are mapped and unmapped at every step).
    """
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = [torch.nn.Linear(width, hidden), torch.nn.Tanh()]
    for _ in range(depth - 1):
        layers += [torch.nn.Linear(hidden, hidden), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, 1))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--width", type=int, default=32, help="input features")
    p.add_argument("--hidden", type=int, default=64, help="hidden units (the model's size)")
    p.add_argument("--depth", type=int, default=1, help="hidden layers of --hidden units")
    p.add_argument("--global-batch", type=int, default=12)
    p.add_argument("--step-time", type=float, default=0.0, help="simulated extra compute per step")
    p.add_argument("--step-time-until", default=None, metavar="FILE",
                   help="simulate compute only until FILE exists (tests hold a slow pace so)")
    p.add_argument("--checkpoint", default=None, help="URL for checkpoints (optional)")
    p.add_argument("--every", type=int, default=20)
    p.add_argument("--out", default=None, help="rank 0 writes the final parameters here")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--micro-batch", type=int, default=None, help="samples per forward/backward")
    p.add_argument("--amp", choices=["bf16", "fp16"], default=None, help="autocast dtype")
    p.add_argument("--clip", type=float, default=None, help="clip gradients to this norm")
    p.add_argument("--schedule", action="store_true", help="a step-decay LR schedule")
    p.add_argument("--fail-at-step", type=int, default=None,
                   help="rank 0 raises a user error (a shape mismatch) at this step")
    p.add_argument("--stall-at-step", type=int, default=None,
                   help="rank 1 stalls in its step here for --stall-seconds (a hang report)")
    p.add_argument("--stall-seconds", type=float, default=3.0)
    p.add_argument("--device", choices=["cpu", "worker"], default="cpu",
                   help="where the model is built: the CPU, or elastic_rt.worker_device() "
                        "(cuda:LOCAL_RANK when CUDA is present)")
    p.add_argument("--max-shard", type=int, default=1,
                   help="shard the state over up to this many ranks (FSDP2); 1: replicas")
    p.add_argument("--hook-count", default=None,
                   help="rank 0 writes how often its optimizer's step hooks ran here")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="of the model and the data; float64 keeps a long run's parameters "
                        "equal to a 1-rank run's at any world size (float32 sums in another "
                        "order drift apart by ~1e-5 in 3,000 steps, faults or not)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    if args.out and args.max_shard > 1:
        raise SystemExit("--out writes rank 0's whole model: use it without --max-shard")
    torch.set_default_dtype(getattr(torch, args.dtype))
    hook_calls: list[int] = []
    compute = SimulatedCompute(args.step_time, args.step_time_until)

    def build(layout: ert.Layout) -> ert.TrainState:
        """Model and optimizer; called once per worker (survivors keep theirs)."""
        model = make_model(args.width, args.hidden, args.depth)
        if args.device == "worker":
            model = model.to(ert.worker_device())  # before the optimizer takes its parameters
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        optimizer.register_step_post_hook(lambda *_: hook_calls.append(1))
        # the runtime steps the scheduler once per optimizer step and restores its state
        scheduler = (torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.8)
                     if args.schedule else None)
        return ert.TrainState(model=model, optimizer=optimizer, scheduler=scheduler)

    def train_step(state: ert.TrainState, batch) -> torch.Tensor:
        x, y = batch
        compute()
        ctx = ert.context()
        if ctx.step == args.fail_at_step and ctx.rank == 0:
            x = x[:, :-1]  # a user bug: the model's first layer gets the wrong width
        if ctx.step == args.stall_at_step and ctx.rank == 1:
            time.sleep(args.stall_seconds)  # the others wait for it in the gradient all-reduce
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
        micro_batch_size=args.micro_batch,
        loader=ert.LoaderOptions(num_workers=args.num_workers),
        autocast_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.amp or ""),
        clip_grad_norm=args.clip,
        limits=ert.ModelLimits(max_shard=args.max_shard),
    )
    # rank 0 of the last round writes the result (after run, context() is the last round's)
    if args.out and ert.context().rank == 0:
        torch.save({k: v.detach().clone() for k, v in state.model.state_dict().items()}, args.out)
        print(json.dumps({"final_loss_params": args.out}))
    if args.hook_count and ert.context().rank == 0:
        with open(args.hook_count, "w") as f:
            f.write(str(len(hook_calls)))


if __name__ == "__main__":
    main()
