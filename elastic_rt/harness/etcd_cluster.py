"""Three etcd members on one host forming one cluster: the suite's fixture and the soak's etcd.

A job given every member (``--rdzv-endpoint etcd://h:p1,h:p2,h:p3``) survives the
loss of any one of them; :meth:`EtcdCluster.restart` kills one member and starts it
again on its data dir, which is how the soak exercises that. The members listen on
``host`` (127.0.0.1, or the host end of a network namespace's veth pair so that a
node inside it reaches them).

The members elect a new leader within about a second of losing one (heartbeat 50 ms,
election timeout 500 ms, where etcd's defaults are 100 ms and 1 s): the jobs on this
cluster keep 3 s leases, which a node fences itself on after 2 s without a renewal, and
with the defaults an election after the leader's SIGKILL took 1.3-2.5 s on top of up to
a renewal interval already gone, so a healthy node fenced itself on some leader restarts
(the short soak lost its only state holder that way). etcd's guide sizes the election
timeout by the members' round trip; on one host half a second is ample. An operator with
etcd's defaults keeps elastic-rt's default 5 s lease (docs/rendezvous.md).
"""

from __future__ import annotations

import time

from elastic_rt.etcd_server import EtcdServer, free_ports


ELECTION_FLAGS = ("--heartbeat-interval", "50", "--election-timeout", "500")
"""A leader lost is replaced well within a 3 s lease's 2 s fence (see above)."""


class EtcdCluster:
    """Three :class:`~elastic_rt.etcd_server.EtcdServer` members of one cluster."""

    def __init__(self, host: str = "127.0.0.1", size: int = 3) -> None:
        self.members = [EtcdServer(host=host, name=f"m{i}", extra_args=list(ELECTION_FLAGS))
                        for i in range(size)]

    @property
    def endpoint(self) -> str:
        """``host:port,host:port,...``: what a client is given to use every member."""
        return ",".join(m.endpoint for m in self.members)

    @property
    def pids(self) -> list[int]:
        return [m.pid for m in self.members if m.pid is not None]

    def start(self) -> EtcdCluster:
        """Start every member, then wait until each answers healthy (once there is a leader).

        Raises:
            ElasticError: a member exited or was not healthy in time (all are stopped then).
        """
        ports = iter(free_ports(2 * len(self.members), self.members[0].host))
        for member in self.members:  # every port distinct, picked at once
            member.port, member.peer_port = next(ports), next(ports)
        initial = ",".join(m.peer_url for m in self.members)
        try:
            for member in self.members:
                member.initial_cluster = initial
                member.start(wait=False)
            for member in self.members:
                member.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def restart(self, index: int, down_s: float = 0.0) -> None:
        """SIGKILL member ``index``, wait ``down_s``, start it again on its data dir."""
        member = self.members[index]
        member.kill()
        time.sleep(down_s)
        member.restart()

    def stop(self) -> None:
        for member in self.members:
            member.stop()
