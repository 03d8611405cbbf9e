"""Launching one node: a private etcd when the job names none, the address peers reach
this node at, torchrun's process defaults, then the agent until the job ends.

``elastic-rt launch`` checks its flags into an :class:`AgentConfig` and calls
:func:`launch_node`; everything that changes the process or starts one happens here,
after every flag was found good, so a mistake leaves nothing to clean up. The private
etcd is stopped however the agent ends.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import socket

from agents.agent import Agent
from agents.config import AgentConfig
from elastic_rt.childproc import owned_temp_dir
from elastic_rt.etcd_server import EtcdServer

logger = logging.getLogger(__name__)

LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


def launch_node(config: AgentConfig, *, etcd_port: int | None = None,
                local_addr: str | None = None) -> int:
    """Run this node's agent; its exit code.

    Args:
        config: the agent's configuration; an empty ``rendezvous.endpoint`` starts a
            private etcd on 127.0.0.1 (on ``etcd_port``, else a free port).
        local_addr: the address peers reach this node at; by default 127.0.0.1 when the
            rendezvous is on loopback, else this host's FQDN.
    """
    if config.output.log_dir:
        os.makedirs(config.output.log_dir, exist_ok=True)
    set_omp_threads(config.nproc_per_node)
    server = None if config.rendezvous.endpoint else EtcdServer(port=etcd_port).start()
    events_dir = None
    try:
        if server is not None:
            rendezvous = dataclasses.replace(config.rendezvous, endpoint=server.endpoint)
            config = dataclasses.replace(config, rendezvous=rendezvous)
            logger.info("private etcd at etcd://%s", server.endpoint)
        if config.metrics_port is not None and not config.events_file:
            # The metrics are a fold over the events: they need a file even unasked.
            events_dir = owned_temp_dir("elastic-rt-events-")
            config = dataclasses.replace(config, events_file=os.path.join(events_dir,
                                                                          "events.jsonl"))
        host = local_addr or reachable_host(config.rendezvous.endpoint)
        if host == "127.0.0.1":
            # Keep gloo on loopback too, whatever the host name resolves to.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return Agent(dataclasses.replace(config, host=host)).run()
    finally:
        if server is not None:
            server.stop()
        if events_dir is not None:
            shutil.rmtree(events_dir, ignore_errors=True)


def reachable_host(endpoint: str) -> str:
    """127.0.0.1 for a rendezvous on loopback (a one-host job), else this host's FQDN."""
    return "127.0.0.1" if endpoint.split(":")[0] in LOOPBACK_HOSTS else socket.getfqdn()


def set_omp_threads(nproc: int) -> None:
    """torchrun's default: one OpenMP thread per worker, so N workers do not oversubscribe."""
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        logger.warning(
            "\n*****************************************\n"
            "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, "
            "to avoid your system being overloaded, please further tune the variable for "
            "optimal performance in your application as needed. \n"
            "*****************************************"
        )
        os.environ["OMP_NUM_THREADS"] = "1"
