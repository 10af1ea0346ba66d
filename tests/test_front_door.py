"""The front door: the exposed command of docs/operations.md, HOST=0.0.0.0 ./server.sh, serves through real HAProxy
(deploy/) before gunicorn on loopback, with its read timeout, per-client limits, header-size limit and TLS.

The server listens on 0.0.0.0 and the tests connect through loopback, from several source addresses
(all of 127.0.0.0/8 is this machine on Linux): each address is a client of its own to HAProxy.
"""

import contextlib
import os
import re
import resource
import selectors
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import requests
from conftest import sim_settings
from requests.adapters import HTTPAdapter

from client.launch import ROOT, free_port, server_env, start_server, stop_server
from model.tokenizer import load_tokenizer

HAPROXY = shutil.which("haproxy", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/local/sbin")
pytestmark = pytest.mark.skipif(HAPROXY is None, reason="haproxy is not installed: apt-get install haproxy")
TOKENIZER = load_tokenizer()
KEY = "open-sesame-7f3a"
READ_TIMEOUT_S = 15  # the front's REQUEST_READ_TIMEOUT_S in these tests (30 by default)
LIMIT_REQUESTS = 40  # per client and LIMIT_PERIOD_S, in the address-limited server


@dataclass
class Front:
    url: str
    port: int  # HAProxy's; the server's own is port + 1, on loopback
    log: Path  # server.sh's output: HAProxy's and the server's
    run_dir: Path  # cluster.sh's: HAProxy's configuration and admin socket


def start_front(directory: Path, tiny_checkpoint: Path, **settings: str) -> tuple[subprocess.Popen, Front]:
    run_dir = directory / "run"
    run_dir.mkdir()
    env = {"HOST": "0.0.0.0", "MODEL": str(tiny_checkpoint), "KV_CACHE_BLOCKS": "1024", "RUN_DIR": str(run_dir)}
    proc, url = start_server("dynamic", directory, **env, **settings)
    port = int(url.rsplit(":", 1)[1])
    return proc, Front(url, port, directory / f"server-dynamic-{port}.log", run_dir)


@contextlib.contextmanager
def running_front(directory: Path, tiny_checkpoint: Path, **settings: str):
    proc, front = start_front(directory, tiny_checkpoint, **settings)
    try:
        yield front
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def front(tiny_checkpoint, tmp_path_factory):
    """Exposed over HTTP, without API_KEY, each client address limited to LIMIT_REQUESTS a minute."""
    limits = {"LIMIT_REQUESTS": str(LIMIT_REQUESTS), "LIMIT_PERIOD_S": "60"}
    settings = {"REQUEST_READ_TIMEOUT_S": str(READ_TIMEOUT_S), **limits}
    with running_front(tmp_path_factory.mktemp("front"), tiny_checkpoint, **settings) as front:
        yield front


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1, as docs/operations.md makes one: the PEM HAProxy gets
    (certificate and key), and the certificate alone, for the clients to trust."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed: apt-get install openssl")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost"]
        + ["-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    bundle = directory / "server.pem"
    bundle.write_text(cert.read_text() + key.read_text())
    return bundle, cert


@pytest.fixture(scope="module")
def tls_front(tiny_checkpoint, tmp_path_factory, certificate):
    """Exposed over HTTPS, with API_KEY, and headers limited to 4 KiB."""
    bundle, _ = certificate
    settings = {"TLS_CERT": str(bundle), "API_KEY": KEY, "MAX_HEADER_BYTES": "4096"}
    with running_front(tmp_path_factory.mktemp("tls-front"), tiny_checkpoint, **settings) as front:
        yield front


class SourceAddress(HTTPAdapter):
    """Connections from this local address (127.0.0.x): another client, as HAProxy sees it."""

    def __init__(self, address: str):
        self.address = address
        super().__init__()

    def init_poolmanager(self, *args, **kwargs) -> None:
        super().init_poolmanager(*args, source_address=(self.address, 0), **kwargs)


def client_at(address: str) -> requests.Session:
    session = requests.Session()
    for scheme in ("http://", "https://"):
        session.mount(scheme, SourceAddress(address))
    return session


def admin(front: Front, command: str) -> str:
    """HAProxy's answer to a command on its admin socket (in cluster.sh's run directory)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.connect(str(front.run_dir / "haproxy.sock"))
        sock.sendall(command.encode() + b"\n")
        return b"".join(iter(lambda: sock.recv(65536), b"")).decode()


def connections_from(front: Front, address: str) -> int:
    """Connections HAProxy holds from this address now: its per-client count (conn_cur)."""
    entry = admin(front, f"show table per_address key ::ffff:{address}")
    return int(match.group(1)) if (match := re.search(r"conn_cur=(\d+)", entry)) else 0


def complete(url: str, session: requests.Session | None = None, **kwargs) -> requests.Response:
    body = {"prompt": "The lighthouse keeper", "max_tokens": 4, "temperature": 0}
    return (session or requests).post(f"{url}/v1/completions", json=body, timeout=30, **kwargs)


# --- slow clients -----------------------------------------------------------------------------------


class SlowClients:
    """Connections that send a request line and then one header byte a second, never finishing;
    each from one of `addresses` in turn. Records when the server closed each one."""

    def __init__(self, port: int, count: int, addresses: list[str]):
        self.sockets = []
        for i in range(count):
            sock = socket.create_connection(
                ("127.0.0.1", port), timeout=10, source_address=(addresses[i % len(addresses)], 0)
            )
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: front\r\nX-Slow: ")
            sock.setblocking(False)
            self.sockets.append(sock)
        self.closed_at: dict[socket.socket, float] = {}
        self.answers: dict[socket.socket, bytes] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)
        self.thread.start()

    def _trickle(self) -> None:
        selector = selectors.DefaultSelector()
        for sock in self.sockets:
            selector.register(sock, selectors.EVENT_READ)
        next_byte = time.monotonic()
        while not self.stop.is_set() and len(self.closed_at) < len(self.sockets):
            for key, _ in selector.select(timeout=0.1):  # the server answers (408) or closes
                sock = key.fileobj
                with contextlib.suppress(OSError):
                    self.answers[sock] = self.answers.get(sock, b"") + sock.recv(4096)
                selector.unregister(sock)
                self.closed_at[sock] = time.monotonic()
            if time.monotonic() >= next_byte:
                next_byte += 1.0
                for sock in self.sockets:
                    if sock not in self.closed_at:
                        with contextlib.suppress(BlockingIOError, OSError):  # a closed one shows up as readable
                            sock.send(b"x")
        selector.close()

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        for sock in self.sockets:
            sock.close()


def test_1600_slow_header_connections_leave_the_server_serving_and_are_closed_by_it(front):
    """The attack that stops gunicorn facing the network (1,600 connections trickling headers hold
    all its ~1,300 threads: /health times out at 10 s, see docs/operations.md): through the front door, /health answers
    within 1 s and a short completion within 5 s while HAProxy holds them all, and HAProxy closes every
    one once REQUEST_READ_TIMEOUT_S has passed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 4096:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    # 100 connections from each of 16 addresses: each under LIMIT_CONNECTIONS (256 by default), so
    # the front door holds all of them and its read timeout alone must cope
    addresses = [f"127.0.0.{10 + i}" for i in range(16)]

    def held() -> int:
        return sum(connections_from(front, address) for address in addresses)

    started = time.monotonic()
    slow = SlowClients(front.port, 1600, addresses)
    try:
        deadline = time.monotonic() + 10
        while held() < 1600:
            assert time.monotonic() < deadline, "HAProxy did not take all 1,600 connections"
            time.sleep(0.1)  # polling interval under a deadline
        probe = client_at("127.0.0.9")  # an address with its budget whole (start-up polled from 127.0.0.1)
        health, completion = [], []
        while time.monotonic() - started < READ_TIMEOUT_S - 3:  # while every slow connection is held
            t0 = time.monotonic()
            assert probe.get(f"{front.url}/health", timeout=10).status_code == 200
            health.append(time.monotonic() - t0)
            t0 = time.monotonic()
            answer = complete(front.url, probe)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
            completion.append(time.monotonic() - t0)
            time.sleep(max(0.0, 1.0 - health[-1] - completion[-1]))  # a round a second: under LIMIT_REQUESTS
        assert not slow.closed_at, "a slow connection was closed before the measurements ended"
        assert held() == 1600
        assert len(health) >= 5 and max(health) < 1.0, health
        assert max(completion) < 5.0, completion
        deadline = time.monotonic() + READ_TIMEOUT_S + 30
        while len(slow.closed_at) < 1600:
            assert time.monotonic() < deadline, f"{1600 - len(slow.closed_at)} slow connections still open"
            time.sleep(0.2)  # polling interval under a deadline
    finally:
        slow.close()
    # closed by the server once the read timeout passed (not before), each with its 408
    assert min(slow.closed_at.values()) - started >= READ_TIMEOUT_S - 1
    answers = Counter(answer[:12] for answer in slow.answers.values())
    assert answers == {b"HTTP/1.1 408": 1600}, answers


def test_a_body_trickled_slower_than_the_read_timeout_gets_a_408(front):
    """REQUEST_READ_TIMEOUT_S covers the body too (HAProxy buffers it before a replica sees it)."""
    with socket.create_connection(("127.0.0.1", front.port), source_address=("127.0.0.26", 0)) as sock:
        head = b"POST /v1/completions HTTP/1.1\r\nHost: front\r\nContent-Type: application/json\r\n"
        sock.sendall(head + b'Content-Length: 100\r\n\r\n{"prompt": "')
        started = time.monotonic()
        sock.settimeout(1.0)
        answer = b""
        while not answer:
            assert time.monotonic() - started < READ_TIMEOUT_S + 10, "the slow body was not cut off"
            try:
                answer = sock.recv(4096)
            except TimeoutError:
                sock.sendall(b"a")  # a byte of the body a second
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started >= READ_TIMEOUT_S - 1


# --- per-client limits ------------------------------------------------------------------------------


def test_a_client_over_its_request_rate_gets_429s_while_another_is_served(front):
    greedy, other = client_at("127.0.0.2"), client_at("127.0.0.3")
    codes = [greedy.get(f"{front.url}/v1/models", timeout=10).status_code for _ in range(LIMIT_REQUESTS + 10)]
    assert codes[: LIMIT_REQUESTS - 1] == [200] * (LIMIT_REQUESTS - 1) and codes[-10:] == [429] * 10, codes
    refused = greedy.post(f"{front.url}/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=10)
    assert refused.status_code == 429 and refused.headers["Retry-After"] == "60"
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "rate_limit_exceeded"
    assert "LIMIT_REQUESTS" in error["message"]
    # the other client is served as before
    assert other.get(f"{front.url}/v1/models", timeout=10).status_code == 200
    answer = complete(front.url, other)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4


def test_a_client_over_its_connections_gets_429s_while_another_is_served(front):
    limit = 256  # LIMIT_CONNECTIONS' default
    client = client_at("127.0.0.4")
    held = [socket.create_connection(("127.0.0.1", front.port), source_address=("127.0.0.4", 0)) for _ in range(limit)]
    try:
        deadline = time.monotonic() + 10
        while connections_from(front, "127.0.0.4") < limit:  # all accepted (and counted) by HAProxy
            assert time.monotonic() < deadline, "HAProxy did not take the connections"
            time.sleep(0.05)  # polling interval under a deadline
        refused = client.get(f"{front.url}/v1/models", timeout=10)  # its first request: the rate is not it
        assert refused.status_code == 429 and refused.json()["error"]["code"] == 429
        assert client_at("127.0.0.5").get(f"{front.url}/v1/models", timeout=10).status_code == 200
    finally:
        for sock in held:
            sock.close()


def test_with_limit_by_key_one_key_is_one_client_from_any_address(tiny_checkpoint, tmp_path):
    settings = {"API_KEY": KEY, "LIMIT_BY": "key", "LIMIT_REQUESTS": "6", "LIMIT_PERIOD_S": "60"}
    auth = {"Authorization": f"Bearer {KEY}"}
    with running_front(tmp_path, tiny_checkpoint, **settings) as front:
        first, second = client_at("127.0.0.6"), client_at("127.0.0.7")
        served = [first.get(f"{front.url}/v1/models", headers=auth, timeout=10).status_code for _ in range(4)]
        # the key's budget, spent from one address, is spent for every address
        later = [second.get(f"{front.url}/v1/models", headers=auth, timeout=10).status_code for _ in range(4)]
        # a request without the key counts for its address, which has sent none: the server's 401
        unkeyed = second.get(f"{front.url}/v1/models", timeout=10)
        log = front.log.read_text()
    assert served == [200] * 4 and later[-2:] == [429, 429], (served, later)
    assert unkeyed.status_code == 401
    assert KEY not in log and "no API_KEY" not in log


# --- headers, TLS, the key ----------------------------------------------------------------------------


def test_headers_over_max_header_bytes_get_a_400_from_the_front(tls_front, certificate):
    _, cert = certificate
    auth = {"Authorization": f"Bearer {KEY}"}
    fits = {f"X-Fill-{i}": "y" * 600 for i in range(5)}  # about 3.1 KB, under MAX_HEADER_BYTES=4096
    over = {f"X-Fill-{i}": "y" * 600 for i in range(8)}  # about 5 KB; each line far under gunicorn's own limit
    assert requests.get(f"{tls_front.url}/v1/models", headers={**auth, **fits}, verify=cert, timeout=10).ok
    refused = requests.get(f"{tls_front.url}/v1/models", headers={**auth, **over}, verify=cert, timeout=10)
    assert refused.status_code == 400 and "X-Replica" not in refused.headers  # HAProxy's answer, not the server's
    assert requests.get(f"{tls_front.url}/health", verify=cert, timeout=10).status_code == 200  # still serving


def test_https_completions_streamed_and_not(tls_front, certificate, hf_greedy):
    _, cert = certificate
    prompt = "The lighthouse keeper"
    expected = TOKENIZER.decode(hf_greedy(TOKENIZER.encode(prompt), 12))
    with openai.DefaultHttpxClient(
        verify=ssl.create_default_context(cafile=cert)
    ) as http:  # the client's own HTTP library
        client = openai.OpenAI(base_url=f"{tls_front.url}/v1", api_key=KEY, http_client=http, max_retries=0)
        (model,) = client.models.list().data
        args = dict(model=model.id, prompt=prompt, max_tokens=12, temperature=0)
        whole = client.completions.create(**args)
        events = list(client.completions.create(**args, stream=True))
    assert whole.choices[0].text == expected
    assert "".join(event.choices[0].text for event in events if event.choices) == expected
    assert len([event for event in events if event.choices and event.choices[0].text]) >= 6  # token by token
    # plain HTTP to the HTTPS port is refused, not served
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.1:{tls_front.port}/health", timeout=10)


def test_streamed_events_pass_the_tls_front_one_by_one(tmp_path, certificate):
    """Each event leaves HAProxy, encrypted, as the server writes it, not held back to go with the next."""
    bundle, cert = certificate
    step_s = 0.04
    settings = {"HOST": "0.0.0.0", "TLS_CERT": str(bundle), "RUN_DIR": str(tmp_path), **sim_settings(tmp_path, step_s)}
    proc, url = start_server("dynamic", tmp_path, **settings)  # a token every step, whatever the machine's load
    try:
        body = {"prompt": "The lighthouse keeper", "max_tokens": 16, "ignore_eos": True, "stream": True}
        with requests.post(f"{url}/v1/completions", json=body, stream=True, verify=cert, timeout=60) as response:
            arrivals = [time.monotonic() for line in response.iter_lines() if line.startswith(b"data: {")]
    finally:
        stop_server(proc)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert len(gaps) > 8 and statistics.median(gaps) > step_s / 2, gaps


def test_the_dashboard_page_is_open_and_its_data_needs_the_key(tls_front, certificate):
    _, cert = certificate
    page = requests.get(f"{tls_front.url}/dashboard", verify=cert, timeout=10)
    assert page.status_code == 200 and 'data-key-required="true"' in page.text
    for path in ("/stats/timeline", "/stats", "/metrics"):
        assert requests.get(f"{tls_front.url}{path}", verify=cert, timeout=10).status_code == 401
    keyed = requests.get(f"{tls_front.url}/stats/timeline", headers={"Authorization": f"Bearer {KEY}"}, verify=cert)
    assert keyed.status_code == 200 and "steps" in keyed.json()


def test_the_key_is_never_logged_and_exposing_without_one_is_warned(tls_front, front):
    assert KEY not in tls_front.log.read_text()
    assert KEY not in "".join(path.read_text() for path in tls_front.run_dir.glob("*.cfg"))
    assert "no API_KEY" not in tls_front.log.read_text()
    assert "HOST=0.0.0.0 and no API_KEY" in front.log.read_text()


# --- starting and stopping ------------------------------------------------------------------------------


def test_the_server_behind_the_front_listens_on_loopback_alone(front):
    """gunicorn on 127.0.0.1:PORT+1 only: from another local address its port is closed, the front's open."""
    health = requests.get(f"{front.url}/health", timeout=10)
    assert health.status_code == 200 and "warning" not in health.json()
    assert client_at("127.0.0.8").get(f"http://127.0.0.8:{front.port}/health", timeout=10).status_code == 200
    with pytest.raises(requests.ConnectionError):
        requests.get(f"http://127.0.0.8:{front.port + 1}/health", timeout=10)
    assert requests.get(f"http://127.0.0.1:{front.port + 1}/health", timeout=10).status_code == 200


def test_without_haproxy_the_exposed_server_starts_and_says_so(tiny_checkpoint, tmp_path):
    proc, url = start_server(
        "dynamic", tmp_path, HOST="0.0.0.0", HAPROXY=str(tmp_path / "no-haproxy"), MODEL=str(tiny_checkpoint)
    )
    try:
        health = requests.get(f"{url}/health", timeout=10).json()
    finally:
        stop_server(proc)
    log = next(tmp_path.glob("server-dynamic-*.log")).read_text()
    assert health["status"] == "ok" and "without HAProxy in front" in health["warning"]
    assert "slow client" in health["warning"]
    assert "haproxy is not installed" in log and "without HAProxy in front" in log and "no API_KEY" in log


def test_sigterm_stops_the_front_and_the_server(tiny_checkpoint, tmp_path):
    proc, front = start_front(tmp_path, tiny_checkpoint)
    try:
        proc.send_signal(signal.SIGTERM)  # to server.sh alone, as a terminal's Ctrl-C or systemd would
        proc.wait(timeout=60)
        for port in (front.port, front.port + 1):  # HAProxy and gunicorn are gone
            with pytest.raises(requests.ConnectionError):
                requests.get(f"http://127.0.0.1:{port}/health", timeout=10)
        with pytest.raises(ProcessLookupError):  # and nothing else of its process group is left
            os.killpg(proc.pid, 0)
    finally:
        if proc.poll() is None:
            stop_server(proc)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"LIMIT_BY": "key"}, "LIMIT_BY=key counts requests by their API key: set API_KEY"),
        ({"TLS_CERT": "/nonexistent.pem"}, "TLS_CERT: no file"),
        ({"TLS_CERT": "/nonexistent.pem", "FRONT": "off"}, "TLS_CERT needs the front door"),
        ({"FRONT": "maybe"}, "FRONT must be auto or off"),
    ],
)
def test_server_sh_refuses_bad_front_settings(settings, message, tmp_path):
    env = server_env(HOST="0.0.0.0", PORT=str(free_port()), **settings)
    result = subprocess.run([str(ROOT / "server.sh"), "dynamic"], env=env, capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and message in result.stderr, result.stderr
