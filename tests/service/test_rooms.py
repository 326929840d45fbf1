"""The service's layout: rooms in one order, every import pointing down (or within its room),
each room saying what it is for and what it may import, no module too long to read."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from common import REPO

SERVICE = REPO / "service"
ORDER = ["server", "api", "plans", "read", "cluster", "datasets", "cache", "stores", "observe", "http", "config"]
"""Rooms from the top (the entry) down; a room may import only rooms after it."""
SHARED = ("shardfeed.tar", "shardfeed.retry", "shardfeed.sizes", "shardfeed.node", "shardfeed.http11")
"""Low modules outside the service that any room may import."""
MAX_LINES = 400


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


def test_the_service_has_twelve_entries_or_fewer_and_every_room_is_ordered():
    entries = {p.stem for p in SERVICE.iterdir() if p.name != "__pycache__"}
    assert len(entries) <= 12, sorted(entries)
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


def test_no_module_is_longer_than_four_hundred_lines():
    lengths = {str(p.relative_to(SERVICE)): len(p.read_text().splitlines()) for p in SERVICE.rglob("*.py")}
    assert {path: n for path, n in lengths.items() if n > MAX_LINES} == {}
