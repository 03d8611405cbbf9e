"""A membership that never changes: the one round a job outside ``elastic-rt launch`` has.

Under plain torchrun (or one bare process) there are no agents and no etcd: the world
is what the environment says (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR:MASTER_PORT``),
for the whole job. :class:`StaticMembership` answers the loop's questions
(:class:`~elastic_rt.worker.membership.Membership`) the way that world does: one round,
never a newer one, nobody to report a failure to, and no next round to wait for, so
a failed collective ends the job (torchrun restarts it from its checkpoint).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Callable

from elastic_rt.config import WorkerEnv
from elastic_rt.errors import ElasticError
from elastic_rt.rendezvous.registry import RunRegistry
from elastic_rt.rendezvous.rounds import Round
from elastic_rt.worker.abort import round_notice
from elastic_rt.worker.membership import Membership, RoundFollower


class StaticMembership:
    """The environment's world as the job's only round.

    Its round is ``ELASTIC_RT_ROUND`` (0 by default) with the environment's token, one
    member holding all ``WORLD_SIZE`` ranks; this worker's rank is ``RANK``.
    """

    registry: RunRegistry | None = None
    """No run keys: nothing is published, fenced or closed."""

    def __init__(self, env: WorkerEnv) -> None:
        self.env = env
        self._round = Round(number=env.round, members=(env.node_id,), nprocs=(env.world_size,),
                            hosts=(env.master_addr,), token=env.token)

    def current(self) -> Round:
        return self._round

    def has_newer_round(self, than: int) -> bool:
        return False

    def wait_for_round(self, after: int, timeout: timedelta) -> Round:
        """Raises ElasticError: no round ever follows this one."""
        raise ElasticError("a collective failed outside elastic-rt launch; cannot recover")

    def rank_in(self, round_: Round) -> int:
        return self.env.rank

    def store_address(self, round_: Round, timeout: timedelta) -> tuple[str, int]:
        return self.env.master_addr, self.env.master_port

    def report_failure(self, round_: Round) -> None:
        """Nobody to tell: the job ends with the failure (see :meth:`wait_for_round`)."""

    def evict(self, node_id: str) -> bool:
        """No agents to evict through: one fixed round (returns False)."""
        return False

    def announce(self) -> None:
        """No agent reads acknowledgements."""

    def acknowledge(self, round_: Round) -> None:
        """No agent reads acknowledgements."""

    def leave_note(self) -> str | None:
        """None: without an agent nobody asks this node to leave."""
        return None

    def left(self, step: int) -> None:
        """Nothing: no agent to tell."""

    def close(self) -> None:
        """Nothing held."""


def start_membership(env: WorkerEnv, *,
                     prepare: Callable[[Membership], None] = lambda _: None) -> Membership:
    """The agents' rounds under ``elastic-rt launch``, else the environment's one round;
    announced to the agent once ``prepare`` (what a standby worker does before its node
    registers: build its state) has returned.

    The follower's watch is the abort notice too: a newer round that drops a peer cuts
    short any collective we wait on (``worker/abort.py``).
    """
    membership: Membership = (RoundFollower(env, on_round=round_notice().observe)
                              if env.is_elastic else StaticMembership(env))
    # Building an optimizer imports torch._dynamo (1.5 s and more); do it before we
    # tell the agent we are ready, so that no round waits on it.
    import torch._dynamo  # noqa: F401

    prepare(membership)
    # Tell the agent at once that we recover in-process, so that a round formed
    # while we are still starting does not make it restart us.
    membership.announce()
    return membership
