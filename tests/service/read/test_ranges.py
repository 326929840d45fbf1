"""Sample ranges read without their block (service/read/ranges.py), over a real file:// dataset:
reads merged when near, shared while in flight, and a range a reader took lately never read
ahead again (reading ahead may lag behind a reader whose workers run ahead of its plan)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from shardfeed.service.datasets.dataset import open_dataset
from shardfeed.service.read import ranges as ranges_module
from shardfeed.service.read.ranges import STALE, RangeReader, _key
from shardfeed.service.read.slots import StoreSlots

from common.datasets import dir_put, make_dataset
from common.wait import await_until


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("ranges")
    source = make_dataset(dir_put(root), samples=40, per_shard=20, sizes=(900, 1100))
    return asyncio.run(open_dataset("d", root.as_uri())), source


@pytest.fixture(scope="module")
def dataset(written):
    return written[0]


def spans_of(dataset, indices) -> list[tuple[int, int, int]]:
    members = dataset.index.lookup(indices)
    return [(int(s), int(o), int(o + n)) for s, o, n in zip(members.shard, members.offset, members.size)]


def test_a_range_a_reader_took_is_not_read_ahead_again(dataset):
    reads: list[tuple[int, int, int]] = []

    async def store_read(ds, shard: int, start: int, end: int, ticket) -> bytes:
        reads.append((shard, start, end))
        return await ds.store.read_range(ds.index.shards[shard], start, end - start, ds.shard_version(shard))

    taken = spans_of(dataset, [0, 1, 25])  # two samples of shard 0, one of shard 1

    async def main() -> list:
        ranges = RangeReader(store_read, StoreSlots(32), gap=16 * 1024, max_read=1 << 20, memory=1 << 20)
        got = await ranges.read(dataset, taken)
        assert len(reads) == 2  # one read per shard: the members of shard 0 merged
        ranges.read_ahead(dataset, taken)  # a plan's read-ahead lagging behind its reader
        ranges.read_ahead(dataset, spans_of(dataset, [30]))
        await await_until(lambda: len(reads) >= 3, 10, "the read-ahead")
        await ranges.close()
        return got

    got = asyncio.run(main())
    assert len(reads) == 3  # only sample 30 was read ahead
    for data, (shard, start, end) in zip(got, taken):
        assert data == (dataset.store.root / dataset.index.shards[shard]).read_bytes()[start:end]


def test_a_range_read_again_while_an_earlier_sharer_still_waits_is_answered(dataset):
    """Readers A and B share a range; A takes it, C reads it again (a new read), then B, done
    with its other range, lets go of its own: C's read must still answer C (it once popped
    C's entry instead, and C waited forever: the chaos benchmark's 30 s stalls)."""
    gates: list[asyncio.Event] = []

    async def store_read(ds, shard: int, start: int, end: int, ticket) -> bytes:
        gates.append(gate := asyncio.Event())
        await gate.wait()
        return await ds.store.read_range(ds.index.shards[shard], start, end - start, ds.shard_version(shard))

    shared, other = spans_of(dataset, [0])[:1], spans_of(dataset, [25])[:1]  # shards 0 and 1: two reads

    def exact(spans) -> list[bytes]:
        return [(dataset.store.root / dataset.index.shards[s]).read_bytes()[a:b] for s, a, b in spans]

    async def main() -> None:
        ranges = RangeReader(store_read, StoreSlots(32), gap=0, max_read=1 << 20, memory=1 << 20)
        a = asyncio.create_task(ranges.read(dataset, shared))
        await await_until(lambda: len(gates) == 1, 10, "A's read")
        b = asyncio.create_task(ranges.read(dataset, shared + other))  # shares A's read, starts its own
        await await_until(lambda: len(gates) == 2, 10, "B's own read")
        gates[0].set()
        assert await a == exact(shared)
        c = asyncio.create_task(ranges.read(dataset, shared))  # A let go: a read of its own
        await await_until(lambda: len(gates) == 3, 10, "C's own read")
        gates[1].set()
        assert await b == exact(shared + other)
        gates[2].set()
        assert await asyncio.wait_for(c, 5) == exact(shared)
        await ranges.close()

    asyncio.run(main())


@pytest.mark.parametrize("gap", [0, 2048, 1 << 20])
def test_merged_ranges_are_byte_exact_for_every_field_across_shards(written, gap):
    dataset, source = written
    indices = [17, 3, 21, 39, 4, 20, 5, 38, 0, 19]  # both shards, neighbours and strays, any order
    members = dataset.index.lookup(indices)
    spans = spans_of(dataset, indices)
    reads = []

    async def store_read(ds, shard: int, start: int, end: int, ticket) -> bytes:
        reads.append(shard)
        return await ds.store.read_range(ds.index.shards[shard], start, end - start, ds.shard_version(shard))

    async def main() -> list:
        ranges = RangeReader(store_read, StoreSlots(32), gap=gap, max_read=1 << 20, memory=1 << 20)
        try:
            return await ranges.read(dataset, spans)
        finally:
            await ranges.close()

    got = asyncio.run(main())
    fields = dataset.index.fields
    assert got == [source[(int(i), fields[f])] for i, f in zip(members.sample, members.field)]
    # No gap: a read per member (a tar header lies between any two); 2 KiB: a sample's members
    # and near neighbours together; 1 MiB: one read per shard.
    assert len(reads) == len(spans) if gap == 0 else len(reads) < len(indices) if gap == 2048 else len(reads) == 2
    assert "json" in {fields[f] for f in members.field}  # a third field where a sample has one


def test_a_range_read_ahead_serves_the_ranges_inside_it_and_is_let_go_once_all_are_taken(dataset):
    """A record of an MDS or LitData shard is read ahead whole, then its header and its fields
    are taken one by one (``read/fields.py``): none of them is read again."""
    reads: list[tuple[int, int, int]] = []

    async def store_read(ds, shard: int, start: int, end: int, ticket) -> bytes:
        reads.append((shard, start, end))
        return await ds.store.read_range(ds.index.shards[shard], start, end - start, ds.shard_version(shard))

    (shard, start, end), = spans_of(dataset, [3])[:1]
    inside = [(shard, start, start + 8), (shard, start + 8, start + 100), (shard, start + 100, end)]
    whole = (dataset.store.root / dataset.index.shards[shard]).read_bytes()

    async def main() -> None:
        ranges = RangeReader(store_read, StoreSlots(32), gap=0, max_read=1 << 20, memory=1 << 20)
        ranges.read_ahead(dataset, [(shard, start, end)])
        assert ranges.holds(dataset, inside) and ranges.room() == (1 << 20) - (end - start)
        assert await ranges.read(dataset, inside[:1]) == [whole[start:start + 8]]
        assert await ranges.read(dataset, inside[1:]) == [whole[a:b] for _, a, b in inside[1:]]
        assert reads == [(shard, start, end)]  # the record alone, once
        assert ranges.room() == 1 << 20 and not ranges.holds(dataset, inside)  # every byte taken: let go
        await ranges.read(dataset, inside[:1])
        assert reads[1:] == inside[:1]  # a read of its own now
        await ranges.close()

    asyncio.run(main())


def test_a_range_read_ahead_goes_stale_counted_from_its_arrival_not_its_queueing(dataset, monkeypatch):
    """A read ahead that waited long for a store slot must still be there for its reader when it
    arrives (its age once counted from its queueing: a reader whose ranges had waited longer than
    ``STALE`` found them dropped on arrival, and read each sample again)."""
    clock = [1000.0]
    monkeypatch.setattr(ranges_module, "time", SimpleNamespace(monotonic=lambda: clock[0]))  # its clock alone
    reads: list[tuple[int, int, int]] = []
    gate = asyncio.Event()

    async def store_read(ds, shard: int, start: int, end: int, ticket) -> bytes:
        reads.append((shard, start, end))
        await gate.wait()
        return await ds.store.read_range(ds.index.shards[shard], start, end - start, ds.shard_version(shard))

    span = spans_of(dataset, [7])[0]

    async def main() -> None:
        ranges = RangeReader(store_read, StoreSlots(32), gap=0, max_read=1 << 20, memory=1 << 20)
        ranges.read_ahead(dataset, [span])
        await await_until(lambda: reads, 10, "the read ahead")
        clock[0] += 2 * STALE  # it waited for the store far longer than STALE
        gate.set()
        await await_until(lambda: ranges._pending[_key(dataset, *span)][0].done(), 10, "its arrival")
        clock[0] += STALE / 2
        assert ranges.room() < 1 << 20 and ranges.holds(dataset, [span])  # kept: half STALE since it arrived
        clock[0] += STALE
        assert ranges.room() == 1 << 20 and not ranges.holds(dataset, [span])  # never taken: dropped
        await ranges.close()

    asyncio.run(main())
    assert len(reads) == 1


def test_reads_ahead_wait_behind_a_readers_own_and_one_it_comes_to_wait_on_is_promoted(dataset):
    """With every store slot busy, two ranges are read ahead, then a reader needs the second and
    another range: both of the reader's reads get the slot before the first read ahead."""
    reads: list[tuple[int, int, int]] = []

    async def store_read(ds, shard: int, start: int, end: int, ticket) -> bytes:
        async with slots.hold(ticket):
            reads.append((shard, start, end))
            return await ds.store.read_range(ds.index.shards[shard], start, end - start, ds.shard_version(shard))

    slots = StoreSlots(1)
    early, wanted, own = (spans_of(dataset, [i])[0] for i in (2, 12, 30))

    async def main() -> list:
        ranges = RangeReader(store_read, slots, gap=0, max_read=1 << 20, memory=1 << 20)
        busy, free = asyncio.Event(), asyncio.Event()

        async def blocker() -> None:
            async with slots.hold(slots.ticket()):
                busy.set()
                await free.wait()

        held = asyncio.create_task(blocker())
        await busy.wait()
        ranges.read_ahead(dataset, [early])
        ranges.read_ahead(dataset, [wanted])
        await await_until(lambda: slots.waiting_ahead == 2, 10, "the reads ahead in line")
        reader = asyncio.create_task(ranges.read(dataset, [wanted, own]))
        await await_until(lambda: slots.waiting_need == 2, 10, "the reader's reads in line")
        assert slots.waiting_ahead == 1  # the one it waits on moved to the needed reads
        free.set()
        got = await reader
        await held
        await await_until(lambda: len(reads) == 3, 10, "the read ahead nobody waits on")
        await ranges.close()
        return got

    got = asyncio.run(main())
    assert reads == [wanted, own, early]
    whole = lambda span: (dataset.store.root / dataset.index.shards[span[0]]).read_bytes()[span[1]:span[2]]  # noqa: E731
    assert got == [whole(wanted), whole(own)]
