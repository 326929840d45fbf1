"""The service's layout: rooms in one order, every import pointing down (or within its room),
each room saying what it is for and what it may import, and no room setting up a lower room's
objects after they are built (policies are given to their constructors)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from common import REPO

SERVICE = REPO / "service"
ORDER = ["server", "api", "transform", "plans", "read", "cluster", "datasets", "cache", "stores", "observe", "http", "config"]
"""Rooms from the top (the entry) down; a room may import only rooms after it."""
SHARED = ("shardfeed.tar", "shardfeed.arrowipc", "shardfeed.buffers", "shardfeed.transforms", "shardfeed.retry", "shardfeed.sizes", "shardfeed.node", "shardfeed.http11")
"""Low modules outside the service that any room may import."""


def room_of(module: str) -> str:
    parts = module.split(".")
    assert parts[:2] == ["shardfeed", "service"], module
    return parts[2] if len(parts) > 2 else "__init__"


def modules() -> list[tuple[Path, str]]:
    out = []
    for path in sorted(SERVICE.rglob("*.py")):
        rel = path.relative_to(SERVICE).with_suffix("").parts
        out.append((path, ".".join(("shardfeed", "service", *(p for p in rel if p != "__init__")))))
    return out


def imports(path: Path, module: str) -> list[str]:
    """Every ``shardfeed`` module ``path`` imports, relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            out.append(target)
        elif isinstance(node, ast.Import):
            out += [alias.name for alias in node.names]
    return [m for m in out if m.split(".")[0] == "shardfeed"]


def test_the_service_has_thirteen_entries_or_fewer_and_every_room_is_ordered():
    entries = {p.stem for p in SERVICE.iterdir() if p.name != "__pycache__"}
    assert len(entries) <= 13, sorted(entries)
    assert entries - {"__init__"} == set(ORDER)


def violations(path: Path, module: str) -> list[str]:
    room = room_of(module)
    out = []
    for target in imports(path, module):
        if target.startswith("shardfeed.service."):
            other = room_of(target)
            if other != room and ORDER.index(other) < ORDER.index(room):
                out.append(f"{module} imports {target}: {other}/ is not below {room}/")
        elif target == "shardfeed.client.sampling":
            if room != "plans":
                out.append(f"{module} imports the client's sampler; only plans/ shares it")
        elif target.startswith("shardfeed.seeds."):
            if room != "server":
                out.append(f"{module} imports {target}: only the entry seeds the embedded default")
        elif not target.startswith(SHARED):
            out.append(f"{module} imports {target}: not a room below it nor shared")
    return out


def test_every_import_points_down():
    assert [v for path, module in modules() for v in violations(path, module)] == []


def test_every_room_says_what_it_is_for_and_what_it_may_import():
    for room in ORDER:
        init = SERVICE / room / "__init__.py"
        if not init.parent.is_dir():
            continue
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "May import" in doc, f"{room}/__init__.py names no imports it may make"
        for module in init.parent.glob("*.py"):
            if module.name != "__init__.py":
                assert re.search(rf"\b{module.stem}\b", doc), f"{room}/__init__.py does not mention {module.name}"


def declared_attributes(path: Path) -> set[str]:
    """The attributes the classes of ``path`` declare: ``self.x = ...`` in their methods and
    annotated fields in their bodies (dataclasses)."""
    out = set()
    for cls in (n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out.add(node.target.id)
            for target in assigned(node):
                if isinstance(target.value, ast.Name) and target.value.id == "self":
                    out.add(target.attr)
    return out


def assigned(node: ast.AST) -> list[ast.Attribute]:
    """The attributes an assignment statement sets (``a.b = ...``, ``a.b += ...``)."""
    targets = node.targets if isinstance(node, ast.Assign) else \
        [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
    return [t for target in targets for t in ast.walk(target) if isinstance(t, ast.Attribute)
            and isinstance(t.ctx, ast.Store)]


def test_no_room_sets_an_attribute_of_a_lower_rooms_object():
    """Wiring through constructors: an upper room passes its policies (fetch policy, eviction
    order, change listener, store wrap) when it builds a lower room's object, never assigns them
    afterwards, where the import check cannot see a lower room calling up."""
    rooms = {room: set().union(*(declared_attributes(p) for p, m in modules() if room_of(m) == room))
             for room in ORDER}
    out = []
    for path, module in modules():
        room = room_of(module)
        if room == "__init__":
            continue
        lower = set().union(*(rooms[r] for r in ORDER[ORDER.index(room) + 1:])) - rooms[room]
        for node in ast.walk(ast.parse(path.read_text())):
            for target in assigned(node):
                # An object named (not an item of a container: a library's, such as prometheus' families).
                if isinstance(target.value, (ast.Name, ast.Attribute)) and ast.unparse(target.value) != "self" \
                        and target.attr in lower:
                    out.append(f"{module}:{node.lineno} sets {ast.unparse(target)}")
    assert out == []
