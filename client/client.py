"""Command-line client for the inference server: one prompt, or a benchmark run of many.

python client/client.py --prompt "Once upon a time" --numtokens 40
python client/client.py --numsamples 200 --rate 4
"""

import argparse
import asyncio
import functools
import inspect
import json
import os
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

if not __package__:
    # Run as `python client/client.py`, sys.path[0] is client/ itself, where `import client` would find this
    # module instead of the package; put the repository root first.
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import requests  # noqa: E402
import uvloop  # noqa: E402
from dotenv import load_dotenv  # noqa: E402
from tqdm import tqdm  # noqa: E402

from client.data import PromptData, Sample, arrival_offsets  # noqa: E402
from client.metrics import RequestResult, failure, format_table, summarize  # noqa: E402

DEFAULT_IP = "127.0.0.1"
DEFAULT_PORT = "8500"
T = TypeVar("T")


class RequestFailed(Exception):
    """A request that did not produce a usable response; the message says why."""


def resolve_url(url: str | None) -> str:
    """`url` if given, else `IP` and `PORT` from the environment or `.env`, else the local default."""
    if url:
        return url.rstrip("/")
    load_dotenv()
    ip = os.environ.get("IP") or DEFAULT_IP
    port = os.environ.get("PORT") or DEFAULT_PORT
    return f"http://{ip}:{port}"


def post_inference(url: str, payload: dict[str, Any], timeout: float) -> dict[str, Any]:
    """The server's JSON answer to `payload`; raises RequestFailed for any error, transport or HTTP."""
    # A fresh connection per request: requests.Session is not documented as thread-safe, and a TCP handshake
    # is negligible next to generation time.
    try:
        response = requests.post(f"{url}/inference", json=payload, timeout=timeout)
    except requests.RequestException as exc:
        raise RequestFailed(f"{type(exc).__name__}: {exc}") from exc
    if response.status_code != 200:
        raise RequestFailed(f"HTTP {response.status_code}: {error_message(response)}")
    try:
        body = response.json()
    except ValueError as exc:
        raise RequestFailed(f"response is not JSON: {response.text[:200]!r}") from exc
    if not isinstance(body, dict):
        raise RequestFailed(f"response is not a JSON object: {response.text[:200]!r}")
    return body


def error_message(response: requests.Response) -> str:
    """The server's `{"error": {"type", "message"}}`, falling back to the raw body for anything else."""
    return error_text(response.content) or response.reason


def error_text(body: bytes) -> str:
    """error_message's for a body already read."""
    try:
        error = json.loads(body)["error"]
        return f"{error['type']}: {error['message']}"
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


def timed_request(url: str, sample: Sample, *, temperature: float, timeout: float) -> RequestResult:
    """Send one sample and measure it; never raises for a failed request, which is recorded instead."""
    payload = {"prompt": sample.prompt, "num_tokens": sample.num_tokens, "temperature": temperature}
    start = time.perf_counter()
    try:
        body = post_inference(url, payload, timeout)
        latency_s = time.perf_counter() - start
        return RequestResult(
            ok=True,
            prompt_tokens=int(body["prompt_tokens"]),
            output_tokens=int(body["completion_tokens"]),
            ttft_s=None if body.get("ttft_s") is None else float(body["ttft_s"]),
            latency_s=latency_s,
            error=None,
            requested_tokens=sample.num_tokens,
        )
    except RequestFailed as exc:
        error = str(exc)
    except (KeyError, TypeError, ValueError) as exc:
        error = f"malformed response: {type(exc).__name__}: {exc}"
    return failure(error, time.perf_counter() - start, sample.num_tokens)


def run_load(
    send: Callable[[T], RequestResult | Awaitable[RequestResult]],
    items: list[T],
    offsets: list[float],
    max_concurrency: int | None = None,
) -> tuple[list[RequestResult], float]:
    """`send(items[i])` at `offsets[i]` seconds into the run; the results in order and the run's wall time.

    Without `max_concurrency` every request is sent at its time, so arrivals never queue in the client. With it,
    requests beyond the cap wait for a free slot and their latency counts from when they are actually sent. A
    coroutine function `send` runs every request on one event loop in this thread (client/aio_http.py says why;
    uvloop's, whose reads and callbacks run in C), another in a thread per request.
    """
    with tqdm(total=len(items), unit="req") as progress:
        if inspect.iscoroutinefunction(send):
            return uvloop.run(_run_on_loop(send, items, offsets, max_concurrency, progress))
        return _run_in_threads(send, items, offsets, max_concurrency, progress)


async def _run_on_loop(
    send: Callable[[T], Awaitable[RequestResult]],
    items: list[T],
    offsets: list[float],
    max_concurrency: int | None,
    progress: tqdm,
) -> tuple[list[RequestResult], float]:
    slots = asyncio.Semaphore(max_concurrency or max(len(items), 1))

    async def timed_send(item: T, offset: float) -> RequestResult:
        # paces the arrivals; again while short of the time: uvloop's timers count whole milliseconds of its own
        # clock, so one may fire a fraction of a millisecond early by this one
        while (wait := start + offset - time.perf_counter()) > 0:
            await asyncio.sleep(wait)
        async with slots:
            sent_s = time.perf_counter() - start
            result = (await send(item))._replace(sent_s=sent_s)
        progress.update()
        return result

    start = time.perf_counter()
    results = await asyncio.gather(*(timed_send(item, offset) for item, offset in zip(items, offsets, strict=True)))
    return list(results), time.perf_counter() - start


def _run_in_threads(
    send: Callable[[T], RequestResult],
    items: list[T],
    offsets: list[float],
    max_concurrency: int | None,
    progress: tqdm,
) -> tuple[list[RequestResult], float]:
    progress_lock = threading.Lock()
    with ThreadPoolExecutor(max_workers=max_concurrency or max(len(items), 1)) as pool:

        def advance(_future: object) -> None:
            with progress_lock:
                progress.update()

        def timed_send(item: T) -> RequestResult:
            sent_s = time.perf_counter() - start
            return send(item)._replace(sent_s=sent_s)

        start = time.perf_counter()
        futures = []
        for item, offset in zip(items, offsets, strict=True):
            # Sleeping here paces the Poisson arrivals; it does not wait for any result.
            time.sleep(max(0.0, start + offset - time.perf_counter()))
            future = pool.submit(timed_send, item)
            future.add_done_callback(advance)
            futures.append(future)
        results = [future.result() for future in futures]
        duration_s = time.perf_counter() - start
    return results, duration_s


def fetch_stats(url: str, timeout: float) -> Any:
    """The server's `/stats` JSON; raises RequestFailed when it cannot be had."""
    try:
        response = requests.get(f"{url}/stats", timeout=timeout)
        response.raise_for_status()
        return response.json()
    except (requests.RequestException, ValueError) as exc:
        raise RequestFailed(f"GET /stats failed: {exc}") from exc


def _positive(kind: type) -> Callable[[str], Any]:
    """An argparse type that converts with `kind` and rejects values that are not > 0."""

    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error messages
    return parse


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--prompt", help="send this one prompt and print the completion")
    mode.add_argument("--numsamples", type=_positive(int), help="benchmark: send this many generated prompts")
    parser.add_argument("--numtokens", type=_positive(int), help="tokens to generate for --prompt")
    parser.add_argument(
        "--url",
        help="server address; default http://$IP:$PORT from the environment or .env, "
        f"else http://{DEFAULT_IP}:{DEFAULT_PORT}",
    )
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--timeout", type=_positive(float), default=600.0, help="seconds per request")
    parser.add_argument(
        "--rate",
        type=_positive(float),
        default=1.0,
        help="mean arrivals per second of a Poisson process; 'inf' sends all at once",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrival times")
    parser.add_argument(
        "--max-concurrency", type=_positive(int), help="most requests in flight at once; default unlimited"
    )
    parser.add_argument("--mean-tokens", type=float, default=100.0, help="mean requested tokens per sample")
    parser.add_argument("--std-tokens", type=float, default=50.0, help="standard deviation of requested tokens")
    parser.add_argument("--max-tokens", type=_positive(int), default=200, help="most requested tokens per sample")
    args = parser.parse_args(argv)
    if args.prompt is not None and args.numtokens is None:
        parser.error("--prompt needs --numtokens")
    if args.numsamples is not None and args.numtokens is not None:
        parser.error("--numtokens applies to --prompt only; --numsamples draws its own lengths")
    if args.std_tokens < 0:
        parser.error("--std-tokens must be >= 0")
    return args


def run_single(url: str, args: argparse.Namespace) -> int:
    payload = {"prompt": args.prompt, "num_tokens": args.numtokens, "temperature": args.temperature}
    try:
        body = post_inference(url, payload, args.timeout)
    except RequestFailed as exc:
        print(f"request failed: {exc}", file=sys.stderr)
        return 1
    if "completion" not in body:
        print(f"request failed: response has no completion: {body}", file=sys.stderr)
        return 1
    print(body["completion"])
    return 0


def run_benchmark(url: str, args: argparse.Namespace) -> int:
    data = PromptData(
        seed=args.seed, mean_tokens=args.mean_tokens, std_tokens=args.std_tokens, max_tokens=args.max_tokens
    )
    samples = data.samples(args.numsamples)
    offsets = arrival_offsets(args.numsamples, args.rate, args.seed)
    send = functools.partial(timed_request, url, temperature=args.temperature, timeout=args.timeout)
    results, duration_s = run_load(send, samples, offsets, args.max_concurrency)
    summary = summarize(results, duration_s)
    print(format_table(summary))
    try:
        print(json.dumps(fetch_stats(url, args.timeout), indent=2))
    except RequestFailed as exc:
        # The server's counters are informational; the run's outcome is the requests' outcome.
        print(exc, file=sys.stderr)
    return 1 if summary["requests_failed"] else 0


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 when every request succeeded, 1 otherwise (2 for bad arguments, from argparse)."""
    args = parse_args(argv)
    url = resolve_url(args.url)
    if args.prompt is not None:
        return run_single(url, args)
    return run_benchmark(url, args)


if __name__ == "__main__":
    sys.exit(main())
