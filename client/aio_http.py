"""POST a JSON body and read the answer, whole or as server-sent events, on one asyncio event loop: the benchmark's
load runs every request in flight on it (client.client.run_load).

Why not `requests` in a thread per request, or aiohttp, or asyncio's streams: the client shares the machine's cores
with the server it measures, and what it spends there is taken from the server. Against a server whose steps cost
no CPU (`ENGINE=sim` with a fixed 60 ms step, 64 streams of 100 tokens, a 2 vCPU Xeon), the client's CPU per
streamed event was 84-92 µs with `requests` in 64 threads and 62-64 µs with aiohttp on one loop. On asyncio's streams
(a reader per connection, the request's task woken at every read, its timeout's timer moved at every read) it was
34-36 µs (the peers benchmark's 64 streamed requests against `ENGINE=sim` with 45 ms steps, the same Xeon). Here each
connection is an asyncio Protocol that parses the answer in the loop's read callback as it comes, noting when each
piece arrived; the request's task wakes only when the head is in and when the body has ended: 19-20 µs on the same
run. An event's arrival time is still its piece's, not the body's end. client.client.run_load runs the loop on uvloop:
on seven alternated pairs of the same run it took 12 % less of the client's CPU than asyncio's own loop (35 against
40 µs an event in an hour when the machine ran everything slower).
HTTP/1.1 only, one connection per request (`Connection: close`), as the benchmarks use it.
"""

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

MAX_HEAD = 2**20  # bytes of status line and headers


class HttpError(Exception):
    """The connection failed, or the server's answer was not HTTP/1.1 as expected; the message says which."""


class _Answer(asyncio.Protocol):
    """One request's connection: it sends the request, then takes the answer in the loop's read callback: the
    status line and headers, then the body by its length, its chunks or the connection's end, each piece kept with
    the time it arrived. `head` and `ended` are the futures the request's task waits on; a broken or malformed
    answer sets its HttpError on them, and a read that waits past the timeout its TimeoutError."""

    def __init__(self, request: bytes, timeout: float):
        self.loop = asyncio.get_running_loop()
        self.request, self.timeout = request, timeout
        self.head, self.ended = self.loop.create_future(), self.loop.create_future()
        self.transport: asyncio.Transport | None = None
        self.status, self.headers = 0, {}
        self.received = b""  # not yet parsed: the head, or a chunk not yet whole
        self.pieces: list[tuple[float, bytes]] = []  # the body's, each with when it arrived (time.perf_counter)
        self.chunked, self.left = False, -1  # left: bytes of the body to come by its length; -1: until the end
        self.last_read = 0.0  # when the newest read began waiting (loop.time)
        self.timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        transport.write(self.request)
        self.last_read = self.loop.time()
        self.timer = self.loop.call_at(self.last_read + self.timeout, self._look)

    def data_received(self, data: bytes) -> None:
        if self.ended.done():
            return  # what follows the body's end (a chunked body's trailer)
        self.last_read = self.loop.time()
        try:
            self._take(data, time.perf_counter())
        except (HttpError, ValueError) as exc:  # ValueError: a chunk size that is not hexadecimal
            self._end(exc if isinstance(exc, HttpError) else HttpError(f"a malformed chunk: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        if self.ended.done():
            return
        if not self.head.done():
            try:
                self._status(self.received)
            except HttpError as error:
                self._end(error)
            self._end(HttpError(f"the answer broke off before its head ended: {exc or 'closed'}"))
        elif self.chunked:
            self._end(HttpError("the answer broke off before its last chunk"))
        elif self.left > 0:
            self._end(HttpError(f"the answer broke off {self.left} bytes before its length"))
        self._end(None)  # a body that lasts until the connection's end has ended

    def _take(self, data: bytes, arrived: float) -> None:
        if not self.head.done():
            self.received += data
            at = self.received.find(b"\r\n\r\n")
            if at < 0:
                if len(self.received) > MAX_HEAD:
                    raise HttpError(f"the answer's head is past {MAX_HEAD} bytes")
                if b"\n" in self.received:
                    self._status(self.received)  # one that is not HTTP's fails before the rest comes
                return
            head, data, self.received = self.received[:at], self.received[at + 4 :], b""
            self._head(head)
        if self.chunked:
            data, self.received, last = _dechunk(self.received + data)
        else:
            data = data[: self.left] if self.left >= 0 else data
            self.left -= len(data) if self.left >= 0 else 0
            last = self.left == 0
        if data:
            self.pieces.append((arrived, data))
        if last:
            self._end(None)

    def _head(self, head: bytes) -> None:
        self._status(head)
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.decode("latin-1").partition(":")
            self.headers[name.strip().lower()] = value.strip()
        self.chunked = self.headers.get("transfer-encoding", "").lower() == "chunked"
        self.left = -1 if self.chunked else int(self.headers.get("content-length", -1))
        self.head.set_result(None)

    def _status(self, head: bytes) -> None:
        status = head.split(b"\n", 1)[0].split(None, 2)
        if len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():
            raise HttpError(f"not an HTTP/1.1 status line: {b' '.join(status)[:100]!r}")
        self.status = int(status[1])

    def _end(self, error: Exception | None) -> None:
        """The answer is whole (`error` None) or has failed: whoever waits is told, once."""
        self.close()
        if self.ended.done():
            return
        if error is None:
            self.ended.set_result(None)
        elif self.head.done():
            self.ended.set_exception(error)
        else:
            self.head.set_exception(error)  # nobody will wait for the body
            self.ended.cancel()

    def close(self) -> None:
        """Hang up (once the answer has ended, or its reader has left), and stop the timer."""
        if self.timer is not None:
            self.timer.cancel()
        if self.transport is not None:
            self.transport.close()

    def _look(self) -> None:
        """The timeout's one timer, looking when the newest read could be due (moving a timer at every read cost
        the client a tenth of its time)."""
        due = self.last_read + self.timeout
        if self.loop.time() >= due:
            self._end(TimeoutError(f"no answer for {self.timeout:g} s"))
        else:
            self.timer = self.loop.call_at(due, self._look)


class Response:
    """An answer whose head is in: its status and headers (names in lower case); its body once it has ended."""

    def __init__(self, answer: _Answer):
        self.status, self.headers, self._answer = answer.status, answer.headers, answer

    async def body(self) -> bytes:
        """The whole body."""
        await self._answer.ended
        return b"".join(piece for _, piece in self._answer.pieces)

    async def json(self) -> Any:
        return json.loads(await self.body())

    async def events(self) -> AsyncIterator[tuple[float, bytes]]:
        """Server-sent events' `data:` fields, each with when the piece that completed it arrived (time.perf_counter),
        once the body has ended."""
        await self._answer.ended
        rest = b""
        for arrived, piece in self._answer.pieces:
            *lines, rest = (rest + piece).split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield arrived, line[5:].strip()


def _dechunk(received: bytes) -> tuple[bytes, bytes, bool]:
    """The data of the whole chunks `received` begins with, what follows them, and whether the last chunk (of size
    zero; its trailer is not read) was among them."""
    data, at = [], 0
    while (eol := received.find(b"\n", at)) >= 0:
        size = int(received[at:eol].split(b";")[0], 16)
        if not size:
            return b"".join(data), b"", True
        end = eol + 1 + size + 2  # the chunk's data, then its CRLF
        if len(received) < end:
            break
        data.append(received[eol + 1 : end - 2])
        at = end
    return b"".join(data), received[at:], False


@asynccontextmanager
async def post(url: str, body: dict[str, Any], timeout: float) -> AsyncIterator[Response]:
    """POST `body` as JSON to `url` (http or https); the response, its status and headers read. Raises HttpError
    for a connection that fails or an answer that is not HTTP, TimeoutError when any read waits past `timeout`."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    payload = json.dumps(body).encode()
    head = (
        f"POST {parts.path or '/'}{'?' + parts.query if parts.query else ''} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
    )
    context = ssl.create_default_context() if parts.scheme == "https" else None
    answer = _Answer(head.encode() + payload, timeout)
    try:
        try:
            async with asyncio.timeout(timeout):
                await asyncio.get_running_loop().create_connection(lambda: answer, parts.hostname, port, ssl=context)
        except OSError as exc:
            raise HttpError(f"cannot connect to {parts.netloc}: {exc}") from exc
        await answer.head
        yield Response(answer)
    finally:
        answer.close()
        if not answer.ended.done():  # left before its end: nobody will wait for it
            answer.ended.cancel()
