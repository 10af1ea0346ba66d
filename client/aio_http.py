"""POST a JSON body and read the answer, whole or as server-sent events, on asyncio's streams: the benchmark's load
runs every request in flight on one event loop (client.client.run_load).

Why not `requests` in a thread per request, or aiohttp: the client shares the machine's cores with the server it
measures, and what it spends there is taken from the server. Against a server whose steps cost no CPU
(`ENGINE=sim` with a fixed 60 ms step, 64 streams of 100 tokens, a 2 vCPU Xeon), the client's CPU per streamed
event was 84-92 µs with `requests` in 64 threads, 62-64 µs with aiohttp on one loop and 37-41 µs with this.
HTTP/1.1 only, one connection per request (`Connection: close`), as the benchmarks use it.
"""

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


class HttpError(Exception):
    """The connection failed, or the server's answer was not HTTP/1.1 as expected; the message says which."""


@dataclass
class Response:
    status: int
    headers: dict[str, str]  # names in lower case
    _reader: asyncio.StreamReader
    _budget: asyncio.Timeout
    _timeout: float

    async def body(self) -> bytes:
        """The whole body."""
        return b"".join([piece async for piece in self.pieces()])

    async def json(self) -> Any:
        return json.loads(await self.body())

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each chunk of a chunked body, else what each read returns until its length or
        the connection's end. Each read may take up to the timeout."""
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                line = await self._read(self._reader.readline())
                if not line.endswith(b"\n"):
                    raise HttpError("the answer broke off before its last chunk")
                if not (size := int(line.split(b";")[0], 16)):
                    return
                yield (await self._read(self._reader.readexactly(size + 2)))[:-2]
        left = int(self.headers.get("content-length", -1))  # -1: until the connection ends
        while left:
            piece = await self._read(self._reader.read(65536 if left < 0 else min(left, 65536)))
            if not piece and left > 0:
                raise HttpError(f"the answer broke off {left} bytes before its length")
            if not piece:
                return
            left -= len(piece) if left > 0 else 0
            yield piece

    async def events(self) -> AsyncIterator[tuple[float, bytes]]:
        """Server-sent events' `data:` fields as they arrive, each with its arrival (time.perf_counter)."""
        rest = b""
        async for piece in self.pieces():
            arrived = time.perf_counter()
            *lines, rest = (rest + piece).split(b"\n")
            for line in lines:
                if line.startswith(b"data:"):
                    yield arrived, line[5:].strip()

    async def _read(self, read: Any) -> bytes:
        self._budget.reschedule(asyncio.get_running_loop().time() + self._timeout)
        try:
            return await read
        except (asyncio.IncompleteReadError, ValueError, OSError) as exc:  # ValueError: a line past the limit
            raise HttpError(f"the answer broke off: {type(exc).__name__}: {exc}") from exc


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
    async with asyncio.timeout(timeout) as budget:
        try:
            context = ssl.create_default_context() if parts.scheme == "https" else None
            reader, writer = await asyncio.open_connection(parts.hostname, port, ssl=context, limit=2**20)
        except OSError as exc:
            raise HttpError(f"cannot connect to {parts.netloc}: {exc}") from exc
        try:
            writer.write(head.encode() + payload)
            response = await _response(reader, budget, timeout)
            yield response
        finally:
            writer.close()


async def _response(reader: asyncio.StreamReader, budget: asyncio.Timeout, timeout: float) -> Response:
    response = Response(0, {}, reader, budget, timeout)
    status = (await response._read(reader.readline())).split(None, 2)
    if len(status) < 2 or not status[0].startswith(b"HTTP/1.") or not status[1].isdigit():
        raise HttpError(f"not an HTTP/1.1 status line: {b' '.join(status)[:100]!r}")
    response.status = int(status[1])
    while (line := await response._read(reader.readline())) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        response.headers[name.strip().lower()] = value.strip()
    return response
