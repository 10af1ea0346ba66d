"""The engine process's wire (batching/channel.py): whole messages in order, a send that never blocks its thread on
a peer that reads nothing, and the peer's end seen after everything it sent."""

import socket
import threading
import time

import pytest

from batching.channel import Channel


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ends = Channel(a), Channel(b)
    yield ends
    for end in ends:
        end.close()


def messages(count: int, size: int) -> list[bytes]:
    return [bytes([i % 251]) * size + i.to_bytes(4, "little") for i in range(count)]


def read_all(end: Channel, count: int, flush: Channel | None = None) -> list[bytes]:
    got: list[bytes] = []
    deadline = time.monotonic() + 30
    while len(got) < count and time.monotonic() < deadline:
        if flush is not None:
            flush.flush()
        more = end.receive(0.05)
        assert more is not None, "the other end closed early"
        got += more
    return got


def test_a_peer_that_reads_nothing_never_blocks_a_sender_and_then_gets_every_message_whole_in_order(pair):
    """Far more than a socket's buffer holds, sent while nobody reads: each send returns at once, the rest waiting
    in the backlog; read then, with the backlog flushed meanwhile, every message arrives whole and in order, though
    reads split them anywhere."""
    sender, reader = pair
    sent = messages(200, 40_000)  # 8 MB: a Unix socket's buffer holds a few hundred kB
    backlogged: list[bool] = []
    sending = threading.Thread(target=lambda: backlogged.extend(sender.send(message) for message in sent))
    sending.start()
    sending.join(timeout=60)  # a send that waited for the reader would wait for ever: nobody reads yet
    assert not sending.is_alive() and len(backlogged) == len(sent)
    assert backlogged[0] is False and backlogged[-1] is True and sender.backlog
    assert read_all(reader, len(sent), flush=sender) == sent
    assert not sender.flush()


def test_senders_on_several_threads_never_interleave_their_messages(pair):
    sender, reader = pair
    per_thread = {t: [bytes([t]) * (1000 + 37 * i) for i in range(100)] for t in range(4)}

    def send(t: int) -> None:
        for message in per_thread[t]:
            sender.send(message, wait_s=30)

    threads = [threading.Thread(target=send, args=(t,)) for t in per_thread]
    for thread in threads:
        thread.start()
    got = read_all(reader, sum(map(len, per_thread.values())))
    for thread in threads:
        thread.join()
    for t, mine in per_thread.items():
        assert [message for message in got if message[:1] == bytes([t])] == mine  # whole, and in its order


def test_a_send_that_waits_gives_up_after_its_time_on_a_peer_that_reads_nothing(pair):
    sender, _ = pair
    with pytest.raises(TimeoutError):
        for message in messages(100, 40_000):
            sender.send(message, wait_s=0.2)


def test_the_peers_end_comes_after_everything_it_sent(pair):
    a, b = pair
    for message in messages(3, 10):
        a.send(message)
    a.close()
    assert read_all(b, 3) == messages(3, 10)
    assert b.receive() is None


def test_a_backlog_for_a_peer_that_is_gone_is_dropped_with_an_error(pair):
    """What waits for a peer that ended is nobody's: flushing it raises, and nothing is left to flush again."""
    sender, reader = pair
    while not sender.send(b"x" * 40_000):
        pass  # until the socket's buffer is full and some waits
    reader.close()
    with pytest.raises(OSError):
        sender.flush()
    assert not sender.backlog and not sender.flush()
