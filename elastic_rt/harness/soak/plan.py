"""Where a drawn fault may land now: pure, so the rule is tested on made-up fleets.

The rules:

- A fault that takes a node out of the round (:data:`.config.LOSSES`) lands only while
  the round keeps at least the job's minimum without it; at the minimum it waits
  (:class:`Hold`) until a replacement has joined. Below the minimum the job would
  pause and stop every worker, which is a different test. ``worker-kill`` may land at
  the minimum: its node stays a member (with no ranks while its worker restarts).
- Every fault on a node destroys that node's copy of the state, so it lands only
  while another member holds one: a worker that has completed a step since it
  started. A newcomer receives the state from the members after it is admitted;
  killing the last member that has it loses the job's state (DESIGN: work is lost
  only when a piece and all its copies are lost together, and the soak runs no
  checkpoints), which is a different test too.
- A node is a candidate only while it is a member of the newest round: one that is
  starting, or back from a fence and rejoining, is still recovering from the last
  fault.

Nothing here sleeps, reads a clock or touches a process.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from elastic_rt.harness.soak.config import LOSSES


@dataclass(frozen=True)
class FleetView:
    """The job as the event log shows it now."""

    members: tuple[str, ...]
    """Nodes of the newest round, less those the soak has taken out since."""
    holders: frozenset[str]
    """Members whose worker holds the job's state (it completed a step since it started)."""
    in_netns: frozenset[str]
    """Nodes inside the network namespace (the only ones a cut reaches)."""
    minimum: int
    etcd_members: int


@dataclass(frozen=True)
class Inject:
    kind: str
    victim: str
    """A node name, or for ``etcd-restart`` the etcd member's index."""


@dataclass(frozen=True)
class Hold:
    why: str


def place(kind: str, view: FleetView, rng: random.Random) -> Inject | Hold:
    """The victim of a ``kind`` fault now, or why it must wait."""
    if kind == "etcd-restart":
        return Inject(kind, str(rng.randrange(view.etcd_members)))
    members = sorted(view.members)
    candidates = [m for m in members if m in view.in_netns] if kind == "netns-cut" else members
    if not candidates:
        return Hold("the node in the namespace to be a member" if kind == "netns-cut"
                    else "a member")
    if kind in LOSSES and len(members) - 1 < view.minimum:
        return Hold(f"a replacement to join ({len(members)} members, minimum {view.minimum})")
    candidates = [m for m in candidates if view.holders - {m}]
    if not candidates:
        return Hold(f"a second member to hold the state (held by {sorted(view.holders)})")
    return Inject(kind, rng.choice(candidates))
