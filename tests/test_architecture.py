"""The package's layers: api -> head -> mesh -> model, arrows pointing down only, and no cycles; model/'s rooms.

Built from the source with `ast`, so the rule holds for every import, lazy ones included.
"""

import ast
from pathlib import Path

import meshws

PACKAGE = Path(meshws.__file__).resolve().parent
LAYERS = ["model", "mesh", "head", "api"]  # each may import only those before it
ROOMS = ["gguf", "text", "kv", "kernels"]  # model/'s rooms: each may import only itself, those before it, BOUNDARY
BOUNDARY = {"meshws.model.backend", "meshws.model.tensors"}  # model's step types and tensor bytes: no room's
MAX_LOOSE = 20  # modules directly in model/, outside the rooms
MAX_LINES = 365


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _nodes(tree: ast.AST, typing: bool) -> list[ast.AST]:
    """The tree's nodes; without `typing`, none under `if TYPE_CHECKING:` (names for annotations, not imports)."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        found.append(node)
        if not typing and isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo.extend(node.orelse)
            continue
        todo.extend(ast.iter_child_nodes(node))
    return found


def _imports(path: Path, typing: bool = True) -> set[str]:
    """Every meshws module `path` imports (relative imports resolved); `typing` False: those run at import."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in _nodes(ast.parse(path.read_text()), typing):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("meshws")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("meshws"):
                found.add(target)
    return found


def _graph(typing: bool = True) -> dict[str, set[str]]:
    return {_module_name(path): _imports(path, typing) for path in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in LAYERS else None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports from a layer to a layer above it (or out of the layers into node, config, tools)."""
    upward = []
    for module, targets in graph.items():
        mine = _layer(module)
        if mine is None:
            continue  # the node, the CLI, config and tools wire everything
        for target in targets:
            theirs = _layer(target)
            if (theirs is None and target != "meshws") or (theirs is not None and theirs > mine):
                upward.append(f"{module} -> {target}")
    return sorted(upward)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle among the modules of `graph`, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        stack.append(module)
        for target in sorted(graph[module] & set(graph)):
            if target in (module, "meshws"):
                continue
            if state.get(target) == 1:
                return stack[stack.index(target):] + [target]
            if target not in state and (cycle := visit(target)):
                return cycle
        stack.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def test_imports_between_the_subpackages_point_down_only():
    assert upward_imports(_graph()) == []


def test_there_is_no_import_cycle():
    assert find_cycle(_graph()) is None


def test_the_checks_catch_an_upward_import_and_a_cycle():
    graph = _graph()
    assert "meshws.model.backend" in graph["meshws.mesh.compute"]  # the graph sees real imports
    bad = dict(graph, **{"meshws.model.shard": graph["meshws.model.shard"] | {"meshws.api.errors"}})
    assert upward_imports(bad) == ["meshws.model.shard -> meshws.api.errors"]
    looped = dict(graph, **{"meshws.model.tensors": graph["meshws.model.tensors"] | {"meshws.model.shard"}})
    assert find_cycle(looped) is not None


def _room(module: str) -> int | None:
    parts = module.split(".")
    return ROOMS.index(parts[2]) if len(parts) > 2 and parts[1] == "model" and parts[2] in ROOMS else None


def room_crossings(graph: dict[str, set[str]]) -> list[str]:
    """Imports run by a room of model/ (or the boundary) that it may not make: of a later room, or of a module
    directly in model/ other than the boundary (for the boundary: of anything but the boundary)."""
    crossings = []
    for module, targets in graph.items():
        mine = _room(module)
        if mine is None and module not in BOUNDARY:
            continue  # model's own compute, and everything outside model, may import any room
        for target in targets:
            if not target.startswith("meshws.model.") or target in BOUNDARY:
                continue
            theirs = _room(target)
            if mine is None or theirs is None or theirs > mine:
                crossings.append(f"{module} -> {target}")
    return sorted(crossings)


def test_model_is_in_rooms_whose_imports_point_one_way():
    assert room_crossings(_graph(typing=False)) == []
    loose = [path.name for path in (PACKAGE / "model").glob("*.py") if path.name != "__init__.py"]
    assert len(loose) <= MAX_LOOSE, sorted(loose)
    assert all((PACKAGE / "model" / room / "__init__.py").exists() for room in ROOMS)


def test_the_room_check_catches_a_backward_import():
    graph = _graph(typing=False)
    kv, native = "meshws.model.kv.kv_blocks", "meshws.model.kernels.native"
    assert kv in graph["meshws.model.kernels.native"]  # the graph sees a room's imports of an earlier room
    bad = dict(graph, **{kv: graph[kv] | {native, "meshws.model.shard"}})
    assert room_crossings(bad) == [f"{kv} -> {native}", f"{kv} -> meshws.model.shard"]
    boundary = dict(graph, **{"meshws.model.backend": {"meshws.model.kv.cache_store"}})
    assert room_crossings(boundary) == ["meshws.model.backend -> meshws.model.kv.cache_store"]


def test_every_module_says_what_it_owns_and_fits_in_one_sitting():
    for path in PACKAGE.rglob("*.py"):
        if path.name == "__main__.py":
            continue
        tree = ast.parse(path.read_text())
        assert ast.get_docstring(tree), f"{path.relative_to(PACKAGE)} has no docstring"
        lines = len(path.read_text().splitlines())
        assert lines <= MAX_LINES, f"{path.relative_to(PACKAGE)} has {lines} lines"


NO_TORCH = """
import importlib, pkgutil, sys
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "numpy"):
            raise ImportError(f"{name} imported")
sys.meta_path.insert(0, Refuse())
import meshws.mesh
for info in pkgutil.walk_packages(meshws.mesh.__path__, "meshws.mesh."):
    importlib.import_module(info.name)
print("imported", info.name)
"""


def test_the_mesh_reads_and_passes_frames_without_torch():
    """architecture.md's rule: `mesh/` (links, frames, the shard service) imports no torch or numpy, so the wire
    can be read, checked and relayed by a process that has neither. Every module is imported with both refused."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "imported meshws.mesh." in done.stdout
    sampling = NO_TORCH.replace("import meshws.mesh\n", "import meshws.model.text.sampling\nimport meshws.mesh\n")
    refused = subprocess.run([sys.executable, "-c", sampling], capture_output=True, text=True, timeout=120)
    assert "torch imported" in refused.stderr  # the refusal works: the tail's sampling does need torch


def positional_wire_builds(paths) -> list[str]:
    """Calls that build a wire message (a dataclass of `mesh.wire`) with positional arguments, outside `mesh/wire/`:
    a field added in the middle of a message would shift them silently."""
    import dataclasses

    from meshws.mesh import wire

    messages = {name for name in dir(wire) if dataclasses.is_dataclass(getattr(wire, name))}
    found = []
    for path in paths:
        if path.is_relative_to(PACKAGE / "mesh" / "wire"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args:
                name = getattr(node.func, "id", None) or getattr(node.func, "attr", None)
                if name in messages:
                    found.append(f"{path.name}:{node.lineno} {name}")
    return found


def test_wire_messages_are_built_by_field_name(tmp_path):
    assert positional_wire_builds(PACKAGE.rglob("*.py")) == []
    bad = tmp_path / "bad.py"
    bad.write_text("from meshws.mesh.wire import Close, Error\nClose('s')\nError(message='m')\n")
    assert positional_wire_builds([bad]) == ["bad.py:2 Close"]


MARKS = ('b"data: ', 'event: {', 'b": ping', "data: [DONE]")  # how an SSE line is written


def test_one_module_frames_server_sent_events():
    """Every stream's `data:` and `event:` lines, pings and [DONE] are written by `api/sse.py` alone."""
    framing = [str(path.relative_to(PACKAGE)) for path in (PACKAGE / "api").glob("*.py")
               if path.name != "sse.py" and any(mark in path.read_text() for mark in MARKS)]
    assert framing == []
    assert all(mark in (PACKAGE / "api" / "sse.py").read_text() for mark in MARKS)
