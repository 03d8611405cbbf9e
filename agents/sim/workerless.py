"""What a simulated node does with the actions only workers cause: nothing can.

A node without workers never sees one fail, succeed, raise an alarm or announce
in-process recovery, so the policy never asks it to settle a failure, leave a round
for its replacements or start workers in standby. Should it ever, the node stops with
the action named rather than skip it silently: a skipped action would be a
disagreement between the simulator and the agent, the thing the shared dispatcher
(:mod:`agents.dispatch`) exists to prevent. The methods raise as they are called, so
the one mixin serves the threaded node and the swarm's awaited one alike.
"""

from __future__ import annotations

from typing import NoReturn

from agents import policy


class Workerless:
    """The worker-only hands of :class:`agents.dispatch.Hands`, for nodes without workers."""

    def _no_workers(self, action: policy.Action) -> NoReturn:
        raise RuntimeError(f"{action} reached a simulated node, which has no workers")

    def publish_in_process(self, action: policy.PublishInProcess) -> NoReturn:
        self._no_workers(action)

    def start_in_standby(self, action: policy.StartInStandby) -> NoReturn:
        self._no_workers(action)

    def revoke_lost_lease(self, action: policy.RevokeLostLease) -> NoReturn:
        self._no_workers(action)

    def unregister(self, action: policy.Unregister) -> NoReturn:
        self._no_workers(action)

    def gather_failure(self, action: policy.HandleFailure) -> NoReturn:
        self._no_workers(action)

    def probe_peers(self, action: policy.ProbePeers) -> NoReturn:
        self._no_workers(action)

    def claim_failure(self, action: policy.ClaimFailure) -> NoReturn:
        self._no_workers(action)

    def count_restart(self, action: policy.CountRestart) -> NoReturn:
        self._no_workers(action)

    def report_root_cause(self, action: policy.ReportRootCause) -> NoReturn:
        self._no_workers(action)

    def leave_round(self, action: policy.LeaveRound) -> NoReturn:
        self._no_workers(action)

    def reform_without_us(self, action: policy.ReformWithoutUs) -> NoReturn:
        self._no_workers(action)

    def announce_leave(self, action: policy.AnnounceLeave) -> NoReturn:
        self._no_workers(action)

    def leave_at_boundary(self, action: policy.LeaveAtBoundary) -> NoReturn:
        self._no_workers(action)

    def succeed(self, action: policy.Succeed) -> NoReturn:
        self._no_workers(action)
