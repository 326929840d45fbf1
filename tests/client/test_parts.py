"""A mixed batch as one request per owner (client/base.py ``PartsRequest``): several datasets'
parts in one ``POST /v1/batch``, its answer an Arrow stream per part read from one buffer; the
Batch byte for byte the one a request per dataset reads, the service counting each part under its
stream, with one service and with ``serve --workers 2``; a service that predates parts (a relay
in front of the real service answers as one did) asked a request per dataset from then on."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shardfeed.client import AsyncClient, Client
from shardfeed.client.base import MAX_PARTS, PartsRequest, Pick, grouped
from shardfeed.client.errors import ShardfeedConnectionError, ShardfeedError, ShardfeedHTTPError
from shardfeed.client.layout import ABSENT, Columns
from shardfeed.client.tensors import Batch
from shardfeed.process import start_service
from shardfeed.retry import Backoff

from common.httpserver import LocalServer, QuietHandler
from common.synthetic import expected, seed_synthetic
from common.wait import wait_until

SIZES = {"web": 400, "books": 40, "code": 40}
FIELDS = ["bin", "cls"]
ONE_TRY = Backoff(attempts=1)
PICKS = [Pick("web", [5, 399, 0, 250, 120], [0, 2, 4, 6, 8], FIELDS, "web"),
         Pick("books", [7, 1, 39], [1, 3, 5], FIELDS, "books"),
         Pick("code", [3], [7], None, "code"),
         Pick("other", [0, 19], [9, 10], ["bin", "json"], "other")]
"""A batch of 11 from four datasets, their fields not all alike (``other`` has no ``cls``)."""
OLD_REFUSAL = ("invalid request: dataset: Field required; indices: Field required; "
               "parts: Extra inputs are not permitted")
"""What a service that predates parts answered (400 ``invalid_request``) to a body of parts."""


@pytest.fixture(scope="module", params=[1, 2], ids=["one-service", "two-workers"])
def service(request, tmp_path_factory):
    """A service of the three streams' datasets and ``other`` (fields bin and json), with one
    worker or two (then once each dataset's routing table lists both)."""
    root = tmp_path_factory.mktemp("parts")
    urls = {name: seed_synthetic(root / name, samples=n) for name, n in SIZES.items()}
    urls["other"] = seed_synthetic(root / "other", samples=20, fields=("bin", "json"))
    with start_service(urls, cache_dir=root / "cache", workers=request.param) as svc:
        if request.param == 2:
            with Client(svc.url) as client:
                def both_listed() -> bool:
                    client.router.load("web", client._routing_table("web"))
                    return len({p.owner for p in client.router.split("web", list(range(400)))}) == 2

                wait_until(both_listed, 60, "the routing table listing both workers")
        yield svc


def as_rows(batch: Batch) -> list[dict]:
    """Each sample of a batch as plain bytes, its key and index."""
    return [{k: v if k.startswith("__") else bytes(v.numpy()) for k, v in s.items()} for s in batch]


def metric(url: str, name: str, **labels: str) -> Counter:
    """``name``'s samples from /metrics whose labels include ``labels``, by their other labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return Counter({tuple(sorted((k, v) for k, v in s.labels.items() if k not in labels)): s.value
                    for family in text_string_to_metric_families(text) for s in family.samples
                    if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())})


def batch_requests(url: str) -> float:
    return sum(metric(url, "shardfeed_requests_total", route="batch").values())


def by_stream(url: str) -> Counter:
    return metric(url, "shardfeed_stream_samples_served_total") + metric(url, "shardfeed_stream_bytes_served_total")


def test_an_answer_of_parts_is_read_stream_after_stream(service):
    """Plain Arrow answers put one after the other (a parts answer is exactly that) read as one."""
    asked = [("web", [5, 399, 0], FIELDS), ("books", [7, 1], FIELDS), ("other", [19], ["bin", "json"])]
    answers = [httpx.post(f"{service.url}/v1/batch", json={"dataset": d, "indices": i, "fields": f, "format": "arrow"},
                          timeout=30).content for d, i, f in asked]
    body = memoryview(b"".join(answers))
    columns = Columns.of_arrows(body, [i for _, i, _ in asked], "test")
    starts = np.cumsum([0, *map(len, answers)]).tolist()
    for (_, indices, _), answer, start, rows in zip(asked, answers, starts, [slice(0, 3), slice(3, 5), slice(5, 6)]):
        alone = Columns.of_arrow(memoryview(answer), indices, "test")
        assert columns.keys[rows] == alone.keys and columns.indices[rows].tolist() == indices
        for name, offsets in alone.offsets.items():
            assert (columns.offsets[name][rows] == offsets + start).all()
            assert (columns.lengths[name][rows] == alone.lengths[name]).all()
    assert (columns.lengths["json"][:5] == ABSENT).all() and (columns.lengths["cls"][5:] == ABSENT).all()
    for i, key in zip(columns.indices.tolist(), columns.keys):
        assert key == expected(i)["__key__"]
    with pytest.raises(ShardfeedConnectionError, match="without its end-of-stream marker"):
        Columns.of_arrows(body[:starts[2] + 100], [i for _, i, _ in asked], "test")
    with pytest.raises(ShardfeedError, match="8 bytes after its 3 Arrow streams"):
        Columns.of_arrows(memoryview(bytes(body) + bytes(8)), [i for _, i, _ in asked], "test")


def test_a_mixed_batch_goes_to_each_owner_in_one_request_as_the_same_batch(service):
    with Client(service.url, backoff=ONE_TRY) as client, Client(service.url, backoff=ONE_TRY) as alone:
        alone.parts = False
        requests = client._picked(PICKS, False, whole=True)
        owners = len({r.part.owner for r in requests})
        one_each = grouped(client, requests)  # an owner of one dataset's part keeps its plain request
        assert len(requests) > len(one_each) == owners and PartsRequest in map(type, one_each)
        before, streams = batch_requests(service.url), by_stream(service.url)
        got = client.get_mixed_batch(PICKS, output="tensors")
        assert batch_requests(service.url) - before == owners
        served = by_stream(service.url) - streams
        before, streams = batch_requests(service.url), by_stream(service.url)
        want = alone.get_mixed_batch(PICKS, output="tensors")
        assert batch_requests(service.url) - before == len(requests)
        assert by_stream(service.url) - streams == served  # each part counted under its stream, as alone
        assert client.parts
    assert as_rows(got) == as_rows(want) and got.fields == want.fields == ["bin", "cls", "json"]
    assert got.keys == want.keys and got.indices.tolist() == want.indices.tolist() == [
        5, 7, 399, 1, 0, 39, 250, 3, 120, 0, 19]
    for name in got.fields:
        assert got[name].lengths.tolist() == want[name].lengths.tolist()
    for sample in as_rows(got):  # every dataset is seeded alike: sample i of each has the same bytes
        assert sample == expected(sample["__index__"], [k for k in sample if not k.startswith("__")])
    assert int((got["bin"].offsets + got["bin"].lengths).max()) <= got.buffer.numel()

    async def read() -> Batch:
        async with AsyncClient(service.url, backoff=ONE_TRY) as aclient:
            return await aclient.get_mixed_batch(PICKS, output="tensors")

    assert as_rows(asyncio.run(read())) == as_rows(want)


def test_an_owner_of_more_than_max_parts_gets_several_requests(service):
    picks = [Pick("books", [k % 40], [k], FIELDS, "books") for k in range(MAX_PARTS + 3)]
    with Client(service.url, backoff=ONE_TRY) as client:
        requests = client._picked(picks, False, whole=True)
        sizes = [len(r.requests) if isinstance(r, PartsRequest) else 1 for r in grouped(client, requests)]
        assert sorted(sizes, reverse=True)[0] <= MAX_PARTS and sum(sizes) == MAX_PARTS + 3
        batch = client.get_mixed_batch(picks, output="tensors")
        assert batch.indices.tolist() == [k % 40 for k in range(MAX_PARTS + 3)]
        assert [bytes(v.numpy()) for v in batch["bin"]] == [expected(k % 40)["bin"] for k in range(MAX_PARTS + 3)]


def test_a_parts_error_names_its_part_and_is_not_taken_for_a_refusal(service):
    picks = [PICKS[0], Pick("books", [7, 99], [1, 3], FIELDS, "books")]
    # Unrouted, every part goes in one request; routed, the failing part may be an owner's only
    # part, sent as a plain batch (``grouped``), whose error names the dataset as a plain one does.
    with Client(service.url, backoff=ONE_TRY, route=False) as client:
        with pytest.raises(ShardfeedHTTPError, match=r"part 1 \(dataset 'books'\).*sample 99 is out of range") as error:
            client.get_mixed_batch(picks, output="tensors")
        assert (error.value.status, error.value.code) == (404, "sample_out_of_range")  # a plain batch's
        assert client.parts  # a service that knows parts: not asked a request per dataset
    with Client(service.url, backoff=ONE_TRY) as client:
        with pytest.raises(ShardfeedHTTPError, match=r"sample 99 is out of range: dataset 'books' has 40") as error:
            client.get_mixed_batch(picks, output="tensors")
        assert (error.value.status, error.value.code) == (404, "sample_out_of_range") and client.parts


class OldService(LocalServer):
    """A real HTTP server in front of the service answering a body of ``parts`` as a service that
    predates them did, everything else with the service's answer; records what each batch asked."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.asked: list[list[str]] = []
        super().__init__(_OldHandler)


class _OldHandler(QuietHandler):
    def do_GET(self) -> None:
        answer = httpx.get(self.server.upstream + self.path)
        self.send(answer.status_code, answer.headers, answer.content)

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        asked = json.loads(body)
        self.server.asked.append([p["dataset"] for p in asked["parts"]] if "parts" in asked else [asked["dataset"]])
        if "parts" in asked:
            error = {"error": {"code": "invalid_request", "message": OLD_REFUSAL}}
            self.send(400, {"content-type": "application/json"}, json.dumps(error).encode())
            return
        answer = httpx.post(self.server.upstream + self.path, content=body,
                            headers={"Content-Type": "application/json"}, timeout=30)
        self.send(answer.status_code, answer.headers, answer.content)

    def send(self, status: int, headers, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", headers.get("content-type", ""))
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.mark.parametrize("client_kind", ["sync", "async"])
def test_a_service_that_predates_parts_is_asked_a_request_per_dataset_from_then_on(service, client_kind):
    old = OldService(service.url)
    try:
        with Client(service.url, backoff=ONE_TRY) as direct:
            want = as_rows(direct.get_mixed_batch(PICKS, output="tensors"))
        if client_kind == "sync":
            with Client(old.url, backoff=ONE_TRY, route=False) as client:
                got = [client.get_mixed_batch(PICKS, output="tensors") for _ in range(2)]
                assert not client.parts
        else:
            async def read() -> list[Batch]:
                async with AsyncClient(old.url, backoff=ONE_TRY, route=False) as client:
                    batches = [await client.get_mixed_batch(PICKS, output="tensors") for _ in range(2)]
                    assert not client.parts
                    return batches

            got = asyncio.run(read())
        assert [as_rows(b) for b in got] == [want, want]
        datasets = [p.dataset for p in PICKS]
        # refused once (with one worker reached through the relay: one owner), then a request per dataset
        assert old.asked[0] == datasets
        assert sorted(map(tuple, old.asked[1:])) == sorted([(d,) for d in datasets] * 2)
    finally:
        old.shutdown()
