"""The clients' batch transport: ``POST /v1/batch`` on kept-alive connections, without httpx.

Batches are the clients' hot path, so they travel over a lean HTTP/1.1 transport of their
own; the clients' other requests are rare and go through httpx. One module per driver, as
httpx keeps one per transport: :mod:`.sync` (sockets, for ``Client``; a tensor batch's bytes
go straight into its buffer) and :mod:`.aio` (asyncio streams, for ``AsyncClient``), over
:mod:`.base`, the request and the bookkeeping of kept connections that both share.
"""
