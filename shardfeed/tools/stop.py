"""``shardfeed stop``: stop this node's shardfeed services (``shardfeed ps`` lists them):
SIGTERM, so each drains the batches it is sending, then waits for it to exit."""

from __future__ import annotations

import argparse

from shardfeed import node


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pids", metavar="PID", type=int, nargs="*",
                        help="the services to stop (default: the node service)")
    parser.add_argument("--all", action="store_true", help="stop every shardfeed service of this node")
    parser.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                        help="how long each has to drain and exit (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    services = node.services()
    if args.all:
        chosen = services
    elif args.pids:
        by_pid = {record.pid: record for record in services}
        unknown = [pid for pid in args.pids if pid not in by_pid]
        if unknown:
            raise LookupError(f"no shardfeed service with pid {', '.join(map(str, unknown))} on this node "
                              "(`shardfeed ps` lists them)")
        chosen = [by_pid[pid] for pid in args.pids]
    else:
        chosen = [record for record in services if record.node]
        if not chosen:
            print("no node service runs on this node")
            return 0
    stuck = []
    for record in chosen:
        if node.stop_service(record, args.timeout):
            print(f"stopped {record.pid} ({record.url})")
        else:
            stuck.append(record.pid)
    if stuck:
        raise TimeoutError(f"pid {', '.join(map(str, stuck))} did not exit within {args.timeout:g} s")
    return 0
