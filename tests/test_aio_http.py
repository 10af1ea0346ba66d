"""The benchmark's asyncio HTTP client (client/aio_http.py) against a real socket server that answers as told, and
client.client.run_load's event-loop path."""

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from client.aio_http import HttpError, post
from client.client import run_load
from client.metrics import failure
from client.stream import stream_completion
from client.workloads import Request

USAGE = {"prompt_tokens": 2, "completion_tokens": 3}
EVENTS = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "bc"}]}, {"choices": [], "usage": USAGE}]
SSE = b"".join(b"data: " + json.dumps(event).encode() + b"\n\n" for event in EVENTS) + b"data: [DONE]\n\n"


def chunks(*pieces: bytes) -> bytes:
    return b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for piece in pieces)


END = chunks(b"") + b"\r\n"  # the last chunk, of size 0, and an empty trailer


REFUSED = b'{"error": {"type": "bad", "message": "no such thing"}}'
# path -> (head, body pieces written one after another with a pause between, so each arrives on its own)
ANSWERS = {
    # the first event split across chunks and writes (it ends at byte 36), then two chunks in one write
    "/chunked": (
        b"Transfer-Encoding: chunked",
        [chunks(SSE[:7]), chunks(SSE[7:60]), chunks(SSE[60:80], SSE[80:]) + END],
    ),
    "/sized": (b"Content-Length: %d" % len(SSE), [SSE[:30], SSE[30:]]),
    "/until-closed": (b"Connection: close", [SSE]),
    "/refused": (b"Content-Length: %d" % len(REFUSED), [REFUSED]),
    "/cut-short": (b"Content-Length: %d" % (len(SSE) + 10), [SSE]),
    "/broken": (b"Transfer-Encoding: chunked", [chunks(SSE[:40])]),  # then closed
    "/stalled": (b"Transfer-Encoding: chunked", [chunks(SSE[:40]), None]),
}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    bodies: list[dict] = []

    def do_POST(self):
        Handler.bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        route = self.path.removesuffix("/v1/completions") or "/chunked"  # stream_completion adds the path
        head, pieces = ANSWERS[route]
        status = b"400 Bad Request" if route == "/refused" else b"200 OK"
        self.wfile.write(b"HTTP/1.1 %s\r\nContent-Type: text/event-stream\r\n%s\r\n\r\n" % (status, head))
        for piece in pieces:
            self.wfile.flush()
            if piece is None:
                time.sleep(2)  # past the client's timeout: a stalled server, not a synchronisation
                return
            time.sleep(0.01)
            self.wfile.write(piece)
        self.close_connection = True

    def log_message(self, *args):
        pass


@contextmanager
def answering() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


async def read(url: str, timeout: float = 5.0) -> tuple[int, list[bytes], float]:
    async with post(url, {"hello": [1, 2]}, timeout) as response:
        events = [(arrived, data) async for arrived, data in response.events()]
    return response.status, [data for _, data in events], events[-1][0] - events[0][0]


@pytest.mark.parametrize("route", ["/chunked", "/sized", "/until-closed"])
def test_events_come_whole_whatever_the_body_framing(route):
    with answering() as url:
        status, events, _ = asyncio.run(read(url + route))
    assert status == 200
    assert [json.loads(data) for data in events[:-1]] == EVENTS and events[-1] == b"[DONE]"
    assert Handler.bodies[-1] == {"hello": [1, 2]}


def test_an_event_is_timed_when_it_arrives_not_when_the_body_ends():
    with answering() as url:
        _, _, spread = asyncio.run(read(url + "/chunked"))
    assert spread > 0.005  # the second write came ~10 ms after the first


def test_a_completion_stream_is_read_into_its_counts_text_and_gaps():
    with answering() as url:
        result = asyncio.run(stream_completion(url, Request([5, 6], 3, seed=1), temperature=0.0, timeout=5))
    assert result.ok and (result.prompt_tokens, result.output_tokens, result.text) == (2, 3, "abc")
    assert len(result.itl_s) == 1 and result.itl_s[0] > 0.005 and result.ttft_s > 0
    assert Handler.bodies[-1]["stream_options"] == {"include_usage": True}


def test_failures_are_recorded_never_raised():
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    nobody = f"http://127.0.0.1:{free.getsockname()[1]}"  # bound, not listening: refused
    request = Request([5, 6], 3, seed=1)
    with answering() as url:
        results = {
            path: asyncio.run(stream_completion(url + path, request, temperature=0.0, timeout=0.5))
            for path in ("/refused", "/broken", "/cut-short", "/stalled")
        }
        results["nobody"] = asyncio.run(stream_completion(nobody, request, temperature=0.0, timeout=5))
    free.close()
    assert not any(result.ok for result in results.values())
    assert results["/refused"].error == "HTTP 400: bad: no such thing"
    assert "broke off before its last chunk" in results["/broken"].error
    assert "broke off 10 bytes before its length" in results["/cut-short"].error
    assert "TimeoutError" in results["/stalled"].error
    assert "cannot connect" in results["nobody"].error


def test_post_raises_for_an_answer_that_is_not_http():
    listener = socket.create_server(("127.0.0.1", 0))

    def answer():
        connection, _ = listener.accept()
        connection.recv(65536)
        connection.sendall(b"SSH-2.0-OpenSSH\r\n")
        connection.close()

    threading.Thread(target=answer, daemon=True).start()
    with pytest.raises(HttpError, match="not an HTTP/1.1 status line"):
        asyncio.run(read(f"http://127.0.0.1:{listener.getsockname()[1]}/"))
    listener.close()


def test_run_load_on_one_loop_keeps_order_pacing_and_the_cap():
    running, most = 0, 0

    async def send(item: int):
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.05 if item % 2 else 0.01)
        running -= 1
        return failure(str(item), 0.0, item)

    offsets = [0.0, 0.0, 0.0, 0.0, 0.2, 0.2]
    results, duration_s = run_load(send, list(range(6)), offsets, max_concurrency=2)
    assert [result.error for result in results] == [str(i) for i in range(6)]
    assert most == 2
    assert all(result.sent_s >= offset for result, offset in zip(results, offsets, strict=True))
    assert duration_s >= 0.2
