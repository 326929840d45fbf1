"""A dataset URL alone: the client finds the node's service through the run directory, or
starts it (``client/node.py``, ``shardfeed/node.py``); ``shardfeed ps`` and ``stop``;
``--idle-exit``. Real processes throughout: the service a client starts is the one a user's
training script would get."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from shardfeed import node
from shardfeed.client.node import ServiceStartError, dataset_name
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset

from common.cli import fails, ok
from common.datasets import dir_put, make_dataset

SAMPLES = 120


@pytest.fixture(scope="module")
def unindexed(tmp_path_factory):
    """A directory of WebDataset tar shards with no index.parquet: the URL a user has."""
    root = tmp_path_factory.mktemp("unindexed")
    source = make_dataset(dir_put(root), samples=SAMPLES, per_shard=30, sizes=(100, 3000))
    (root / "index.parquet").unlink()
    return root, source


@pytest.fixture
def run_dir(tmp_path, monkeypatch):
    """A run directory of this test's own; every service left in it is stopped afterwards."""
    run = tmp_path / "run"
    monkeypatch.setenv("SHARDFEED_RUN_DIR", str(run))
    monkeypatch.setenv("SHARDFEED_SERVE_ARGS", f"--cache-dir {tmp_path / 'cache'} --workers 1 --block-size 64KiB")
    yield run
    for record in node.services():
        if not node.stop_service(record, timeout=20):
            os.killpg(record.pid, signal.SIGKILL)


def expected(source, index):
    return {field: data for (i, field), data in source.items() if i == index}


def test_a_dataset_path_alone_starts_the_node_service_indexes_its_shards_and_reads_through_it(unindexed, run_dir):
    root, source = unindexed
    ds = ShardfeedDataset(str(root))
    assert len(ds) == SAMPLES
    for index in (0, 7, SAMPLES - 1):
        sample = ds[index]
        assert {k: v for k, v in sample.items() if not k.startswith("__")} == expected(source, index)
    batch = ds.__getitems__([5, 3, 99])
    assert [s["__index__"] for s in batch] == [5, 3, 99]
    assert (root / "index.parquet").exists()  # the prefix is writable: written beside the shards
    services = node.services()
    assert len(services) == 1 and services[0].node and services[0].token

    # The same URL, spelled otherwise, from an iterable dataset: the same service and name.
    again = ShardfeedIterableDataset(root.as_uri() + "/", batch_size=8, collate_fn=None)
    assert again.source.dataset == ds.source.dataset == dataset_name(root.as_uri())
    assert again.source.client.endpoints.urls == [services[0].url]
    assert sum(len(batch) for batch in again) == SAMPLES
    assert [r.pid for r in node.services()] == [services[0].pid]


def test_a_service_url_without_a_dataset_name_is_a_clear_error(run_dir):
    with pytest.raises(TypeError, match="service URL: name the dataset"):
        ShardfeedDataset("http://127.0.0.1:9")


RACER = textwrap.dedent("""
    import sys
    from shardfeed.client.node import node_dataset
    client, name = node_dataset(sys.argv[1], {})
    print(client.endpoints.urls[0], name, client.info(name)["samples"])
""")


def test_processes_racing_to_start_the_node_service_get_one(unindexed, run_dir):
    root, _ = unindexed
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(root)], stdout=subprocess.PIPE, text=True)
              for _ in range(4)]
    answers = {racer.communicate(timeout=120)[0].strip() for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    assert len(answers) == 1, answers
    url, _, samples = answers.pop().split()
    services = node.services()
    assert [r.url for r in services] == [url] and int(samples) == SAMPLES


def test_a_node_service_killed_with_sigkill_leaves_a_stale_address_file_that_is_replaced(unindexed, run_dir):
    root, source = unindexed
    first = ShardfeedDataset(str(root))
    killed = node.services()[0]
    os.killpg(killed.pid, signal.SIGKILL)  # its whole session: the service and any workers
    while killed.alive:
        time.sleep(0.05)
    assert node.record_path(killed.pid).exists()  # nobody removed it
    second = ShardfeedDataset(str(root))
    assert second.source.client.endpoints.urls != first.source.client.endpoints.urls
    assert {k: v for k, v in second[3].items() if not k.startswith("__")} == expected(source, 3)
    assert not node.record_path(killed.pid).exists()
    assert [r.pid for r in node.services()] != [killed.pid]


def test_a_start_that_fails_raises_one_clear_error_with_the_logs_last_line(unindexed, run_dir, monkeypatch):
    monkeypatch.setenv("SHARDFEED_SERVE_ARGS", "--cache-size lots")
    began = time.monotonic()
    with pytest.raises(ServiceStartError) as caught:
        ShardfeedDataset(str(unindexed[0]))
    message = str(caught.value)
    assert "did not start" in message and "lots" in message and str(run_dir / "node.log") in message
    assert time.monotonic() - began < 30
    assert node.services() == []


def test_a_node_service_lives_while_a_dataset_is_held_and_exits_when_idle(unindexed, run_dir, tmp_path, monkeypatch):
    # Two workers: they health-check each other every second, which is not a request.
    monkeypatch.setenv("SHARDFEED_SERVE_ARGS", f"--cache-dir {tmp_path / 'cache'} --workers 2 --idle-exit 3")
    held = ShardfeedDataset(str(unindexed[0]))
    record = node.services()[0]
    assert record.idle_exit == 3
    time.sleep(6)  # a long evaluation between epochs: the held dataset keeps its service
    assert record.alive and held[1]["__index__"] == 1
    del held
    gc.collect()
    deadline = time.monotonic() + 30
    while record.alive and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not record.alive
    assert node.services() == [] and not node.record_path(record.pid).exists()
    assert "no data request for 3 s (--idle-exit 3): exiting" in (run_dir / "node.log").read_text()


def test_ps_lists_and_stop_stops_the_nodes_services(unindexed, run_dir):
    assert "no shardfeed service runs" in ok("ps")
    ShardfeedDataset(str(unindexed[0]))
    record = node.services()[0]
    listed = ok("ps")
    assert str(record.pid) in listed and record.url in listed and "node" in listed
    assert json.loads(ok("ps", "--json"))["token"] == record.token
    assert "no shardfeed service with pid 1 " in fails("stop", "1")
    assert f"stopped {record.pid}" in ok("stop")
    assert not record.alive and node.services() == []
    assert "no node service runs" in ok("stop")


def test_a_mixture_of_dataset_urls_alone_reads_every_stream_through_the_one_node_service(unindexed, run_dir,
                                                                                        tmp_path):
    from shardfeed.client.mixing import Stream

    root, source = unindexed
    other = tmp_path / "other-set"
    other_source = make_dataset(dir_put(other), samples=40, per_shard=20, sizes=(100, 3000))
    ds = ShardfeedIterableDataset(streams=[Stream(str(root), repeat=1), Stream(other.as_uri(), choose=10)],
                                  batch_size=10, collate_fn=None)
    assert ds.source.names == [root.name, "other-set"]  # the URLs' last segments
    read = [sample for batch in ds for sample in batch]
    assert len(read) == SAMPLES + 10
    for sample in read:
        want = expected(source if sample["__stream__"] == root.name else other_source, sample["__index__"])
        assert {k: v for k, v in sample.items() if not k.startswith("__")} == want
    assert len(node.services()) == 1
