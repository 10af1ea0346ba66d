"""`client.main` against a small in-process HTTP server with canned answers."""

import json
import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from client.client import main, resolve_url

STATS = {"mode": "canned", "requests": 0}
JOIN_DEADLINE_S = 10.0


class CannedServer(ThreadingHTTPServer):
    """Answers `/inference` with a fixed completion, failing every `fail_every`-th request with a 500.

    With `hold`, answers wait until `release` is set, which lets a test run a client into its timeout.
    """

    def __init__(self, fail_every: int = 0, hold: bool = False) -> None:
        super().__init__(("127.0.0.1", 0), CannedHandler)
        self.fail_every = fail_every
        self.hold = hold
        self.release = threading.Event()
        self.inference_count = 0
        self.payloads: list[dict] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    def admit(self, payload: dict) -> bool:
        """Record a request; False when it is one that must fail."""
        with self.lock:
            self.inference_count += 1
            self.payloads.append(payload)
            return not (self.fail_every and self.inference_count % self.fail_every == 0)


class CannedHandler(BaseHTTPRequestHandler):
    server: CannedServer

    def do_POST(self) -> None:
        if self.path != "/inference":
            self.reply(404, {"error": {"message": "no such route", "type": "not_found"}})
            return
        payload = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.server.hold:
            self.server.release.wait(JOIN_DEADLINE_S)
        if not self.server.admit(payload):
            self.reply(500, {"error": {"message": "canned failure", "type": "internal_error"}})
            return
        generated = " and then it ended."
        self.reply(
            200,
            {
                "completion": payload["prompt"] + generated,
                "text": generated,
                "token_ids": list(range(payload["num_tokens"])),
                "prompt_tokens": len(payload["prompt"].split()),
                "completion_tokens": payload["num_tokens"],
                "ttft_s": 0.001,
                "latency_s": 0.002,
            },
        )

    def do_GET(self) -> None:
        if self.path == "/stats":
            self.reply(200, STATS)
        else:
            self.reply(404, {"error": {"message": "no such route", "type": "not_found"}})

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: object) -> None:
        """Keep the test output free of access logs."""


@pytest.fixture
def start_server() -> Iterator[Callable[..., CannedServer]]:
    """Starts canned servers on demand and stops them all after the test."""
    with ExitStack() as stack:

        def start(fail_every: int = 0, hold: bool = False) -> CannedServer:
            server = stack.enter_context(CannedServer(fail_every, hold))
            # A short poll interval lets shutdown() return promptly at teardown.
            thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.01}, daemon=True)
            thread.start()
            stack.callback(stop, server, thread)
            return server

        yield start


def stop(server: CannedServer, thread: threading.Thread) -> None:
    server.release.set()
    server.shutdown()
    thread.join(JOIN_DEADLINE_S)
    assert not thread.is_alive(), "canned server did not stop"


def unused_url() -> str:
    """An address nothing listens on: a port the OS just handed out and took back."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def summary_value(output: str, label: str) -> str:
    return next(line for line in output.splitlines() if line.startswith(label)).split()[-1]


def test_benchmark_against_a_healthy_server(start_server, capsys):
    server = start_server()
    code = main(["--url", server.url, "--numsamples", "8", "--rate", "inf", "--temperature", "0.5"])
    out = capsys.readouterr().out
    assert code == 0
    assert summary_value(out, "requests ok") == "8"
    assert summary_value(out, "requests failed") == "0"
    assert json.loads(out[out.index("{") :]) == STATS
    assert len(server.payloads) == 8
    assert all(payload["temperature"] == 0.5 for payload in server.payloads)


def test_benchmark_counts_server_errors_as_failures(start_server, capsys):
    code = main(["--url", start_server(fail_every=3).url, "--numsamples", "9", "--rate", "inf"])
    out = capsys.readouterr().out
    assert code == 1
    assert summary_value(out, "requests ok") == "6"
    assert summary_value(out, "requests failed") == "3"
    assert "3 x HTTP 500: internal_error: canned failure" in out


def test_benchmark_paces_arrivals_at_a_finite_rate(start_server, capsys):
    # A high rate keeps the test fast while still going through the paced path.
    assert main(["--url", start_server().url, "--numsamples", "5", "--rate", "1000", "--max-concurrency", "2"]) == 0
    assert summary_value(capsys.readouterr().out, "requests ok") == "5"


def test_benchmark_survives_an_unreachable_server(capsys):
    code = main(["--url", unused_url(), "--numsamples", "3", "--rate", "inf", "--timeout", "5"])
    captured = capsys.readouterr()
    assert code == 1
    assert summary_value(captured.out, "requests failed") == "3"
    assert "ConnectionError" in captured.out
    assert "GET /stats failed" in captured.err


def test_benchmark_counts_timeouts_as_failures(start_server, capsys):
    code = main(["--url", start_server(hold=True).url, "--numsamples", "2", "--rate", "inf", "--timeout", "0.2"])
    out = capsys.readouterr().out
    assert code == 1
    assert summary_value(out, "requests failed") == "2"
    assert "ReadTimeout" in out


def test_single_prompt_prints_the_completion(start_server, capsys):
    server = start_server()
    code = main(["--url", server.url, "--prompt", "Once upon a time", "--numtokens", "7"])
    assert code == 0
    assert capsys.readouterr().out == "Once upon a time and then it ended.\n"
    assert server.payloads == [{"prompt": "Once upon a time", "num_tokens": 7, "temperature": 1.0}]


def test_single_prompt_reports_a_server_error(start_server, capsys):
    code = main(["--url", start_server(fail_every=1).url, "--prompt", "Hi", "--numtokens", "3"])
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out == ""
    assert "HTTP 500: internal_error: canned failure" in captured.err


@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt", "Hi"],  # no --numtokens
        ["--numsamples", "3", "--numtokens", "4"],
        ["--numsamples", "0"],
        ["--numsamples", "3", "--rate", "0"],
        ["--numsamples", "3", "--std-tokens", "-1"],
        [],
    ],
)
def test_bad_arguments_exit_with_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--url", "http://127.0.0.1:1", *argv])
    assert exit_info.value.code == 2


def test_url_comes_from_flag_then_environment(monkeypatch):
    assert resolve_url("http://example:1/") == "http://example:1"
    monkeypatch.setenv("IP", "10.0.0.2")
    monkeypatch.setenv("PORT", "9000")
    assert resolve_url(None) == "http://10.0.0.2:9000"
