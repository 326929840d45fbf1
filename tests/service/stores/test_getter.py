"""The store's ranged-read transport (``service/stores/getter.py``) against a real HTTP server on
a real socket, one that answers as told: bodies landing in pieces handed on as each completes,
other framings read whole, kept connections, a server closing a kept one, silence, a cut body."""

from __future__ import annotations

import asyncio

import pytest

from shardfeed.http11 import Closed
from shardfeed.service.stores.getter import CannotConnect, CutShort, Getter

BODY = bytes(range(256)) * 64  # 16 KiB


class Server:
    """Answers each request with the next of ``answers``: a list of byte strings sent in turn,
    waiting ``gate`` (an event) between them when given, or a number of seconds where a number
    stands among them; ``None`` closes the connection."""

    def __init__(self, answers: list):
        self.answers = list(answers)
        self.connections = 0
        self.gate = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                try:
                    await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    return
                answer = self.answers.pop(0)
                if answer is None:
                    return
                for number, part in enumerate(answer):
                    if isinstance(part, float):
                        await asyncio.sleep(part)
                        continue
                    if number and not isinstance(answer[number - 1], float):
                        await self.gate.wait()
                    writer.write(part)
                    await writer.drain()
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc) -> None:
        self.server.close()


def sized(body: bytes, status: str = "206 Partial Content", extra: str = "") -> bytes:
    return f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{extra}\r\n".encode() + body


def getter(url: str, read_timeout: float = 5, progress_timeout: float | None = None) -> Getter:
    return Getter(url, connections=4, connect_timeout=2, first_byte_timeout=read_timeout,
                  progress_timeout=progress_timeout or read_timeout)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_each_piece_is_handed_on_the_moment_it_is_complete_and_the_connection_is_kept():
    async def main():
        whole = sized(BODY)
        head_and_first = whole[:len(whole) - len(BODY) + 6000]
        server = Server([[head_and_first, whole[len(head_and_first):]], [sized(BODY[:10])]])
        async with server as url:
            get = getter(url)
            arrived = []

            def on_piece(number, piece):
                arrived.append((number, bytes(piece)))
                if number == 0:  # the rest of the body is not even sent yet
                    assert not server.gate.is_set()
                    server.gate.set()

            answer = await get.get("/x", {"Host": "h"}, [4096, 4096, 8192], limit=1 << 20, arrived=on_piece)
            assert [bytes(p) for p in answer.pieces] == [BODY[:4096], BODY[4096:8192], BODY[8192:]]
            assert arrived == [(0, BODY[:4096]), (1, BODY[4096:8192]), (2, BODY[8192:])]
            again = await get.get("/y", {"Host": "h"}, [10], limit=1 << 20)
            assert bytes(again.pieces[0]) == BODY[:10] and server.connections == 1
            get.close()
    run(main())


ERROR = b"<Error><Code>SlowDown</Code></Error>"


@pytest.mark.parametrize("answer, status, body", [
    (sized(ERROR, "503 Slow Down"), 503, ERROR),
    (sized(BODY, "200 OK"), 200, BODY),  # not the pieces' length: read whole, for the caller to judge
    (b"HTTP/1.1 206 Partial Content\r\nTransfer-Encoding: chunked\r\n\r\n"
     + b"".join(b"%x\r\n" % len(BODY[i:i + 5000]) + BODY[i:i + 5000] + b"\r\n" for i in range(0, len(BODY), 5000))
     + b"0\r\n\r\n", 206, BODY),
])
def test_an_answer_that_is_not_exactly_the_pieces_is_read_whole_through_its_framing(answer, status, body):
    async def main():
        async with Server([[answer]]) as url:
            get = getter(url)
            got = await get.get("/x", {"Host": "h"}, [8192], limit=1 << 20,
                                arrived=lambda n, p: pytest.fail("handed on"))
            assert (got.head.status, got.pieces, got.body) == (status, None, body)
            get.close()
    run(main())


def test_a_refused_head_fails_the_get_before_any_piece_is_handed_on():
    def refuse(head):
        raise ValueError(f"refused {head.status}")

    async def main():
        async with Server([[sized(BODY)]]) as url:
            with pytest.raises(ValueError, match="refused 206"):
                await getter(url).get("/x", {"Host": "h"}, [len(BODY)], limit=1 << 20, accept=refuse,
                                      arrived=lambda n, p: pytest.fail("handed on"))
    run(main())


def test_a_kept_connection_the_server_closed_is_replaced_once():
    async def main():
        server = Server([[sized(BODY[:10])], None, [sized(BODY[:20])]])
        async with server as url:
            get = getter(url)
            await get.get("/x", {"Host": "h"}, [10], limit=1 << 20)
            answer = await get.get("/y", {"Host": "h"}, [20], limit=1 << 20)
            assert bytes(answer.pieces[0]) == BODY[:20] and server.connections == 2
            get.close()
    run(main())


def test_a_cut_body_and_silence_fail_and_the_pieces_in_before_stay_whole():
    async def main():
        whole = sized(BODY)
        cut = whole[:len(whole) - len(BODY) // 2]
        arrived = []
        async with Server([[cut]]) as url:  # then the server closes the connection
            with pytest.raises(CutShort):
                await getter(url).get("/x", {"Host": "h"}, [4096] * 4, limit=1 << 20,
                                      arrived=lambda n, p: arrived.append((n, bytes(p))))
        assert arrived == [(0, BODY[:4096]), (1, BODY[4096:8192])]
        server = Server([[cut, b""]])  # the rest never comes
        async with server as url:
            with pytest.raises(TimeoutError):
                await getter(url, read_timeout=0.3).get("/x", {"Host": "h"}, [len(BODY)], limit=1 << 20)
            server.gate.set()
        async with Server([None]) as url:  # closed before a byte of the answer, on a new connection
            with pytest.raises(Closed):
                await getter(url).get("/x", {"Host": "h"}, [10], limit=1 << 20)
        with pytest.raises(CannotConnect, match="cannot connect"):
            await getter(url).get("/x", {"Host": "h"}, [10], limit=1 << 20)  # nobody listens there now
    run(main())


def test_the_first_byte_and_the_silence_after_it_have_deadlines_of_their_own():
    async def main():
        whole = sized(BODY)
        half = len(whole) - len(BODY) // 2
        # A first byte later than the progress deadline, within its own: the answer is read.
        async with Server([[0.6, whole]]) as url:
            got = await getter(url, read_timeout=2, progress_timeout=0.3).get("/x", {"Host": "h"}, [len(BODY)],
                                                                               limit=1 << 20)
            assert bytes(got.pieces[0]) == BODY
        # No first byte by its deadline: given up then, not after a longer budget.
        server = Server([[3.0, whole]])
        async with server as url:
            began = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError, match="first byte for 0.5 s"):
                await getter(url, read_timeout=0.5, progress_timeout=5).get("/x", {"Host": "h"}, [len(BODY)],
                                                                             limit=1 << 20)
            assert asyncio.get_running_loop().time() - began < 2
        # Silent mid-body past the progress deadline, however long the first-byte one.
        async with Server([[whole[:half], 3.0, whole[half:]]]) as url:
            began = asyncio.get_running_loop().time()
            with pytest.raises(TimeoutError, match="no more answer bytes for 0.3 s"):
                await getter(url, read_timeout=5, progress_timeout=0.3).get("/x", {"Host": "h"}, [len(BODY)],
                                                                             limit=1 << 20)
            assert asyncio.get_running_loop().time() - began < 2
    run(main())
