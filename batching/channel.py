"""One connection between the engine's process and a front end (ENGINE_PROCESS=on): a Unix stream socket carrying
whole messages, each its length (4 bytes) and its bytes (batching/wire.py's msgpack).

Why not ZMQ, which carried them before: a ZMQ socket hands each message to an I/O thread of its own in each
process, so a step's message went from the loop through ZMQ's I/O thread there and ZMQ's I/O thread in the front
end to the bridge, three threads woken where the loop's own send on a plain socket wakes one, the bridge; and on a
2-vCPU machine every thread woken in the engine's process takes a core from its forward pass. A send here is the
sending thread's own syscall and never blocks it: what the socket will not take now (a front end that has fallen
far behind) waits in the channel's backlog, in order, until `flush` sends it, so no thread ever holds half a
message.
"""

import errno
import os
import select
import socket
import struct
import threading
import time

HEADER = struct.Struct("<I")  # a message's length in bytes
READ_BYTES = 1 << 16  # a step's message for hundreds of rows in one read; a long prompt in a few


class Channel:
    """One end of a connection: `send` from any thread, `receive` from one."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.backlog = bytearray()  # whole messages' bytes the socket has not taken yet
        self._lock = threading.Lock()  # senders, and what they leave in the backlog
        self._received = bytearray()  # the part of a message the last read ended in

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, payload: bytes, wait_s: float = 0.0) -> bool:
        """Send one message, never blocking: True if some of it waits in the backlog (`flush` sends it). With
        `wait_s`, flush it here for up to that long, then raise TimeoutError if some is still left. OSError where
        the other end is gone."""
        data = HEADER.pack(len(payload)) + payload
        with self._lock:
            if self.backlog:
                self.backlog += data
            else:
                sent = _send_some(self.sock, data)
                if sent == len(data):
                    return False
                self.backlog += memoryview(data)[sent:]
        if wait_s <= 0:
            return True
        deadline = time.monotonic() + wait_s
        while self.flush():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the other end has not taken a message for {wait_s:.0f} s")
            wait(self.sock, select.POLLOUT, left)
        return False

    def flush(self) -> bool:
        """Send as much of the backlog as the socket takes now; True while some is left. OSError where the other end
        is gone, and the backlog with it (nobody will take it)."""
        with self._lock:
            if self.backlog:
                try:
                    del self.backlog[: _send_some(self.sock, self.backlog)]
                except OSError:
                    self.backlog.clear()
                    raise
            return bool(self.backlog)

    def receive(self, timeout_s: float | None = None) -> list[bytes] | None:
        """The whole messages that one read brings (waiting up to `timeout_s` for it: an empty list past that), or
        None where the other end has closed (its process ended) or broken the connection."""
        if timeout_s is not None and not wait(self.sock, select.POLLIN, timeout_s):
            return []
        try:
            data = self.sock.recv(READ_BYTES)
        except OSError:
            return None
        if not data:
            return None
        received = self._received
        received += data
        messages, at = [], 0
        while len(received) - at >= HEADER.size:
            (length,) = HEADER.unpack_from(received, at)
            end = at + HEADER.size + length
            if end > len(received):
                break
            messages.append(bytes(received[at + HEADER.size : end]))
            at = end
        del received[:at]
        return messages

    def close(self) -> None:
        self.sock.close()


def _send_some(sock: socket.socket, data: bytes | bytearray) -> int:
    try:
        return sock.send(data, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0


def wait(sock: socket.socket, event: int, timeout_s: float) -> bool:
    """Whether `sock` is ready for `event` (POLLIN, POLLOUT) within `timeout_s` (poll, not select: a front end's
    descriptors can number past select's 1024)."""
    poller = select.poll()
    poller.register(sock, event)
    return bool(poller.poll(timeout_s * 1000))


def listen(path: str) -> socket.socket:
    """The engine's socket at `path`, where every front end connects (a dead engine's file replaced)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as err:
        if err.errno != errno.EADDRINUSE:
            raise
        os.unlink(path)  # an engine before this one died without removing it
        sock.bind(path)
    sock.listen(64)
    return sock


def connect(path: str) -> Channel | None:
    """A channel to the engine listening at `path`, or None while none listens there (one may be starting)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    return Channel(sock)
