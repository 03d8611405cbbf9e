"""Network-namespace plumbing for the cut-off fault: one node behind its own veth pair.

Needs root and iproute2; :func:`skip_reason` says why the fault cannot run here.
Names and the pair's subnet carry this process's PID, so two chaos runs or soaks on
one machine never share a namespace or an address (with one fixed subnet, the second
run's veth took the first one's host address, and its namespaced node never joined).
"""

from __future__ import annotations

import os
import shutil
import subprocess

_SUBNET = f"10.213.{os.getpid() % 250}"
HOST_IP, NODE_IP = f"{_SUBNET}.1", f"{_SUBNET}.2"
NAMESPACE = f"ert-chaos-{os.getpid()}"
VETH_HOST, VETH_NODE = f"ertc{os.getpid() % 100000}h", f"ertc{os.getpid() % 100000}n"


def ip(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS`` (iproute2), output captured."""
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)


def skip_reason() -> str:
    """Why namespaces cannot be made here ("" when they can)."""
    if shutil.which("ip") is None:
        return "skipped: no 'ip' command (iproute2) on this machine"
    if os.geteuid() != 0:
        return "skipped: network namespaces need root"
    probe = f"{NAMESPACE}-probe"
    made = ip("netns", "add", probe)
    if made.returncode != 0:
        return f"skipped: 'ip netns add' is not permitted here ({made.stderr.strip()})"
    ip("netns", "del", probe)
    return ""


def setup() -> None:
    """The namespace, a veth pair between it and the host, addresses, links up."""
    steps = [
        ("netns", "add", NAMESPACE),
        ("link", "add", VETH_HOST, "type", "veth", "peer", "name", VETH_NODE),
        ("link", "set", VETH_NODE, "netns", NAMESPACE),
        ("addr", "add", f"{HOST_IP}/24", "dev", VETH_HOST),
        ("link", "set", VETH_HOST, "up"),
        ("-n", NAMESPACE, "addr", "add", f"{NODE_IP}/24", "dev", VETH_NODE),
        ("-n", NAMESPACE, "link", "set", VETH_NODE, "up"),
        ("-n", NAMESPACE, "link", "set", "lo", "up"),
    ]
    for args in steps:
        done = ip(*args)
        if done.returncode != 0:
            raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def cleanup() -> None:
    """Remove the veth pair and the namespace (no error if they are not there)."""
    ip("link", "del", VETH_HOST)
    ip("netns", "del", NAMESPACE)


def etcd_host() -> str:
    """Make a fresh namespace (removing a crashed run's leftovers); etcd listens on the host end."""
    cleanup()
    setup()
    return HOST_IP


def set_node_link(up: bool) -> None:
    """Bring the node's end of the veth pair up or down: heal or cut it off."""
    ip("-n", NAMESPACE, "link", "set", VETH_NODE, "up" if up else "down")
