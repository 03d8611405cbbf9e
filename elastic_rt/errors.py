"""The whole exception hierarchy of elastic-rt.

Every error says whether it is retryable. A :class:`UserError` is a mistake the
user can fix (bad flag, unreachable endpoint, wrong URL); the CLI prints it as one
line, ``elastic-rt: error: <problem>. <fix>``, and exits with code 2. Anything
that is not an ``ElasticError`` is a bug and keeps its traceback.
"""

from __future__ import annotations


class ElasticError(Exception):
    """Base of every error the runtime raises on purpose."""


class UserError(ElasticError):
    """A mistake the user can fix. Not retryable: retrying gives the same answer.

    Args:
        problem: what is wrong, naming the value (no trailing period).
        fix: what to do about it (one sentence).
    """

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem.rstrip(".")
        self.fix = fix.strip()
        super().__init__(self.one_line())

    def one_line(self) -> str:
        """The message as the CLI prints it."""
        return f"{self.problem}. {self.fix}".strip()


class ConfigError(UserError):
    """A flag, environment variable or config field has a bad value. Not retryable."""


class EndpointUnreachableError(UserError):
    """The rendezvous endpoint (etcd) cannot be reached. Not retryable by the CLI."""


class UnknownURLSchemeError(UserError):
    """A URL names a scheme we have no storage or endpoint for. Not retryable."""


class CredentialsError(UserError):
    """Storage or etcd refused our credentials, or none were found. Not retryable."""


class CheckpointMismatchError(UserError):
    """A checkpoint does not fit the model it is loaded into. Not retryable."""


class ReplicaMismatchError(UserError):
    """A rank's model or optimizer does not fit the replica it restores from (``build``
    made another one there). Not retryable."""


class RendezvousError(ElasticError):
    """Base of rendezvous failures."""


class RendezvousTimeoutError(RendezvousError, UserError):
    """Too few nodes joined before the join timeout. Not retryable: start more nodes."""


class RendezvousClosedError(RendezvousError):
    """The job has finished or was stopped; no new round will form. Not retryable."""


class FencedOutError(RendezvousError):
    """Our round is no longer current, so a commit was refused. Retryable in the next round."""


class RoundChange(RendezvousError):
    """Base of the signals that the round our groups belong to is over. Retryable: the
    loop re-forms in the newer round and retries the step. Signals, not failures, so
    their names do not end in ``Error``; the loop catches each by name."""


class NewerRound(RoundChange):
    """A newer round formed while this one was being joined or trained in: join that
    one instead. Retryable; the groups are released, not abandoned (nothing failed)."""


class NodeLeaving(RoundChange):
    """This rank's node leaves at this step boundary (its agent took a preemption notice or
    SIGTERM), and every rank knows it: the state is handed over, the worker ends. Not a
    failure; never reaches the user's code."""

    def __init__(self, step: int) -> None:
        self.step = step
        super().__init__(f"this node leaves after step {step}")


class RoundAbandoned(RoundChange):
    """A newer round dropped a member of ours while we waited on a collective
    (``worker/abort.py``). Retryable: the loop abandons the round's groups, as after a
    failed collective, re-forms in the newer round and retries the step.

    The message names the ``ProcessGroup``, which ``worker/failures.is_peer_failure``
    reads as a failed collective when it comes out of the user's step.
    """


class StoreError(ElasticError):
    """Base of key-value store failures."""


class StoreConnectionError(StoreError):
    """The connection to etcd failed. Retryable: etcd may come back."""


class StoreElectingError(StoreConnectionError):
    """The etcd member answered that its cluster has no leader, or that its leader did not
    answer in time (an election, or the member is cut off from the others). Retryable: a
    leader is elected, and it renews every lease."""


class StoreStateError(StoreError):
    """etcd holds something we did not expect (bad JSON, a foreign key). Not retryable."""


class CheckpointError(ElasticError):
    """Base of checkpoint failures."""


class CheckpointNotFoundError(CheckpointError):
    """No committed checkpoint exists at the URL. Not retryable."""


class CorruptShardError(CheckpointError):
    """A checkpoint file is missing or fails its checksum. Retryable with an older checkpoint."""


class CheckpointLocationError(UserError):
    """A checkpoint URL's bucket or folder does not exist. Not retryable: fix the URL
    or create the location (an existing, empty location is a fresh start)."""


class StorageUnreachableError(UserError):
    """Checkpoint storage cannot be reached at start-up (a wrong endpoint, no network).
    Not retryable there; the same trouble during a running job is a CheckpointError."""


class UnknownRunError(UserError):
    """No keys exist for the run id on this etcd. Not retryable: check the run id."""


class NoEventsError(UserError):
    """An event file is missing, empty or holds no events. Not retryable."""


class StateLostError(ElasticError):
    """The job trained, but no rank holds its state and no checkpoint is committed. Not
    retryable: starting again from step 0 would redo the job silently, so the job ends."""


class UserCodeError(ElasticError):
    """The user's step, dataset or model raised (not a peer's failure). Not retryable:
    the same code would fail the same way on every retry, so the job ends.

    The original exception is the ``__cause__``; the message is the one-line root cause.
    """

    def __init__(self, what: str, *, rank: int, step: int) -> None:
        self.rank, self.step = rank, step
        super().__init__(f"rank {rank} failed at step {step}: {what}")
