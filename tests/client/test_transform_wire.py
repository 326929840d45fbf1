"""A transform's answer on the client (client/base.py, client/tensors.py, client/transformed.py),
before any service: Arrow streams written by pyarrow laid out as the wire says (docs/http-api.md),
served by a test server, read by the real clients into ``batch.outputs`` of the declared dtypes
and shapes, fixed and varying, with missing samples; the client's own layout of the same outputs
(what a transform run in the DataLoader workers makes) is byte for byte the same."""

from __future__ import annotations

import asyncio
import json
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pyarrow as pa
import pytest
import torch

from shardfeed.client import AsyncClient, Client, ShardfeedError, ShardfeedHTTPError
from shardfeed.client.layout import Columns
from shardfeed.client.tensors import Batch
from shardfeed.client.transformed import lay_out, transformed
from shardfeed.retry import Backoff
from shardfeed.transforms import Output, Transform, TransformError, describe

from common.httpserver import LocalServer, QuietHandler


class Shapes(Transform):
    """Outputs of every kind: an image (fixed uint8), a label (0-d int64), a float pair, and a
    varying float32 ``(k, 3)`` whose ``k`` is the sample's."""

    version = "3"
    fields = ("x",)
    outputs = {"image": Output("uint8", (3, 4, 5)), "label": Output("int64", ()),
               "pair": Output("float32", (2,)), "points": Output("float32", (None, 3))}

    def prepare(self, sample):
        x = int(sample["x"])
        if x == 13:
            raise ValueError("unlucky")
        return {"x": np.array(x, np.int64)}

    def augment(self, prepared, rng):
        x = int(prepared["x"])
        return {"image": rng.integers(0, 256, (3, 4, 5), dtype=np.uint8), "label": np.array(x, np.int64),
                "pair": rng.random(2, dtype=np.float32), "points": rng.random((x % 4, 3), dtype=np.float32)}


def rows_of(indices: list[int], seed: int = 0, epoch: int = 0) -> list[dict | None]:
    """What the transform makes of samples ``indices`` (``None`` for 13, which it fails on)."""
    t = Shapes()
    samples = [{"__key__": f"s{i:03d}", "__index__": i, "x": str(i).encode()} for i in indices]
    batch = transformed(t, samples, seed, epoch, continue_on_error=True)
    return [None if batch.missing[k] else {n: np.asarray(v[k]) if torch.is_tensor(v) else v[k].numpy()
                                             for n, v in batch.outputs.items()} for k in range(len(indices))]


def arrow_answer(indices: list[int], rows: list[dict | None], chunk: int | None = None) -> bytes:
    """The wire's answer, written by pyarrow: ``__key__``, ``__index__``, then each output's raw bytes
    and, after a varying one, its ``<name>.shape`` (ndim int64 little-endian dims); a missing sample
    a row of nulls but its ``__index__``; record batches of ``chunk`` rows."""
    columns = {"__key__": pa.array([None if r is None else f"s{i:03d}" for i, r in zip(indices, rows)],
                                   pa.large_utf8()),
               "__index__": pa.array(indices, pa.int64())}
    for name, output in Shapes.outputs.items():
        columns[name] = pa.array([None if r is None else r[name].tobytes() for r in rows], pa.large_binary())
        if not output.fixed:
            columns[name + ".shape"] = pa.array([None if r is None else np.asarray(r[name].shape, "<i8").tobytes()
                                                 for r in rows], pa.large_binary())
    table = pa.table(columns)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=chunk)
    return sink.getvalue().to_pybytes()


class Answers(LocalServer):
    """Answers each POST /v1/batch with ``answer(body)``: ``(status, headers, bytes)``; keeps the bodies."""

    def __init__(self, answer):
        self.answer = answer
        self.bodies: list[dict] = []
        super().__init__(_Answering)


class _Answering(QuietHandler):
    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.bodies.append(body)
        status, headers, data = self.server.answer(body)
        self.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(data))}.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)


def transform_headers(outputs: dict | None = None) -> dict:
    return {"Content-Type": "application/vnd.apache.arrow.stream", "X-Shardfeed-Transform": "shapes;version=3",
            "X-Shardfeed-Outputs": json.dumps(outputs or describe(Shapes())["outputs"])}


def serving(chunk: int | None = None, headers: dict | None = None) -> Answers:
    def answer(body):
        indices = body["indices"]
        t = body["transform"]
        return 200, headers or transform_headers(), arrow_answer(indices, rows_of(indices, t["seed"], t["epoch"]),
                                                                 chunk)
    return Answers(answer)


def client_of(server: Answers) -> Client:
    return Client(server.url, route=False, backoff=Backoff(attempts=1))


def assert_outputs(batch: Batch, rows: list[dict | None]) -> None:
    """``batch.outputs`` are ``rows``, byte for byte, in their declared dtypes and shapes."""
    n = len(rows)
    outputs = batch.outputs
    assert outputs["image"].dtype == torch.uint8 and outputs["image"].shape == (n, 3, 4, 5)
    assert outputs["label"].dtype == torch.int64 and outputs["label"].shape == (n,)
    assert outputs["pair"].dtype == torch.float32 and outputs["pair"].shape == (n, 2)
    assert batch.missing.tolist() == [r is None for r in rows]
    for k, row in enumerate(rows):
        if row is None:
            assert not outputs["image"][k].any() and outputs["points"][k] is None
            continue
        for name in ("image", "label", "pair"):
            assert outputs[name][k].numpy().tobytes() == row[name].tobytes()
        points = outputs["points"][k]
        assert points.dtype == torch.float32 and tuple(points.shape) == row["points"].shape
        assert points.numpy().tobytes() == row["points"].tobytes()


@pytest.mark.parametrize("chunk", [None, 3])
def test_a_transforms_answer_reads_as_its_declared_outputs_fixed_varying_and_missing(chunk):
    indices = [4, 13, 7, 0, 13, 22, 5]  # 13: the transform fails on it, a missing row
    server = serving(chunk)
    try:
        with client_of(server) as client:
            batch = client.get_batch_tensors("train", indices, transform="shapes", seed=3, epoch=2,
                                             continue_on_error=True)
            whole = client.get_batch_tensors("train", [4, 7, 0], transform="shapes")
        assert server.bodies[0] == {"dataset": "train", "indices": indices, "format": "arrow",
                                    "continue_on_error": True, "transform": {"name": "shapes", "seed": 3, "epoch": 2}}
        assert_outputs(batch, rows_of(indices, 3, 2))
        assert batch.fields == ["image", "label", "pair", "points", "points.shape"]
        assert batch.keys == [None if i == 13 else f"s{i:03d}" for i in indices]
        assert batch[2]["label"].item() == 7 and batch[1]["__missing__"]  # a sample: its outputs, typed
        for name in ("image", "label", "pair"):  # in one record batch, none missing: views of the buffer
            assert whole.outputs[name].untyped_storage().data_ptr() == whole.buffer.untyped_storage().data_ptr()
    finally:
        server.shutdown()


def test_the_async_client_reads_the_same_outputs():
    indices = [1, 2, 3, 9]
    server = serving()

    async def main():
        async with AsyncClient(server.url, route=False, backoff=Backoff(attempts=1)) as client:
            return await client.get_batch_tensors("train", indices, transform="shapes", seed=1, epoch=0)

    try:
        assert_outputs(asyncio.run(main()), rows_of(indices, 1, 0))
    finally:
        server.shutdown()


def test_the_clients_own_layout_is_the_answers_byte_for_byte():
    # What a transform run in the DataLoader workers makes: the same fields, the same outputs.
    indices = [3, 13, 6, 11, 2]
    server = serving()
    try:
        with client_of(server) as client:
            answered = client.get_batch_tensors("train", indices, transform="shapes", seed=5, epoch=1,
                                                continue_on_error=True)
    finally:
        server.shutdown()
    samples = [{"__key__": f"s{i:03d}", "__index__": i, "x": str(i).encode()} for i in indices]
    local = transformed(Shapes(), samples, 5, 1, continue_on_error=True)
    assert local.fields == answered.fields and local.keys == answered.keys
    assert local.missing.tolist() == answered.missing.tolist()
    for name, output in answered.outputs.items():
        mine = local.outputs[name]
        if torch.is_tensor(output):
            assert mine.dtype == output.dtype and mine.numpy().tobytes() == output.numpy().tobytes()
        else:
            assert [None if m is None else (m.dtype, m.shape, m.numpy().tobytes()) for m in mine] == \
                   [None if o is None else (o.dtype, o.shape, o.numpy().tobytes()) for o in output]
    with pytest.raises(TransformError, match=r"sample 13 \('s013'\): prepare raised ValueError: unlucky"):
        transformed(Shapes(), samples, 5, 1)


def test_a_transforms_batch_crosses_processes_with_its_outputs():
    indices = [8, 1, 13, 3]
    rows = rows_of(indices)
    samples = [{"__key__": f"s{i:03d}", "__index__": i, "x": str(i).encode()} for i in indices]
    batch = transformed(Shapes(), samples, 0, 0, continue_on_error=True, shared=True)
    received = pickle.loads(ForkingPickler.dumps(batch))  # as a DataLoader worker sends it: the segment's name
    assert received.declared == batch.declared
    assert_outputs(received, rows)
    assert_outputs(received.pin_memory() if torch.cuda.is_available() else received.to("cpu"), rows)


def test_an_answer_not_as_declared_is_refused():
    declared = describe(Shapes())["outputs"]
    for headers, message in [
        ({**transform_headers(), "X-Shardfeed-Outputs": "[1, 2]"}, "is not {name: {dtype, shape}}"),
        ({"Content-Type": "application/vnd.apache.arrow.stream"}, "without x-shardfeed-outputs"),
        (transform_headers({k: v for k, v in declared.items() if k != "pair"}), "its declared outputs'"),
        (transform_headers({**declared, "image": {"dtype": "float32", "shape": [3, 4, 5]}}), "not one float32 array"),
    ]:
        server = serving(headers=headers)
        try:
            with client_of(server) as client, pytest.raises(ShardfeedError, match=message):
                client.get_batch_tensors("train", [1, 2], transform="shapes").outputs
        finally:
            server.shutdown()


def test_a_transform_takes_no_fields_and_its_refusals_stand():
    refusal = {"error": {"code": "unsupported_format", "message": "format 'arrow' is not supported"}}
    server = Answers(lambda body: (400, {"Content-Type": "application/json"}, json.dumps(refusal).encode()))
    try:
        with client_of(server) as client:
            with pytest.raises(TypeError, match="fields do not apply"):
                client.get_batch_tensors("train", [1], ["x"], transform="shapes")
            with pytest.raises(ValueError, match=">= 0"):
                client.get_batch_tensors("train", [1], transform="shapes", epoch=-1)
            with pytest.raises(ShardfeedHTTPError, match="unsupported_format"):
                client.get_batch_tensors("train", [1], transform="shapes")
            assert [b["format"] for b in server.bodies] == ["arrow"]  # not asked again as tar
    finally:
        server.shutdown()
    plain = Batch.of(torch.zeros(4, dtype=torch.uint8),
                     Columns(["a"], np.zeros(1, np.int64), np.zeros(1, bool), {"x": np.zeros(1, np.int64)},
                             {"x": np.full(1, 4)}))
    with pytest.raises(TypeError, match="not a transform's"):
        plain.outputs
    empty = lay_out(Shapes(), [], np.zeros(0, np.int64), [], False)
    assert empty.outputs["image"].shape == (0, 3, 4, 5) and empty.outputs["points"] == []
