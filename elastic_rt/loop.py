"""The elastic loop: the user owns the step, the runtime owns recovery.

``run(build=..., step=..., dataset=..., global_batch_size=..., max_steps=...)``
reads top to bottom like a plain training loop; each recovery phase is a named
call::

    round = first round the agent started us in
    loop:
        groups = reform_groups(round)          # store + torch process groups
        restore()                              # broadcast from a survivor, else checkpoint
        resplit()                              # sampler over the new dp ranks
        train until done, a failed collective, or a newer round
        round = wait_for_round(after=round)    # agents decide membership

A failed collective (a peer died) never reaches the user's code: the step is
retried in the next round, from the state of the most advanced survivor, with the
same global batch. Only errors the runtime cannot recover from are raised: the
same step failing ``max_failed_steps`` times, or no new round in time.

Gradients are reduced by the runtime (one flat all-reduce per step over the
data-parallel group, after local accumulation), which keeps the global batch
size fixed and the gradient exactly the global-batch mean whatever the split.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.utils.data import default_collate

from elastic_rt.checkpoint import Checkpointer
from elastic_rt.config import COLLECTIVE_TIMEOUT_ENV, WorkerEnv
from elastic_rt.worker_context import Context, set_context
from elastic_rt.errors import (
    CheckpointError,
    CheckpointNotFoundError,
    ConfigError,
    ElasticError,
    FencedOutError,
)
from elastic_rt.events import EventSink
from elastic_rt.layout import Layout, ModelLimits, plan_layout
from elastic_rt.membership import RoundFollower
from elastic_rt.pg_store import open_round_store
from elastic_rt.process_groups import Groups, destroy_groups, init_groups
from elastic_rt.rendezvous.checkpoint_pointer import FencedPointer
from elastic_rt.rendezvous.rounds import Round
from elastic_rt.sampler import ElasticSampler
from elastic_rt.state_sync import broadcast_state, pick_source
from elastic_rt.train_state import TrainState

logger = logging.getLogger(__name__)

BuildFn = Callable[[Layout], TrainState]
StepFn = Callable[[TrainState, Any], torch.Tensor]


class _Reform(Exception):
    """A newer round exists: leave the current one at this step boundary."""


@dataclass
class _Progress:
    step: int = -1
    """Committed steps; -1 until this rank holds state."""
    failed_attempts: int = 0
    failed_at: float | None = None
    reform_started: float = 0.0
    timings: dict[str, float] = field(default_factory=dict)


def run(
    *,
    build: BuildFn,
    step: StepFn,
    dataset: Sequence[Any],
    global_batch_size: int,
    max_steps: int,
    checkpoint: Checkpointer | None = None,
    seed: int = 0,
    micro_batch_size: int | None = None,
    limits: ModelLimits = ModelLimits(),
    max_failed_steps: int = 3,
    reform_timeout: timedelta = timedelta(seconds=120),
    collate: Callable[[list[Any]], Any] = default_collate,
) -> TrainState:
    """Train ``max_steps`` steps elastically; returns this rank's final state.

    Args:
        build: makes model and optimizer for a layout; called on a rank's first
            round only (survivors keep theirs).
        step: returns the mean loss over the batch it is given; the runtime does
            backward, gradient reduction and the optimizer step.
        dataset: a map-style dataset (``len`` and indexing).
        global_batch_size: samples per optimizer step over all ranks; fixed.
        checkpoint: saves every ``every_steps`` and restores when no replica survives.
        micro_batch_size: the most samples per forward/backward (accumulation).
        max_failed_steps: the same step failing this often is raised, not retried.
        reform_timeout: the most to wait for a round that includes this node.

    Raises:
        ElasticError: recovery is impossible (budget spent, no round in time).
        ConfigError: bad arguments (one clear line).
    """
    if max_steps < 0 or global_batch_size < 1:
        raise ConfigError(
            f"max_steps={max_steps}, global_batch_size={global_batch_size}",
            "Pass max_steps >= 0 and global_batch_size >= 1.",
        )
    loop = _ElasticLoop(
        build=build, step=step, dataset=dataset, checkpoint=checkpoint, limits=limits,
        sampler=ElasticSampler(len(dataset), global_batch_size=global_batch_size, seed=seed,
                               micro_batch_size=micro_batch_size),
        max_failed_steps=max_failed_steps, reform_timeout=reform_timeout, collate=collate,
        seed=seed,
    )  # fmt: skip
    return loop.run(max_steps)


class _ElasticLoop:
    def __init__(self, *, build: BuildFn, step: StepFn, dataset: Sequence[Any],
                 checkpoint: Checkpointer | None, limits: ModelLimits, sampler: ElasticSampler,
                 max_failed_steps: int, reform_timeout: timedelta,
                 collate: Callable[[list[Any]], Any], seed: int) -> None:
        self.build, self.step_fn, self.dataset = build, step, dataset
        self.checkpoint, self.limits, self.sampler = checkpoint, limits, sampler
        self.max_failed_steps, self.reform_timeout = max_failed_steps, reform_timeout
        self.collate, self.seed = collate, seed
        self.env = WorkerEnv.from_env()
        self.events = EventSink(self.env.events_file, source="worker", run_id=self.env.run_id,
                                node=self.env.node_id, rank=self.env.rank)
        self.follower = RoundFollower(self.env) if self.env.is_elastic else None
        self.collective_timeout = _collective_timeout(self.env)
        self.state: TrainState | None = None
        self.groups: Groups | None = None
        self.ctx: Context | None = None
        self.store: dist.Store | None = None
        self.progress = _Progress()
        if checkpoint is not None and self.follower is not None:
            checkpoint.bind(
                pointer=FencedPointer(self.follower.registry, checkpoint.url, self._token),
                events=self.events,
            )

    def _token(self) -> int:
        return self.ctx.token if self.ctx else self.env.token

    # the loop -------------------------------------------------------------------
    def run(self, max_steps: int) -> TrainState:
        round_ = self.follower.current() if self.follower else None
        try:
            while True:
                try:
                    self.reform_groups(round_)
                    self.restore()
                    self.resplit()
                    self.train(max_steps)
                    break
                except _Reform:
                    logger.info("newer round pending; re-forming at step %d", self.progress.step)
                except (RuntimeError, dist.DistError) as exc:
                    self.on_failure(round_, exc)
                if self.follower is None:
                    raise ElasticError("a collective failed outside elastic-rt launch; cannot recover")
                round_ = self.wait_for_round(round_)
            self._finish_checkpoint()
        finally:
            self.shutdown()
        assert self.state is not None
        return self.state

    def train(self, max_steps: int) -> None:
        while self.progress.step < max_steps:
            if self.follower and self.ctx and self.follower.has_newer_round(self.ctx.round):
                raise _Reform()
            loss = self.train_step()
            self.sampler.advance()
            self.progress.step += 1
            self.progress.failed_attempts = 0
            self._after_step(loss)

    # recovery phases --------------------------------------------------------------
    def reform_groups(self, round_: Round | None) -> None:
        began = time.monotonic()
        destroy_groups(self.groups)
        self.groups = None
        rank, world, token, number = self._place(round_)
        layout = plan_layout(world, self.limits)
        address = (
            self.follower.store_address(round_, self.reform_timeout)
            if self.follower and round_ and round_.number != self.env.round
            else (self.env.master_addr, self.env.master_port)
        )
        self.store = None  # drop the previous round's store (its server closes with it)
        self.store = open_round_store(address, is_host=rank == 0, world_size=world,
                                      timeout=self.reform_timeout)
        prefix = f"/elastic_rt/{self.env.run_id}/round-{number}/"
        self.groups = init_groups(self.store, rank=rank, world_size=world, layout=layout,
                                  prefix=prefix, timeout=self.collective_timeout)
        self.ctx = Context(rank=rank, world_size=world, local_rank=self.env.local_rank,
                           node_id=self.env.node_id, round=number, token=token, layout=layout,
                           groups=self.groups)
        set_context(self.ctx)
        if self.follower and round_:
            self.follower.acknowledge(round_)
        self._phase("groups.reformed", began, world_size=world, layout=str(layout))

    def restore(self) -> None:
        began = time.monotonic()
        assert self.groups is not None and self.ctx is not None
        if self.state is None:
            self.state = self.build(self.ctx.layout)
        src, best = pick_source(self.progress.step, self.groups.world)
        if best < 0:
            self._first_restore()
            self._phase("state.restored", began, source="checkpoint-or-init")
            return
        payload = {
            "train": self.state.state_dict(),
            "sampler": self.sampler.state_dict(),
            "step": self.progress.step,
        }
        payload = broadcast_state(payload, src, self.groups.world)
        self.state.load_state_dict(payload["train"])
        self.sampler.load_state_dict(payload["sampler"])
        self.progress.step = int(payload["step"])
        self._phase("state.restored", began, source=f"rank {src}")

    def _first_restore(self) -> None:
        """No rank holds state: the newest committed checkpoint, else rank 0's init."""
        assert self.state is not None and self.groups is not None
        if self.checkpoint is not None:
            state = self._checkpoint_state()
            try:
                info = self.checkpoint.load(state, process_group=self.groups.world)
            except CheckpointNotFoundError:
                info = None
            if info is not None:
                self._load_checkpoint_state(state)
                self.sampler.load_state_dict(info.extra["sampler"])
                self.state.extras = dict(info.extra.get("extras", {}))
                self.progress.step = int(info.extra["step"])
                return
        synced = broadcast_state(self.state.model.state_dict(), 0, self.groups.world)
        self.state.model.load_state_dict(synced)
        self.progress.step = 0

    def resplit(self) -> None:
        assert self.ctx is not None
        self.sampler.set_world(self.ctx.dp_rank, self.ctx.dp_size)

    def on_failure(self, round_: Round | None, exc: BaseException) -> None:
        self.progress.failed_attempts += 1
        self.progress.failed_at = time.monotonic()
        logger.warning("step %d failed in round %s: %s", self.progress.step + 1,
                       round_.number if round_ else "-", str(exc).splitlines()[0] if str(exc) else exc)
        self.events.emit("step.retried", round=round_.number if round_ else None,
                         step=self.progress.step + 1, error=type(exc).__name__,
                         attempt=self.progress.failed_attempts)
        if self.progress.failed_attempts >= self.max_failed_steps:
            raise ElasticError(
                f"step {self.progress.step + 1} failed {self.progress.failed_attempts} times"
            ) from exc
        if self.follower and round_:
            self.follower.report_failure(round_)

    def wait_for_round(self, round_: Round | None) -> Round:
        assert self.follower is not None and round_ is not None
        began = time.monotonic()
        self.progress.reform_started = self.progress.failed_at or began
        new_round = self.follower.wait_for_round(round_.number, self.reform_timeout)
        self._phase("round.formed", began, world_size=new_round.world_size, round_number=new_round.number)
        return new_round

    # one training step ------------------------------------------------------------
    def train_step(self) -> float:
        assert self.state is not None and self.groups is not None
        model, optimizer = self.state.model, self.state.optimizer
        # Seeded per step, not per process: a retried or re-split step draws the same numbers.
        torch.manual_seed(self.seed * 1_000_003 + self.progress.step + 1)
        optimizer.zero_grad(set_to_none=False)
        total = 0.0
        for micro in self.sampler.micro_batches():
            if not micro:
                continue
            loss = self.step_fn(self.state, self.collate([self.dataset[i] for i in micro]))
            # loss_scale() weighs this micro-batch for a mean over dp ranks; we sum instead.
            scaled = loss * (self.sampler.loss_scale(micro) / self.sampler.dp_size)
            scaled.backward()
            total += float(scaled.detach())
        _all_reduce_gradients(model, self.groups.dp)
        optimizer.step()
        return total

    def _after_step(self, loss: float) -> None:
        assert self.ctx is not None
        step = self.progress.step
        if self.progress.failed_at is not None:
            downtime = time.monotonic() - self.progress.failed_at
            self.events.emit("step.resumed", round=self.ctx.round, step=step,
                             downtime_ms=int(downtime * 1000), world_size=self.ctx.world_size)
            self.progress.failed_at = None
        self.events.emit("step.completed", round=self.ctx.round, step=step, loss=loss,
                         world_size=self.ctx.world_size)
        if self.checkpoint is not None and self.checkpoint.should_save(step):
            assert self.groups is not None
            try:
                self.checkpoint.save(
                    step, self._checkpoint_state(), layout=self.ctx.layout.to_dict(),
                    extra={"step": step, "sampler": self.sampler.state_dict(),
                           "extras": self.state.extras if self.state else {}},
                    process_group=self.groups.world,
                )  # fmt: skip
            except (FencedOutError, CheckpointError) as exc:
                # The previous save did not commit; the one before it stays the latest.
                logger.warning("checkpoint before step %d not committed: %s", step, exc)

    def _finish_checkpoint(self) -> None:
        if self.checkpoint is None:
            return
        try:
            self.checkpoint.wait()
        except (FencedOutError, CheckpointError) as exc:
            logger.warning("last checkpoint not committed: %s", exc)

    def _checkpoint_state(self) -> dict[str, Any]:
        """Model and optimizer state keyed by parameter name, so it reshards.

        An optimizer's own state_dict keys its state by parameter index, which
        collides between pipeline stages; the flattened form names each entry.
        """
        assert self.state is not None
        model_state, optim_state = get_state_dict(
            self.state.model, self.state.optimizer,
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )  # fmt: skip
        return {"model": model_state, "optimizer": optim_state}

    def _load_checkpoint_state(self, state: dict[str, Any]) -> None:
        assert self.state is not None
        set_state_dict(
            self.state.model, self.state.optimizer,
            model_state_dict=state["model"], optim_state_dict=state["optimizer"],
            options=StateDictOptions(flatten_optimizer_state_dict=True),
        )  # fmt: skip

    # helpers ------------------------------------------------------------------------
    def _place(self, round_: Round | None) -> tuple[int, int, int, int]:
        """(rank, world size, token, round number) of this worker in ``round_``."""
        if round_ is None:
            return self.env.rank, self.env.world_size, self.env.token, self.env.round
        rank = round_.rank_offset(self.env.node_id) + self.env.local_rank
        return rank, round_.world_size, round_.token, round_.number

    def _phase(self, name: str, began: float, **metadata: Any) -> None:
        now = time.monotonic()
        self.events.emit(name, round=self.ctx.round if self.ctx else None, step=self.progress.step,
                         duration_ms=int((now - began) * 1000), **metadata)

    def shutdown(self) -> None:
        # context() keeps describing the last round, so the script can tell its final rank.
        destroy_groups(self.groups)
        self.groups = None
        self.store = None
        if self.follower:
            self.follower.close()


def _all_reduce_gradients(model: torch.nn.Module, group: dist.ProcessGroup) -> None:
    """Sum gradients over the data-parallel group in one flat buffer.

    Each rank's loss was scaled by its share of the global batch, so the sum is the
    gradient of the global-batch mean, for uneven shares too.
    """
    if dist.get_world_size(group) == 1:
        return
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:  # a rank with an empty share still joins the reduction
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def _collective_timeout(env: WorkerEnv) -> timedelta:
    """How long a collective may wait for a peer: past the lease TTL by a margin.

    A hung peer keeps its sockets open, so only a timeout frees the survivors; by
    then its lease has expired and the agents have formed the next round.
    """
    import os

    explicit = os.environ.get(COLLECTIVE_TIMEOUT_ENV)
    if explicit:
        return timedelta(seconds=float(explicit))
    return max(env.lease_ttl * 2, timedelta(seconds=10))
