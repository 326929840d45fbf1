"""The store-read slots (service/read/slots.py): a freed slot goes to a read a batch waits on before
a read ahead, to tenants in turn, to a promoted read ahead as a needed one; cancelled waiters
leave the line; never more reads than slots."""

from __future__ import annotations

import asyncio

from shardfeed.service.read.slots import TENANT, StoreSlots


async def _granted_in_order(slots: StoreSlots, tickets: list) -> list[int]:
    """Hold every slot, queue ``tickets`` in turn, then free the slots: the order they got one."""
    order: list[int] = []
    gate = asyncio.Event()

    async def reader(number: int, ticket) -> None:
        async with slots.hold(ticket):
            order.append(number)
            assert slots.busy <= slots.slots
            await gate.wait()

    blockers = [asyncio.create_task(reader(-1, slots.ticket())) for _ in range(slots.slots)]
    await asyncio.sleep(0)
    readers = []
    for number, ticket in enumerate(tickets):
        readers.append(asyncio.create_task(reader(number, ticket)))
        await asyncio.sleep(0)
    gate.set()
    await asyncio.gather(*blockers, *readers)
    return [n for n in order if n >= 0]


def test_needed_reads_go_before_reads_ahead_and_tenants_take_turns():
    async def run():
        slots = StoreSlots(1)
        tickets = [slots.ticket(ahead=True), slots.ticket(ahead=True),
                   *(slots.ticket(tenant="heavy") for _ in range(4)), slots.ticket(tenant="light"),
                   slots.ticket(tenant="light")]
        return await _granted_in_order(slots, tickets)

    # heavy's first, then light's, in turn, then heavy's rest; the reads ahead last, oldest first
    assert asyncio.run(run()) == [2, 6, 3, 7, 4, 5, 0, 1]


def test_a_read_ahead_a_batch_comes_to_wait_on_is_promoted():
    async def run():
        slots = StoreSlots(1)
        early, late = slots.ticket(ahead=True), slots.ticket(ahead=True)
        needed = slots.ticket(tenant="a")
        order: list[str] = []
        gate = asyncio.Event()

        async def reader(name, ticket):
            async with slots.hold(ticket):
                order.append(name)
                await gate.wait()

        blocker = asyncio.create_task(reader("blocker", slots.ticket()))
        await asyncio.sleep(0)
        tasks = [asyncio.create_task(reader(name, t)) for name, t in (("early", early), ("late", late),
                                                                      ("needed", needed))]
        await asyncio.sleep(0)
        assert slots.waiting_ahead == 2 and slots.waiting_need == 1 and late.waiting
        token = TENANT.set("b")
        slots.promote(late)  # a batch of tenant b now waits on it
        TENANT.reset(token)
        assert not late.ahead and late.tenant == "b" and slots.waiting_ahead == 1 and slots.waiting_need == 2
        gate.set()
        await asyncio.gather(blocker, *tasks)
        return order

    assert asyncio.run(run()) == ["blocker", "needed", "late", "early"]


def test_a_cancelled_waiter_leaves_the_line_and_its_slot_goes_on():
    async def run():
        slots = StoreSlots(2)
        gate = asyncio.Event()
        got: list[str] = []

        async def reader(name, ticket):
            async with slots.hold(ticket):
                got.append(name)
                await gate.wait()

        holders = [asyncio.create_task(reader(f"h{i}", slots.ticket())) for i in range(2)]
        await asyncio.sleep(0)
        gone = asyncio.create_task(reader("gone", slots.ticket(ahead=True)))
        kept = asyncio.create_task(reader("kept", slots.ticket(tenant="t")))
        await asyncio.sleep(0)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert slots.waiting_ahead == 0 and slots.waiting_need == 1
        gate.set()
        await asyncio.gather(*holders, kept)
        assert slots.busy == 0 and slots.waiting_need == 0
        return got

    assert asyncio.run(run()) == ["h0", "h1", "kept"]


def test_the_request_tenant_is_the_context_one():
    async def run():
        slots = StoreSlots(4)

        async def in_a_task():  # the ticket made inside the task a request started
            return slots.ticket()

        TENANT.set("team")
        inside = await asyncio.create_task(in_a_task())  # a task inherits the context it was created in
        TENANT.set("other")
        return inside.tenant, slots.ticket().tenant, slots.ticket(ahead=True).tenant

    assert asyncio.run(run()) == ("team", "other", None)


def test_reads_ahead_are_outstanding_from_their_ticket_until_done_needed_or_cancelled():
    async def run():
        slots = StoreSlots(1)
        done, promoted, cancelled = (slots.ticket(ahead=True) for _ in range(3))
        slots.ticket()  # a needed read is never counted
        assert slots.outstanding_ahead == 3  # before any of them reaches the line
        gate = asyncio.Event()

        async def read(ticket) -> None:
            async with slots.hold(ticket):
                await gate.wait()

        tasks = [asyncio.create_task(read(t)) for t in (done, promoted, cancelled)]
        await asyncio.sleep(0)
        slots.promote(promoted)
        assert slots.outstanding_ahead == 2
        tasks[2].cancel()
        await asyncio.gather(tasks[2], return_exceptions=True)
        assert slots.outstanding_ahead == 1
        gate.set()
        await asyncio.gather(*tasks[:2])
        assert slots.outstanding_ahead == 0 and slots.busy == 0

    asyncio.run(run())
