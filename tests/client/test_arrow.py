"""Arrow answers on the client (client/layout.py, client/arrow.py): tensor batches and
``get_batch_arrow`` tables byte-exact against the shards as ``tarfile`` wrote them, zero-copy
into pyarrow.compute and Polars, a cut answer asked for again, and tar from a service that
refuses the format. A relay in front of the real service cuts or refuses answers."""

from __future__ import annotations

import asyncio
import json
import os
import pickle
import shutil
import sys
from multiprocessing.reduction import ForkingPickler

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
import torch
from torch.utils.data import DataLoader

from shardfeed.client import AsyncClient, Client, shm
from shardfeed.client.arrow import as_binary_views
from shardfeed.client.layout import Columns
from shardfeed.client.tensors import Batch
from shardfeed.client.torch import ShardfeedDataset, ShardfeedIterableDataset, ShardfeedLoader
from shardfeed.process import start_service
from shardfeed.retry import Backoff

from common.datasets import odd_tar_dataset
from common.httpserver import LocalServer, QuietHandler
from common.workers import routed_client

SAMPLES = 60
ONE_TRY = Backoff(attempts=1)
FIELDS = ["bin", "cls", "seg.png"]


@pytest.fixture(scope="module")
def odd(tmp_path_factory):
    """A service of the odd dataset as "train", and as "broken" with its second shard cut short
    (its samples unreadable: missing with continue_on_error); the bytes as written."""
    root = tmp_path_factory.mktemp("arrow")
    url, source = odd_tar_dataset(root / "data", SAMPLES)
    shutil.copytree(root / "data", root / "broken")
    os.truncate(root / "broken" / "shard-1.tar", 1000)
    datasets = {"train": url, "broken": (root / "broken").as_uri()}
    with start_service(datasets, cache_dir=root / "cache", args=["--block-size", "64KiB"]) as svc:
        yield svc, source


def written(source: dict, indices: list[int], fields: list[str] | None, gone: set[int] = frozenset()) -> list[dict]:
    """The samples as ``tarfile`` wrote them: ``{"__key__", "__index__", field: bytes}`` (``__key__``
    None and no fields for a sample in ``gone``, or lacking one of the ``fields`` named: the service
    cannot serve it, with ``continue_on_error``)."""
    out = []
    for i in indices:
        if i in gone or any((i, f) not in source for f in fields or ()):
            out.append({"__key__": None, "__index__": i})
            continue
        members = {f: source[(i, f)][1] for f in (fields or FIELDS) if (i, f) in source}
        out.append({"__key__": source[(i, "cls")][0][:-len(".cls")], "__index__": i, **members})
    return out


def of_table(table: pa.Table) -> list[dict]:
    return [{k: v for k, v in row.items() if v is not None or k == "__key__"} for row in table.to_pylist()]


def of_batch(batch: Batch) -> list[dict]:
    return [{k: bytes(v.numpy()) if torch.is_tensor(v) else v for k, v in s.items() if k != "__missing__"}
            for s in batch]


def test_tensor_batches_and_tables_are_byte_exact_against_the_shards_cold_warm_and_missing(odd):
    svc, source = odd
    rng = np.random.default_rng(0)
    broken = set(range(SAMPLES // 2, SAMPLES))  # the cut shard's samples
    with Client(svc.url, backoff=ONE_TRY) as client:
        for fields in (None, ["seg.png", "bin"], ["cls"]):
            for _ in range(2):  # cold (streamed), then warm (held, a known length)
                indices = rng.integers(0, SAMPLES, 40).tolist() + [5, 5, 5]
                want = written(source, indices, fields)
                batch = client.get_batch_tensors("train", indices, fields, continue_on_error=True)
                assert of_batch(batch) == want and batch.indices.tolist() == indices
                assert of_table(client.get_batch_arrow("train", indices, fields, continue_on_error=True)) == want
        indices = [0, SAMPLES - 1, 1, SAMPLES - 2, 0]
        want = written(source, indices, None, broken)
        batch = client.get_batch_tensors("broken", indices, continue_on_error=True)
        assert of_batch(batch) == want and batch.missing.tolist() == [False, True, False, True, False]
        table = client.get_batch_arrow("broken", indices, continue_on_error=True)
        assert of_table(table) == want and table["__key__"].null_count == 2
        assert client.arrow  # the service took the format


def test_a_tables_columns_are_views_of_the_answer_into_compute_and_polars(odd):
    svc, source = odd
    indices = list(range(0, SAMPLES, 2))
    with Client(svc.url, backoff=ONE_TRY) as client:
        client.get_batch_arrow("train", [1])  # once-per-process costs first: imports, the routing table
        allocated = pa.total_allocated_bytes()
        table = client.get_batch_arrow("train", indices)
        assert pa.total_allocated_bytes() - allocated < 4096  # pyarrow allocated no sample's bytes
    column = table["bin"].chunk(0)
    data = column.buffers()[2]
    sizes = pc.binary_length(table["bin"]).to_pylist()
    assert sizes == [len(source[(i, "bin")][1]) for i in indices]
    assert pc.max(pc.binary_length(table["bin"])).as_py() == max(sizes)
    polars = pytest.importorskip("polars")
    frame = polars.from_arrow(as_binary_views(table))
    assert frame["bin"].to_list() == [source[(i, "bin")][1] for i in indices]
    back = frame.to_arrow(compat_level=polars.CompatLevel.newest())["bin"].chunk(0)
    # Every sample longer than a view's 12 inline bytes points into the table's own data buffer.
    assert {b.address for b in back.buffers()[2:]} == {data.address}


def test_a_tensor_batch_from_arrow_lies_one_sample_after_another(odd):
    svc, source = odd
    with Client(svc.url, backoff=ONE_TRY) as client:
        indices = [4, 8, 12, 16]
        column = client.get_batch_tensors("train", indices, ["seg.png"])["seg.png"]
        assert (column.offsets.diff() == 300).all()  # no headers between: a view as rows
        assert [bytes(r.numpy()) for r in column.stacked()] == [source[(i, "seg.png")][1] for i in indices]
        words = column.view(torch.int32)
        assert [bytes(w.numpy()) for w in words] == [source[(i, "seg.png")][1] for i in indices]


def mapped_file(address: int) -> str:
    """The file mapped at ``address`` in this process ("" for anonymous memory)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *rest = line.split(maxsplit=5)
            start, end = (int(a, 16) for a in span.split("-"))
            if start <= address < end:
                return rest[4].strip() if len(rest) > 4 else ""
    return ""


class Relay(LocalServer):
    """A real HTTP server in front of the service: answers POST /v1/batch with the service's
    answer, the first ``cut`` of them cut short (half its body, then the connection drops), or
    400 ``unsupported_format`` to a request for Arrow when ``refuse``; records each request's format."""

    def __init__(self, upstream: str, cut: int = 0, refuse: bool = False):
        self.upstream, self.cut, self.refuse = upstream, cut, refuse
        self.formats: list[str] = []
        super().__init__(_Relayed)


class _Relayed(QuietHandler):
    def do_GET(self) -> None:
        answer = httpx.get(self.server.upstream + self.path)
        self.send(answer.status_code, answer.headers.get("content-type", ""), answer.content)

    def do_POST(self) -> None:
        relay = self.server
        body = self.rfile.read(int(self.headers["Content-Length"]))
        relay.formats.append(json.loads(body)["format"])
        if relay.refuse and relay.formats[-1] == "arrow":
            error = {"error": {"code": "unsupported_format", "message": "format 'arrow' is not supported"}}
            self.send(400, "application/json", json.dumps(error).encode())
            return
        answer = httpx.post(self.server.upstream + self.path, content=body,
                            headers={"Content-Type": "application/json"}, timeout=30)
        cut = len(relay.formats) <= relay.cut
        self.send(answer.status_code, answer.headers.get("content-type", ""), answer.content, cut)

    def send(self, status: int, media: str, data: bytes, cut: bool = False) -> None:
        self.send_response(status)
        self.send_header("Content-Type", media)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[:len(data) // 2] if cut else data)
        if cut:
            self.wfile.flush()
            self.close_connection = True


def test_a_cut_answer_is_asked_for_again_whole(odd):
    svc, source = odd
    indices = [3, 1, 4, 1, 5, 9, 2, 6]
    want = written(source, indices, None)
    for get in ("get_batch_tensors", "get_batch_arrow"):
        relay = Relay(svc.url, cut=1)
        try:
            with Client(relay.url, backoff=Backoff(attempts=3, base=0.01), route=False) as client:
                got = getattr(client, get)("train", indices)
            assert (of_batch(got) if get == "get_batch_tensors" else of_table(got)) == want
            assert relay.formats == ["arrow", "arrow"]
        finally:
            relay.shutdown()


def test_a_service_that_refuses_the_format_is_asked_for_tar_from_then_on(odd):
    svc, source = odd
    indices = [7, 0, 7, 12]
    want = written(source, indices, None)
    relay = Relay(svc.url, refuse=True)
    try:
        with Client(relay.url, backoff=ONE_TRY, route=False) as client:
            assert of_batch(client.get_batch_tensors("train", indices)) == want
            assert of_table(client.get_batch_arrow("train", indices)) == want  # built from the tar: a copy
            assert of_batch(client.get_batch_tensors("train", indices)) == want
            assert not client.arrow
        assert relay.formats == ["arrow", "tar", "tar", "tar"]  # refused once, then never asked again

        async def main():
            async with AsyncClient(relay.url, backoff=ONE_TRY, route=False) as aclient:
                return await aclient.get_batch_tensors("train", indices), await aclient.get_batch_arrow("train", indices)

        batch, table = asyncio.run(main())
        assert of_batch(batch) == want and of_table(table) == want
        assert relay.formats[4:] == ["arrow", "tar", "tar"]
    finally:
        relay.shutdown()


def test_a_client_told_batch_format_tar_asks_for_tar_and_a_wrong_format_is_refused(odd):
    svc, source = odd
    indices = [2, 9, 2]
    relay = Relay(svc.url)
    try:
        with Client(relay.url, backoff=ONE_TRY, route=False, batch_format="tar") as client:
            assert of_batch(client.get_batch_tensors("train", indices)) == written(source, indices, None)
            assert of_table(client.get_batch_arrow("train", indices)) == written(source, indices, None)
        assert relay.formats == ["tar", "tar"]
    finally:
        relay.shutdown()
    with pytest.raises(ValueError, match="batch_format must be 'arrow' or 'tar', not 'parquet'"):
        Client(svc.url, batch_format="parquet")


def test_the_async_client_reads_the_same_batches(odd):
    svc, source = odd
    indices = [9, 8, 9, 0, 59]

    async def main():
        async with AsyncClient(svc.url, backoff=ONE_TRY) as client:
            return (await client.get_batch_tensors("train", indices, ["cls", "bin"]),
                    await client.get_batch_arrow("train", indices, ["cls", "bin"]))

    batch, table = asyncio.run(main())
    want = written(source, indices, ["cls", "bin"])
    assert of_batch(batch) == want and of_table(table) == want
    assert table.column_names == ["__key__", "__index__", "cls", "bin"]


def test_without_pyarrow_the_error_says_how_to_get_it(odd, monkeypatch):
    svc, _ = odd
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    with pytest.raises(ImportError, match="pip install pyarrow"):
        Client(svc.url).get_batch_arrow("train", [1])


def test_an_arrow_answer_that_is_not_the_batch_asked_for_is_refused():
    sink = pa.BufferOutputStream()
    table = pa.table({"__key__": pa.array(["a"], pa.large_utf8()), "__index__": pa.array([3], pa.int64()),
                      "cls": pa.array([b"1"], pa.large_binary())})
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = memoryview(sink.getvalue().to_pybytes())
    assert Columns.of_arrow(data, [3], "u").keys == ["a"]
    with pytest.raises(Exception, match="not those asked for"):
        Columns.of_arrow(data, [4], "u")
    with pytest.raises(Exception, match="ended after 1 of 2 samples"):
        Columns.of_arrow(data, [3, 4], "u")
    with pytest.raises(Exception, match="without its end-of-stream marker"):
        Columns.of_arrow(data[:-8], [3], "u")


@pytest.mark.slow
def test_a_routed_batch_comes_back_in_order_as_tensors_and_as_a_table_of_slices(tmp_path):
    with routed_client(tmp_path, backoff=ONE_TRY) as client:
        indices = list(range(3, 1000, 7))[::-1] + [10, 11, 12, 10]
        assert len({part.owner for part in client.router.split("train", indices)}) == 2
        samples = client.get_batch("train", indices)
        want = [{k: v for k, v in s.items()} for s in samples]
        batch = client.get_batch_tensors("train", indices, shared=True)
        table = client.get_batch_arrow("train", indices)
        assert of_batch(batch) == want and of_table(table) == want
        assert table["bin"].num_chunks > 1  # slices of the parts' tables, in order

        async def main():
            async with AsyncClient(client.urls, backoff=ONE_TRY) as aclient:
                return (await aclient.get_batch_tensors("train", indices),
                        await aclient.get_batch_arrow("train", indices))

        batch, table = asyncio.run(main())
        assert of_batch(batch) == want and of_table(table) == want
        assert client.arrow


def test_a_pooled_table_is_sent_to_another_process_as_its_segments_name(odd):
    svc, source = odd
    indices = [3, 1, 3, 40]
    with Client(svc.url, backoff=ONE_TRY) as client:
        table = client.get_batch_arrow("train", indices, shared=True)
        sent = ForkingPickler.dumps(table)  # as a DataLoader worker sends it
        assert len(sent) < 2000
        again = ForkingPickler.dumps(table)  # sent before: the receiver's flag has one writer
        assert len(again) > sum(len(source[(i, "bin")][1]) for i in indices)
        received = pickle.loads(sent)
        assert of_table(received) == of_table(table) == written(source, indices, None)


@pytest.mark.parametrize("style", ["map", "iterable"])
def test_tables_come_through_dataloader_workers_in_shared_memory(odd, style):
    svc, source = odd
    client = Client(svc.url, backoff=ONE_TRY)
    if style == "map":
        ds = ShardfeedDataset(client, "train", output="arrow", fields=["bin", "cls"])
        loader = DataLoader(ds, batch_size=8, num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(0))
    else:
        ds = ShardfeedIterableDataset(client, "train", batch_size=8, output="arrow", fields=["bin", "cls"], seed=1)
        loader = ShardfeedLoader(ds, num_workers=2)
    tables = list(loader)
    assert all(isinstance(t, pa.Table) for t in tables)
    order = [i for t in tables for i in t["__index__"].to_pylist()]
    assert sorted(order) == list(range(SAMPLES)) if style == "map" else len(order) >= SAMPLES
    for table in tables:
        assert of_table(table) == written(source, table["__index__"].to_pylist(), ["bin", "cls"])
        assert shm.PREFIX in mapped_file(table["bin"].chunk(0).buffers()[2].address)  # sent by name, mapped here
    if style == "map":
        assert of_table(ds[7]) == written(source, [7], ["bin", "cls"])
