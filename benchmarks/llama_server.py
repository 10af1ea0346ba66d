"""llama.cpp's llama-server as a peer: started like this server (its own session, a health deadline, stopped on a
signal), sent the same token-id prompts through its native /completion and timed as client/stream.py times ours.
"""

import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from client.aio_http import HttpError, post
from client.client import RequestFailed, error_text
from client.launch import free_port, start_command
from client.metrics import RequestResult, failure, streamed
from client.workloads import Request

DOCS_SECTION = 'docs/benchmarks.md, "Against llama.cpp\'s llama-server"'


def missing_binary(binary: Path) -> str | None:
    """A one-line error when `binary` is not an executable llama-server, else None."""
    if binary.is_file() and binary.stat().st_mode & 0o111:
        return None
    return f"no llama-server at {binary}: build it (see {DOCS_SECTION}) or point --llama-server at it"


def version(binary: Path) -> str:
    """What `llama-server --version` says: its build number and commit, and the compiler."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    lines = [line for line in (done.stdout + done.stderr).splitlines() if re.match(r"(version|built with)", line)]
    return "; ".join(lines) or "unknown"


def start(
    binary: Path, gguf: Path, log_dir: Path, threads: int, flags: list[str]
) -> tuple[subprocess.Popen, str, list[str]]:
    """llama-server on `gguf` on a free port, healthy (its /health answers 200 once the model is loaded): its
    process, URL and command line."""
    port = free_port()
    command = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "-t", str(threads), *flags]
    proc, url = start_command(command, log_dir / f"llama-server-{gguf.stem}-{port}.log", port)
    return proc, url, command


async def stream_completion(url: str, request: Request, *, timeout: float) -> RequestResult:
    """`request` greedy through /completion, exactly its length, streamed; never raises for a failed request. A
    coroutine, as client/stream.py's, on the same event loop.

    TTFT and gaps are timed on events that carry text, as for this server: llama-server sends no event for a
    token that ends inside a UTF-8 character and puts its bytes in the next event's text.
    """
    body = {
        "prompt": request.prompt_ids,  # token ids: no BOS is added
        "n_predict": request.num_tokens,
        "ignore_eos": True,
        "temperature": 0.0,  # greedy: the highest logit
        "stream": True,
    }
    start_s = time.perf_counter()
    try:
        arrivals, final, text = await _read_stream(url, body, timeout)
    except RequestFailed as exc:
        return failure(str(exc), time.perf_counter() - start_s, request.num_tokens)
    return streamed(
        start_s,
        time.perf_counter(),
        arrivals,
        final["tokens_evaluated"],
        final["tokens_predicted"],
        request.num_tokens,
        text=text,
    )


async def _read_stream(url: str, body: dict[str, Any], timeout: float) -> tuple[list[float], dict[str, Any], str]:
    """When each text event arrived, the closing event (stop: true) and the text; raises RequestFailed."""
    arrivals, pieces, final = [], [], None
    try:
        async with post(f"{url}/completion", body, timeout) as response:
            if response.status != 200:
                raise RequestFailed(f"HTTP {response.status}: {error_text(await response.body())}")
            async for arrived, data in response.events():
                if not data.startswith(b"{"):
                    continue
                event = json.loads(data)
                if "error" in event:
                    raise RequestFailed(f"llama-server: {event['error']}")
                if event.get("content"):
                    arrivals.append(arrived)
                    pieces.append(event["content"])
                if event.get("stop"):
                    final = event
    except (HttpError, TimeoutError, ValueError, KeyError, TypeError) as exc:
        raise RequestFailed(f"malformed or broken stream: {type(exc).__name__}: {exc}") from exc
    if final is None:
        raise RequestFailed("the stream ended without its closing event")
    return arrivals, final, "".join(pieces)
