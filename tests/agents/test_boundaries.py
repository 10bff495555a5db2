"""The agent is a plain package: it never imports Django or the portal's apps, its modules import one
another in one direction, and none imports inside a function (a lazy import hiding a cycle is a cycle)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.agents.conftest import REPO

AGENTS = REPO / "agents"


def _agent_sources() -> list[Path]:
    """The agent's Python files, not those of the npm packages agents/editors/install.sh puts there."""
    return sorted(p for p in AGENTS.rglob("*.py") if "node_modules" not in p.relative_to(AGENTS).parts)


def test_agent_imports_no_django_nor_portal_apps():
    code = (
        "import sys, agents.cli, agents.api, agents.heartbeat, agents.workloads, agents.runtimes, agents.nvml; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('django', 'portal', 'billing', 'provisioner', "
        "'rest_framework', 'celery')); print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _modules() -> dict[str, Path]:
    modules = {}
    for path in _agent_sources():
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.AST) -> list[str]:
    """Dotted names an import statement reaches: ``from a.b import c`` reaches ``a.b.c`` (a module or
    a name in ``a.b``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [f"{node.module}.{alias.name}" for alias in node.names]
    return []


def import_graph() -> dict[str, set[str]]:
    """Module → the agent modules it imports, wherever the import statement stands (a function, an
    ``if TYPE_CHECKING:`` block); a package imports its own modules, so a module importing its own
    package closes a cycle."""
    modules = _modules()

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            for target in _imported(node):
                if (module := owner(target)) and module != name:
                    graph[name].add(module)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    visiting: list[str] = []
    done: set[str] = set()

    def visit(module: str) -> list[str] | None:
        if module in visiting:
            return [*visiting[visiting.index(module) :], module]
        if module in done:
            return None
        visiting.append(module)
        for imported in sorted(graph[module]):
            if cycle := visit(imported):
                return cycle
        visiting.pop()
        done.add(module)
        return None

    for module in sorted(graph):
        if cycle := visit(module):
            return cycle
    return None


def test_agent_modules_import_one_another_in_one_direction():
    graph = import_graph()
    assert "agents.runtimes.base" in graph["agents.runtimes.process"]  # the graph sees real imports
    assert find_cycle(graph) is None, " → ".join(find_cycle(graph) or [])


def test_the_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_agent_module_imports_inside_a_function_or_a_type_checking_block():
    lazy: set[str] = set()
    for path in _agent_sources():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            in_function = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            if in_function or (isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)):
                lazy |= {f"{path.relative_to(REPO)}:{n.lineno}" for n in ast.walk(node) if _imported(n)}
    assert sorted(lazy) == []


MAX_FUNCTION_LINES = 80


def test_no_agent_function_is_longer_than_80_lines():
    long = []
    for path in _agent_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({lines} lines)")
    assert long == []
