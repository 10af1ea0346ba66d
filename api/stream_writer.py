"""One thread per front end that writes every streamed response's events to its client's socket.

A request thread that streamed its own events woke for each one, then waited for the interpreter lock behind the
other request threads woken by the same step, and again after each socket write: 3.5-3.8 thread switches a token
at 64 streams. Here the request thread hands its stream to the writer once the headers are out and sleeps until
the stream has ended; the writer, woken when a step's deltas arrive, renders each stream's events (the same
EventStream the request thread would run) and writes them with non-blocking sends, keeping what a slow client has
not taken for the next round. A client that has gone away has its completions cancelled, as when its request
thread's write fails.

Only where gunicorn hands over a plain socket and frames the body in chunks (HTTP/1.1); elsewhere (TLS, HTTP/1.0,
Flask's test client) the request thread streams as before.
"""

import logging
import queue
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

log = logging.getLogger(__name__)

RETRY_S = 0.005  # how soon a socket that would not take everything is tried again


class Events(Protocol):
    """What the writer runs: api/submission.py's EventStream."""

    ended: bool
    deadline: float
    opening: list[bytes]
    chunks: Any  # api/submission.py's Chunks

    def take(self, chunk: Any) -> list[bytes]: ...
    def timed_out(self) -> list[bytes]: ...
    def cancel(self) -> None: ...


class _Out:
    """A stream the writer owns: its events, its socket and what the socket has not taken yet."""

    __slots__ = ("events", "sock", "pending", "expired", "done", "error")

    def __init__(self, events: Events, sock: socket.socket):
        self.events, self.sock = events, sock
        self.pending = bytearray()
        self.expired = False  # set by the request thread past the deadline
        self.done = threading.Event()
        self.error: Exception | None = None


class StreamWriter:
    def __init__(self) -> None:
        self._woken: queue.SimpleQueue[_Out] = queue.SimpleQueue()  # streams with something to send
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def body(self, events: Events, environ: dict) -> Iterator[bytes] | None:
        """The WSGI body that has this writer send `events`, or None where it cannot (then the caller's thread
        streams them). Its first item, empty, makes gunicorn send the headers; it ends once the stream has."""
        sock = environ.get("gunicorn.socket")
        if type(sock) is not socket.socket or environ.get("SERVER_PROTOCOL") != "HTTP/1.1":
            return None
        return self._body(_Out(events, sock))

    def _body(self, out: _Out) -> Iterator[bytes]:
        yield b""  # gunicorn sends the headers (a chunked body: its empty write sends nothing more)
        self._start()
        out.pending += _framed(out.events.opening)
        out.events.chunks.waker = lambda: self._woken.put(out)
        self._woken.put(out)  # what came before the waker was set
        if not out.done.wait(max(0.0, out.events.deadline - time.monotonic())):
            out.expired = True
            self._woken.put(out)
            out.done.wait()
        if out.error:
            raise out.error  # gunicorn closes the connection

    def _start(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():  # a fork's child has no thread of its parent
                self._thread = threading.Thread(target=self._run, name="stream-writer", daemon=True)
                self._thread.start()
                log.info("streamed responses: sent by this front end's writer thread")

    def _run(self) -> None:
        backlog: set[_Out] = set()  # streams whose socket would not take everything
        while True:
            ready = set(backlog)
            try:
                ready.add(self._woken.get(timeout=RETRY_S if backlog else None))
                while True:
                    ready.add(self._woken.get_nowait())
            except queue.Empty:
                pass
            backlog.clear()
            for out in ready:
                if not out.done.is_set() and not self._serve(out):  # _serve ends a stream on any failure
                    backlog.add(out)

    def _serve(self, out: _Out) -> bool:
        """Render what `out`'s completions have put and send it; False while the socket holds some back."""
        events = out.events
        try:
            if out.expired and not events.ended:
                out.pending += _framed(events.timed_out())
            chunks = events.chunks.queue
            while not events.ended and not chunks.empty():  # this thread alone takes from it: no raised Empty
                out.pending += _framed(events.take(chunks.get_nowait()))
            while out.pending:
                sent = out.sock.send(out.pending, socket.MSG_DONTWAIT)
                del out.pending[:sent]
        except BlockingIOError:
            return False
        except Exception as err:  # the client went away (OSError), or rendering failed
            if not isinstance(err, OSError):
                log.exception("streaming a response failed")
            out.error = err
            try:
                events.cancel()
            except Exception:
                log.exception("cancelling a stream's requests failed")
            out.done.set()
            return True
        if events.ended:
            out.done.set()
        return True


def _framed(events: list[bytes]) -> bytes:
    """Each event as one chunk of HTTP/1.1's chunked body, as gunicorn frames each item of the body it sends."""
    return b"".join(b"%X\r\n%s\r\n" % (len(event), event) for event in events)
