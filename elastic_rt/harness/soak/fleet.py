"""The soak's one job and its nodes as they come and go, and the newest round it formed.

Node ids are never reused: the n-th node ever started is ``n<k>``. One slot may live
inside a network namespace (the cut fault's target); a node lost from it is replaced
inside it. :class:`Fleet` digests the event log incrementally (a soak writes a
hundred thousand lines; re-reading them at every poll would cost the cores the job
needs) into what :func:`.plan.place` decides on.
"""

from __future__ import annotations

import time

from elastic_rt.harness.chaos import netns
from elastic_rt.harness.chaos.trial import Job
from elastic_rt.harness.soak.plan import FleetView

_OUTSIDE_ENV = {"GLOO_SOCKET_IFNAME": netns.VETH_HOST}
_INSIDE_ENV = {"GLOO_SOCKET_IFNAME": netns.VETH_NODE}


class Fleet:
    """The job's nodes: started, taken out, and replaced under new ids."""

    def __init__(self, job: Job, *, minimum: int, etcd_members: int, use_netns: bool) -> None:
        self.job, self.minimum, self.etcd_members = job, minimum, etcd_members
        self.use_netns = use_netns
        self.in_netns: set[str] = set()
        self.out: set[str] = set()
        """Nodes taken out (killed, left): never members again."""
        self.started = 0
        self.step = 0
        """The newest step rank 0 completed."""
        self.progressed_at: float | None = None
        """When (monotonic) :attr:`step` last grew."""
        self.round = -1
        self.members: tuple[str, ...] = ()
        self.holders: set[str] = set()
        """Nodes whose current worker has completed a step: it holds the job's state."""
        self.hit_ms: dict[str, int] = {}
        """When the soak's own fault last took a node's worker (wall clock, ms)."""
        self.finished = False
        self.failed = ""
        """Why the job stopped, if an agent exited with an error."""
        self._read = 0

    def start(self, count: int) -> list[str]:
        """The first ``count`` nodes; with namespaces the first of them lives inside one."""
        return [self.start_node(inside=self.use_netns and i == 0) for i in range(count)]

    def start_node(self, *, inside: bool) -> str:
        """A fresh ``elastic-rt launch`` under a new node id; its name."""
        self.started += 1
        name = f"n{self.started}"
        if inside:
            self.job.start_node(name, prefix=("ip", "netns", "exec", netns.NAMESPACE),
                                host=netns.NODE_IP, env=_INSIDE_ENV)
            self.in_netns.add(name)
        elif self.use_netns:
            self.job.start_node(name, host=netns.HOST_IP, env=_OUTSIDE_ENV)
        else:
            self.job.start_node(name)
        return name

    def crashed(self) -> dict[str, int]:
        """Nodes whose agent exited on its own (no fault took them out), with exit codes;
        they are marked as taken out, so the job's end does not wait for them."""
        found = {}
        for name, node in self.job.nodes.items():
            code = node.proc.poll()
            if code is not None and not node.killed and not self.finished:
                node.killed = True
                found[name] = code
        return found

    def replace(self, lost: str) -> str:
        """Mark ``lost`` as taken out for good and start its replacement (same slot)."""
        self.out.add(lost)
        return self.start_node(inside=lost in self.in_netns)

    def stalled_for(self) -> float:
        """Seconds since rank 0 last completed a new step (0 before the first)."""
        return 0.0 if self.progressed_at is None else time.monotonic() - self.progressed_at

    @property
    def ended(self) -> bool:
        """The job finished, or stopped on an error: no fault can land any more."""
        return self.finished or bool(self.failed)

    def view(self) -> FleetView:
        self.refresh()
        members = tuple(m for m in self.members if m not in self.out)
        return FleetView(members, frozenset(self.holders & set(members)),
                         frozenset(self.in_netns), self.minimum, self.etcd_members)

    def hit(self, node: str) -> None:
        """A fault just took ``node``'s worker (or cut it off): it holds no state the job can
        restore from until a later worker of it completes a step. Its agent may take seconds
        to say so (it can be blocked in an etcd call while a member restarts), and a second
        worker fault aimed meanwhile at the one other holder would lose the state."""
        self.refresh()
        self.hit_ms[node] = int(time.time() * 1000)
        self.holders.discard(node)

    def refresh(self) -> None:
        """Digest the events written since the last call."""
        events = self.job.events()
        for event in events[self._read:]:
            node = event.node or ""
            if event.name == "step.completed" and event.step is not None:
                if event.timestamp_ms > self.hit_ms.get(node, -1):
                    self.holders.add(node)
                if event.rank == 0 and event.step > self.step:
                    self.step, self.progressed_at = event.step, time.monotonic()
            elif event.name in ("worker.started", "worker.restarted", "agent.fenced"):
                self.holders.discard(node)
            elif (event.name == "round.formed" and event.source == "agent"
                  and event.round is not None and event.round > self.round):
                self.round = event.round
                self.members = tuple(event.metadata.get("members", ()))
            elif event.name == "job.finished":
                self.finished = True
            elif event.name == "agent.exited" and event.metadata.get("exitcode"):
                self.failed = self.failed or str(event.metadata.get("reason", "?"))
        self._read = len(events)
