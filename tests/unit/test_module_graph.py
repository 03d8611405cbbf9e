"""The package's shape: no import cycles among our modules, the agent free of torch, and a
data-parallel worker free of the parts only other layouts and checkpoints need."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("elastic_rt", "agents")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def _imports() -> dict[str, set[str]]:
    """Module -> our modules it imports at module level (function-level imports are lazy)."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.parse(path.read_text()).body:  # top level only
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                # ``from pkg import submodule`` imports the submodule, not pkg's __init__ alone
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                           else node.module for a in node.names]
            else:
                targets = []
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def _reached(graph: dict[str, set[str]], start: set[str]) -> set[str]:
    """Every module ``start`` imports, however far (``start`` included)."""
    reached, todo = set(start), list(start)
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    return reached


def test_no_module_imports_itself_through_others() -> None:
    graph = _imports()
    cycles = []
    for start in graph:
        stack: list[tuple[str, tuple[str, ...]]] = [(start, (start,))]
        seen: set[str] = set()
        while stack:
            module, path = stack.pop()
            for nxt in graph[module]:
                if nxt == start and not start.endswith("__init__"):
                    cycles.append(" -> ".join((*path, nxt)))
                elif nxt not in seen and not nxt.startswith(start + "."):
                    seen.add(nxt)
                    stack.append((nxt, (*path, nxt)))
    assert not cycles, "\n".join(sorted(cycles))


def test_the_agent_side_reaches_no_torch_importing_module() -> None:
    graph = _imports()
    agent_side = {m for m in graph if m.startswith("agents")}
    reached = _reached(graph, agent_side)
    paths = _modules()
    torch_users = {m for m in reached if "import torch" in paths[m].read_text()}
    assert not torch_users, sorted(torch_users)


def _every_import(path: Path) -> set[str]:
    """Every module ``path`` imports, at any depth (lazy imports inside functions too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.update([node.module, *(f"{node.module}.{a.name}" for a in node.names)])
    return found


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


# What only the simulator, the test harness and the tests themselves may import.
_OFF_LIMITS = ("agents.sim", "elastic_rt.harness", "tests")


def test_the_product_imports_no_simulator_harness_or_test_module() -> None:
    """The simulator (agents.sim) serves the benchmark and its tests; the product never
    reaches it, nor the test harness, nor tests/ (the harness may import itself)."""
    wrong = []
    for name, path in _modules().items():
        if _within(name, "agents.sim"):
            continue
        own = next((p for p in _OFF_LIMITS if _within(name, p)), None)
        for target in _every_import(path):
            banned = next((p for p in _OFF_LIMITS if _within(target, p)), None)
            if banned is not None and banned != own:
                wrong.append(f"{name} imports {target}")
    assert not wrong, "\n".join(sorted(wrong))


def test_the_library_imports_agents_only_from_the_cli() -> None:
    wrong = [f"{name} imports {target}"
             for name, path in _modules().items()
             if _within(name, "elastic_rt") and not name.startswith("elastic_rt.cli")
             for target in _every_import(path) if _within(target, "agents")]
    assert not wrong, "\n".join(sorted(wrong))


def test_the_cli_imports_agents_lazily() -> None:
    """``elastic-rt status`` or ``checkpoint`` must not load the agent (nor a worker)."""
    wrong = [f"{name} imports {target} at module level"
             for name, targets in _imports().items() if name.startswith("elastic_rt.cli")
             for target in targets if _within(target, "agents")]
    assert not wrong, "\n".join(sorted(wrong))


def test_etcd_and_grpc_are_imported_by_the_etcd_seam_and_the_simulator_only() -> None:
    """The product's one etcd seam is etcd_kv (with its message and error modules); the
    simulator's asyncio client is the only other."""
    seam = {"elastic_rt.rendezvous.etcd_kv", "elastic_rt.rendezvous.etcd_messages",
            "elastic_rt.rendezvous.etcd_errors", "agents.sim.etcd_aio"}
    users = {name for name, path in _modules().items()
             if any(_within(t, "grpc") or _within(t, "etcd3") for t in _every_import(path))}
    assert users <= seam, sorted(users - seam)


def test_the_policy_reaches_no_process_or_io_module() -> None:
    """agents.policy decides over values: nothing it imports, however far, starts a
    process, opens a socket or talks to etcd."""
    graph, paths = _imports(), _modules()
    policy = {m for m in graph if _within(m, "agents.policy")}
    reached = _reached(graph, policy)
    io = ("psutil", "subprocess", "socket", "threading", "etcd3", "grpc")
    users = sorted(f"{m} imports {t}" for m in reached for t in _every_import(paths[m])
                   if any(_within(t, name) for name in io))
    assert not users, "\n".join(users)


def test_a_data_parallel_worker_loads_no_pipelining_dtensor_or_checkpoint_code() -> None:
    """What a plain data-parallel script touches (``ert.run``, ``TrainState``, the layout and
    loader options) must not import torch's pipelining (which loads dynamo), DTensor or
    torch.distributed.checkpoint: 1-2 s of every worker's start on two busy cores, paid again
    by each replacement and newcomer. A job that uses them imports them itself."""
    import subprocess
    import sys

    heavy = ("torch.distributed.pipelining", "torch._dynamo", "torch.distributed.tensor",
             "torch.distributed.checkpoint", "elastic_rt.checkpoint.checkpointer")
    code = ("import sys\nimport elastic_rt as ert\n"
            "ert.run, ert.TrainState, ert.ModelLimits, ert.LoaderOptions, ert.context\n"
            "import elastic_rt.process_groups, elastic_rt.worker.joined_round\n"
            f"print([m for m in {heavy!r} if m in sys.modules])")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120).stdout.strip()
    assert loaded == "[]", loaded
