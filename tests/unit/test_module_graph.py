"""The package's shape: no import cycles among our modules, and the agent free of torch."""

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
    reached, todo = set(agent_side), list(agent_side)
    while todo:
        for nxt in graph[todo.pop()]:
            if nxt not in reached:
                reached.add(nxt)
                todo.append(nxt)
    paths = _modules()
    torch_users = {m for m in reached if "import torch" in paths[m].read_text()}
    assert not torch_users, sorted(torch_users)
