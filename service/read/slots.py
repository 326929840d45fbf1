"""Who reads from the store next: the store-read slots, handed out by need, then by turns.

Every store read (a run of blocks, or of sample ranges) takes one of ``max_store_requests``
slots for as long as it is in flight. When more reads wait than there are slots, a first-come
queue lets a few megabytes of reading ahead stand between a batch and the read it is waiting
on, and lets one tenant's flood stand in front of another's one batch. So a freed slot goes:

1. to a read a batch waits on (``need``) before any read ahead of a plan (``ahead``): a read
   ahead that a batch comes to wait on while it still waits for a slot is ``promote``\\ d;
2. among reads of the same need, to each tenant in turn (round robin over the tenants with
   reads waiting, first come first served within a tenant), so a tenant with many batches in
   flight takes no more of the store than one with a single batch, while both wait.

The tenant is the one of the request that started the read (``TENANT``, a context variable
that the tasks a request creates inherit); reads started by no request (reading ahead) are
``ahead`` and have none.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from typing import AsyncIterator

TENANT: contextvars.ContextVar[str | None] = contextvars.ContextVar("shardfeed_tenant", default=None)
"""The tenant of the request being served (set where a batch is admitted; ``None``: anonymous)."""


class Ticket:
    """One store read's place in line: ``ahead`` of a plan's reader, or needed now by ``tenant``."""

    __slots__ = ("ahead", "tenant", "_granted", "_outstanding")

    def __init__(self, ahead: bool, tenant: str | None):
        self.ahead = ahead
        self.tenant = tenant
        self._granted: asyncio.Future | None = None
        self._outstanding = ahead  # counted in ``StoreSlots.outstanding_ahead``

    @property
    def waiting(self) -> bool:
        """Whether it waits for a slot (not yet granted one)."""
        return self._granted is not None and not self._granted.done()


class StoreSlots:
    """``slots`` store reads in flight at most, granted by need, then by tenants' turns (see the
    module's docstring)."""

    def __init__(self, slots: int):
        self.slots = slots
        self.busy = 0
        self.outstanding_ahead = 0
        """Reads ahead asked for and not done: from their ticket until their read ends, or a batch
        comes to wait on them (how far reading ahead has run in front of the store, counted
        before their tasks reach the line, so a pass that starts many sees them at once)."""
        self._need: OrderedDict[str | None, deque[Ticket]] = OrderedDict()  # tenants in turn order
        self._ahead: deque[Ticket] = deque()

    def ticket(self, *, ahead: bool = False, tenant: str | None = None) -> Ticket:
        """A place in line for a read: ``ahead`` of a plan's reader, else needed now by ``tenant``
        (by default the current request's, ``TENANT``)."""
        self.outstanding_ahead += ahead
        return Ticket(ahead, None if ahead else (tenant if tenant is not None else TENANT.get()))

    @property
    def waiting_ahead(self) -> int:
        """Reads ahead waiting for a slot: how far reading ahead has run in front of the store."""
        return len(self._ahead)

    @property
    def waiting_need(self) -> int:
        """Reads a batch waits on that wait for a slot."""
        return sum(len(queue) for queue in self._need.values())

    @asynccontextmanager
    async def hold(self, ticket: Ticket) -> AsyncIterator[None]:
        """A slot for ``ticket``'s read, for the block's duration."""
        try:
            await self._acquire(ticket)
            try:
                yield
            finally:
                self._release()
        finally:
            self._settle(ticket)

    def promote(self, ticket: Ticket, tenant: str | None = None) -> None:
        """A read waiting ahead is now needed by a batch (of ``tenant``, by default the current
        request's): it waits with the needed reads, at the back of its tenant's line."""
        if not (ticket.ahead and ticket.waiting):
            return
        self._settle(ticket)
        self._ahead.remove(ticket)
        ticket.ahead = False
        ticket.tenant = tenant if tenant is not None else TENANT.get()
        self._need.setdefault(ticket.tenant, deque()).append(ticket)

    def _settle(self, ticket: Ticket) -> None:
        """``ticket``'s read ahead is outstanding no more (done, or needed now)."""
        if ticket._outstanding:
            ticket._outstanding = False
            self.outstanding_ahead -= 1

    async def _acquire(self, ticket: Ticket) -> None:
        if self.busy < self.slots and not self._ahead and not self._need:
            self.busy += 1
            return
        ticket._granted = asyncio.get_running_loop().create_future()
        if ticket.ahead:
            self._ahead.append(ticket)
        else:
            self._need.setdefault(ticket.tenant, deque()).append(ticket)
        try:
            await ticket._granted
        except asyncio.CancelledError:
            if ticket._granted.done() and not ticket._granted.cancelled():
                self._release()  # granted as it was cancelled: hand the slot on
            else:
                self._withdraw(ticket)
            raise

    def _withdraw(self, ticket: Ticket) -> None:
        """Take a cancelled ticket out of line (a slot freed meanwhile may have passed it over already)."""
        if ticket.ahead:
            if ticket in self._ahead:
                self._ahead.remove(ticket)
            return
        queue = self._need.get(ticket.tenant)
        if queue is not None and ticket in queue:
            queue.remove(ticket)
            if not queue:
                del self._need[ticket.tenant]

    def _release(self) -> None:
        self.busy -= 1
        while self.busy < self.slots:
            ticket = self._next()
            if ticket is None:
                return
            if not ticket._granted.done():
                ticket._granted.set_result(None)
                self.busy += 1

    def _next(self) -> Ticket | None:
        """The next ticket to grant: the tenant whose turn it is (then it goes to the back of the
        turn order), else the oldest read ahead."""
        if self._need:
            tenant, queue = next(iter(self._need.items()))
            ticket = queue.popleft()
            if queue:
                self._need.move_to_end(tenant)
            else:
                del self._need[tenant]
            return ticket
        return self._ahead.popleft() if self._ahead else None
