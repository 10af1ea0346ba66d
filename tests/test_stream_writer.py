"""The front end's writer of streamed responses (api/stream_writer.py): one thread sending every stream's events.

Over real sockets: a client that stops reading holds back its own stream alone, and gets all of it, framed as
HTTP/1.1 chunks, once it reads again; a client that has gone away has its request cancelled; past the deadline the
stream ends with its timeout events; where gunicorn gives no plain socket or HTTP/1.1, the request thread streams.
Through a real server: a stream past REQUEST_TIMEOUT_S ends with the 504 event and [DONE], its blocks freed."""

import json
import socket
import ssl
import threading
import time

import pytest
import requests

from api.stream_writer import StreamWriter
from api.submission import Chunks
from client.launch import running_server
from tests.conftest import sim_settings, wait_until

DONE = b"data: [DONE]\n\n"
END = object()  # what the fake completions put last


class Events:
    """An EventStream's part the writer runs: each chunk put (bytes) is one event, END the last."""

    def __init__(self, deadline_s: float = 60.0):
        self.chunks = Chunks()
        self.opening = [b"data: open\n\n"]
        self.deadline = time.monotonic() + deadline_s
        self.ended = False
        self.cancelled = threading.Event()

    def take(self, chunk) -> list[bytes]:
        if chunk is END:
            self.ended = True
            return [DONE]
        return [chunk]

    def timed_out(self) -> list[bytes]:
        self.ended = True
        return [b"data: timeout\n\n", DONE]

    def cancel(self) -> None:
        self.cancelled.set()


class Request:
    """A request thread as gunicorn's runs it: iterate the body the writer returned, here in a thread."""

    def __init__(self, writer: StreamWriter, events: Events, sock: socket.socket):
        self.body = writer.body(events, {"gunicorn.socket": sock, "SERVER_PROTOCOL": "HTTP/1.1"})
        assert self.body is not None
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._iterate)
        self.thread.start()

    def _iterate(self) -> None:
        try:
            assert list(self.body) == [b""]  # only the empty write that sends the headers
        except (AssertionError, OSError) as err:  # what gunicorn would see
            self.error = err


def connected(sndbuf: int | None = None) -> tuple[socket.socket, socket.socket]:
    """A server's socket (with a small send buffer, if given) and its client's, over loopback TCP."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    if sndbuf:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    return server, client


def read_body(sock: socket.socket, deadline_s: float = 30.0) -> list[bytes]:
    """The chunks of a chunked body up to [DONE], each parsed from its size line."""
    sock.settimeout(deadline_s)
    data, chunks = b"", []
    while not chunks or chunks[-1] != DONE:
        while b"\r\n" not in data:
            data += sock.recv(65536) or pytest.fail("closed before [DONE]")
        size, rest = data.split(b"\r\n", 1)
        n = int(size, 16)
        while len(rest) < n + 2:
            rest += sock.recv(65536) or pytest.fail("closed mid-chunk")
        assert rest[n : n + 2] == b"\r\n"
        chunks.append(rest[:n])
        data = rest[n + 2 :]
    return chunks


def test_a_client_that_stops_reading_holds_back_only_its_own_stream():
    writer = StreamWriter()
    slow_server, slow_client = connected(sndbuf=4096)
    fast_server, fast_client = connected()
    slow, fast = Events(), Events()
    slow_request, fast_request = Request(writer, slow, slow_server), Request(writer, fast, fast_server)
    sent = [b"data: %d %s\n\n" % (i, b"x" * 2000) for i in range(60)]  # 120 kB: far past both buffers
    for event in sent:
        slow.chunks.put(event)
    slow.chunks.put(END)
    for i in range(20):
        fast.chunks.put(b"data: %d\n\n" % i)
    fast.chunks.put(END)
    assert read_body(fast_client) == [b"data: open\n\n", *(b"data: %d\n\n" % i for i in range(20)), DONE]
    fast_request.thread.join(timeout=30)
    assert not fast_request.thread.is_alive() and fast_request.error is None
    assert slow_request.thread.is_alive()  # its stream is not all out yet
    assert read_body(slow_client) == [b"data: open\n\n", *sent, DONE]  # all of it, in order, once read
    slow_request.thread.join(timeout=30)
    assert not slow_request.thread.is_alive() and slow_request.error is None
    assert not slow.cancelled.is_set() and not fast.cancelled.is_set()


def test_a_client_that_went_away_has_its_request_cancelled():
    writer = StreamWriter()
    server, client = connected()
    events = Events()
    request = Request(writer, events, server)
    assert read_body_start(client) == b"data: open\n\n"
    client.close()
    for i in range(1000):  # one event at a time, as steps give them: the first sends after the close may be taken
        events.chunks.put(b"data: %d\n\n" % i)
        if events.cancelled.wait(0.01):
            break
    assert events.cancelled.is_set()
    request.thread.join(timeout=10)
    assert isinstance(request.error, OSError)  # gunicorn then drops the connection


def read_body_start(sock: socket.socket) -> bytes:
    sock.settimeout(10)
    data = b""
    while data.count(b"\r\n") < 2:
        data += sock.recv(65536)
    size, rest = data.split(b"\r\n", 1)
    return rest[: int(size, 16)]


def test_past_its_deadline_a_stream_ends_with_the_timeout_events():
    writer = StreamWriter()
    server, client = connected()
    events = Events(deadline_s=0.3)
    request = Request(writer, events, server)
    events.chunks.put(b"data: one\n\n")
    assert read_body(client) == [b"data: open\n\n", b"data: one\n\n", b"data: timeout\n\n", DONE]
    request.thread.join(timeout=10)
    assert not request.thread.is_alive() and request.error is None


def test_without_a_plain_socket_or_http_1_1_the_request_thread_streams():
    writer, events = StreamWriter(), Events()
    server, _ = connected()
    assert writer.body(events, {}) is None  # Flask's test client
    assert writer.body(events, {"gunicorn.socket": server, "SERVER_PROTOCOL": "HTTP/1.0"}) is None  # not chunked
    tls = ssl.create_default_context().wrap_socket(
        socket.socket(), server_hostname="localhost", do_handshake_on_connect=False
    )
    assert writer.body(events, {"gunicorn.socket": tls, "SERVER_PROTOCOL": "HTTP/1.1"}) is None


def test_a_stream_past_request_timeout_ends_with_a_504_event_and_frees_its_blocks(tmp_path):
    settings = {**sim_settings(tmp_path, step_s=0.05), "REQUEST_TIMEOUT_S": "1"}
    with running_server("dynamic", tmp_path, **settings) as url:
        body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line]
        assert lines[-1] == b"data: [DONE]"
        error = json.loads(lines[-2].removeprefix(b"data: "))["error"]
        assert error["code"] == 504 and "no answer within 1" in error["message"]
        assert 0 < len(lines) - 2 < 200  # some tokens came before the deadline, not all

        def idle() -> bool:
            stats = requests.get(f"{url}/stats", timeout=10).json()
            return stats["requests_running"] == stats["kv_blocks_used"] == 0

        wait_until(idle)
    # gunicorn's plain socket over HTTP/1.1: the writer sent it, not the request thread
    assert "sent by this front end's writer thread" in "".join(p.read_text() for p in tmp_path.glob("server-*.log"))
