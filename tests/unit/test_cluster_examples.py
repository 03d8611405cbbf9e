"""The multi-machine examples cannot drift from the CLI.

Every ``elastic-rt launch`` line in ``scripts/cluster/`` (the Slurm script, the Kubernetes
manifests, the guide's code blocks) is extracted, its shell or Kubernetes variables filled
with sample values, and parsed by the real argument parser and the real validators.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from elastic_rt import config as cfg
from elastic_rt.cli import torchrun_flags
from elastic_rt.cli import build_parser
from elastic_rt.cli.flags import parse_endpoint

CLUSTER = Path(__file__).resolve().parents[2] / "scripts" / "cluster"
SBATCH = CLUSTER / "slurm.sbatch"
K8S = CLUSTER / "k8s"
SHELL_SAMPLES = {
    "MIN_NODES": "2", "SLURM_NNODES": "4", "GPUS_PER_NODE": "8", "ETCD_ENDPOINT": "10.0.0.5:2379",
    "RUN_ID": "slurm-42", "SLURMD_NODENAME": "gpu017", "EVENTS_DIR": "/shared/events",
    "IP": "10.0.1.11",
}  # fmt: skip
K8S_SAMPLES = {"POD_NAME": "llm-train-0-x7k2p", "POD_IP": "10.244.1.7", "POD_NAMESPACE": "default"}

try:
    import yaml
except ImportError:  # PyYAML is not a declared dependency; fall back to reading the lists
    yaml = None


def _shell_launch_lines(text: str) -> list[list[str]]:
    """argv after ``elastic-rt`` for every ``elastic-rt launch`` command in shell text."""
    joined = re.sub(r"\\\n", " ", text)
    commands = []
    for line in joined.splitlines():
        if "elastic-rt launch" not in line or line.lstrip().startswith("#"):
            continue
        command = line[line.index("elastic-rt launch"):].split("'")[0]  # end of a bash -c '...'
        command = command.replace('"$@"', "train.py --lr 3e-4")
        command = re.sub(r"\$\{?(\w+)\}?", lambda m: SHELL_SAMPLES[m.group(1)], command)
        commands.append(shlex.split(command)[1:])
    return commands


def _k8s_documents(path: Path) -> list[dict[str, Any]]:
    assert yaml is not None
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _containers(doc: dict[str, Any]) -> list[dict[str, Any]]:
    spec = doc.get("spec", {}).get("template", {}).get("spec", {})
    return list(spec.get("containers", []))


def _k8s_launch_lines(path: Path) -> list[list[str]]:
    """argv after ``elastic-rt`` for every container that runs ``elastic-rt launch``."""
    if yaml is None:
        return [_expand_k8s(argv) for argv in _block_lists(path.read_text())]
    commands = []
    for doc in _k8s_documents(path):
        for container in _containers(doc):
            argv = [*container.get("command", []), *container.get("args", [])]
            if argv[:2] == ["elastic-rt", "launch"]:
                env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
                commands.append(_expand_k8s(argv[1:], env))
    return commands


def _block_lists(text: str) -> list[list[str]]:
    """Without PyYAML: the ``- item`` lines that follow ``- elastic-rt`` at the same indent."""
    lines = text.splitlines()
    found = []
    for i, line in enumerate(lines):
        if line.strip() == "- elastic-rt":
            indent = line.index("-")
            items = []
            for following in lines[i + 1:]:
                if not following.startswith(" " * indent + "- "):
                    break
                items.append(following.strip()[2:].strip().strip("'\""))
            found.append(items)
    return found


def _expand_k8s(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    values = {**K8S_SAMPLES, "JOB_NAME": "llm-train", **(env or {})}
    values.setdefault("CHECKPOINT_URL", "s3://bucket/run")
    return [re.sub(r"\$\((\w+)\)", lambda m: values[m.group(1)], arg) for arg in argv]


def _launch_flags() -> set[str]:
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    return set(commands.choices["launch"]._option_string_actions)


def _validated(argv: list[str]) -> argparse.Namespace:
    """Parse with the real parser, then run the checks ``launch`` runs before starting."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        pytest.fail(f"the CLI rejects: elastic-rt {shlex.join(argv)}")
    assert args.command == "launch"
    # argparse accepts abbreviations (--nnode for --nnodes); an example must spell flags in full
    known = _launch_flags()
    flags = [a.split("=")[0] for a in argv[1:argv.index(args.script)] if a.startswith("-")]
    if not set(flags) <= known:
        pytest.fail(f"not launch flags: {sorted(set(flags) - known)}")
    min_nodes, max_nodes = cfg.parse_nnodes(args.nnodes)
    endpoint, _tls = parse_endpoint(args.rdzv_endpoint)
    cfg.RendezvousConfig(run_id=args.run_id, endpoint=endpoint, min_nodes=min_nodes,
                         max_nodes=max_nodes)  # fmt: skip
    assert torchrun_flags.resolve_nproc(args.nproc_per_node) >= 1 and args.script == "train.py"
    return args


def test_every_launch_line_in_the_slurm_script_parses() -> None:
    commands = _shell_launch_lines(SBATCH.read_text())
    assert len(commands) == 1
    args = _validated(commands[0])
    assert (args.nnodes, args.node_id) == ("2:4", "gpu017")
    assert args.rdzv_endpoint == "etcd://10.0.0.5:2379"
    assert args.events_file == "/shared/events/gpu017.jsonl"
    assert args.script_args == ["--lr", "3e-4"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_the_slurm_script_is_valid_bash_and_asks_for_one_task_per_node() -> None:
    subprocess.run(["bash", "-n", str(SBATCH)], check=True)
    directives = dict(re.findall(r"^#SBATCH --([\w-]+)(?:=(\S+))?", SBATCH.read_text(), re.M))
    assert directives["ntasks-per-node"] == "1"
    assert "no-kill" in directives  # a failed node must not end the allocation


def test_every_launch_line_in_the_guide_parses() -> None:
    blocks = re.findall(r"```bash\n(.*?)```", (CLUSTER / "README.md").read_text(), re.S)
    commands = [argv for block in blocks for argv in _shell_launch_lines(block)]
    assert len(commands) >= 2
    for argv in commands:
        _validated(argv)


def test_the_kubernetes_job_runs_one_elastic_launch_per_pod() -> None:
    commands = _k8s_launch_lines(K8S / "train-job.yaml")
    assert len(commands) == 1
    args = _validated(commands[0])
    assert args.nnodes == "2:4" and args.local_addr == K8S_SAMPLES["POD_IP"]
    assert args.node_id == K8S_SAMPLES["POD_NAME"] and args.run_id == "llm-train"


@pytest.mark.skipif(yaml is None, reason="PyYAML is not installed")
def test_the_job_reaches_the_etcd_service_and_the_cluster_has_three_members() -> None:
    (args,) = [_validated(argv) for argv in _k8s_launch_lines(K8S / "train-job.yaml")]
    host, port = parse_endpoint(args.rdzv_endpoint)[0].split(":")
    docs = _k8s_documents(K8S / "etcd.yaml")
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    assert int(port) in [p["port"] for p in services[host]["spec"]["ports"]]
    (etcd,) = [d for d in docs if d["kind"] == "StatefulSet"]
    assert etcd["spec"]["replicas"] == 3 and etcd["spec"]["serviceName"] in services
    flags = dict(a.split("=", 1) for a in _containers(etcd)[0]["command"][1:])
    members = [m.split("=")[0] for m in flags["--initial-cluster"].split(",")]
    assert members == [f"{etcd['metadata']['name']}-{i}" for i in range(3)]
    (job,) = _k8s_documents(K8S / "train-job.yaml")
    maximum = int(args.nnodes.split(":")[1])
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["parallelism"] == maximum


def test_the_fallback_reader_finds_the_same_command_as_yaml() -> None:
    (items,) = _block_lists((K8S / "train-job.yaml").read_text())
    assert items[0] == "launch" and "--local-addr=$(POD_IP)" in items


def test_a_misspelt_or_abbreviated_flag_is_caught() -> None:
    with pytest.raises(pytest.fail.Exception, match="--nnode"):
        _validated(["launch", "--nnode", "2:4", "train.py"])
    with pytest.raises(pytest.fail.Exception, match="rejects"):
        _validated(["launch", "--no-such-flag", "train.py"])
