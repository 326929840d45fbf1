"""``shardfeed ps``: the shardfeed services running on this node, from the run directory
(``shardfeed/node.py``): each one's pid, URL, age, role and log."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict

from shardfeed import node


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per service, its address file whole (the node service's token too)")


def run(args: argparse.Namespace) -> int:
    services = node.services()
    if args.json:
        for record in services:
            print(json.dumps(asdict(record)))
        return 0
    if not services:
        print(f"no shardfeed service runs on this node (run directory {node.run_dir()})")
        return 0
    rows = [("PID", "URL", "UP", "ROLE", "IDLE EXIT", "LOG")]
    for record in services:
        rows.append((str(record.pid), record.url, _age(time.time() - record.started),
                     "node" if record.node else "serve", _age(record.idle_exit) if record.idle_exit else "never",
                     record.log or "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[-1])
    return 0


def _age(seconds: float) -> str:
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
