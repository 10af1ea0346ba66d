"""One streamed /v1/completions request, timed as serving benchmarks time it.

TTFT is from sending to the first streamed text; inter-token latencies are the gaps between
text events; the token counts come from the usage event the server sends last. Not streamed
(stream=False), a request has its latency and its usage's counts, and no TTFT.
"""

import time
from typing import Any

from msgspec.json import decode as decode_json

from client.aio_http import HttpError, post
from client.client import RequestFailed, error_text
from client.metrics import RequestResult, failure, streamed
from client.workloads import Request


async def stream_completion(
    url: str, request: Request, *, temperature: float, timeout: float, model: str | None = None, stream: bool = True
) -> RequestResult:
    """Send `request` (to `model`, if the server needs one named) and time it; never raises for a failed request,
    which is recorded instead. Any OpenAI-compatible server that takes token-id prompts and vLLM's `ignore_eos`
    answers it: this one, and vLLM (benchmarks/vllm_server.py). A coroutine: client.client.run_load runs a load's
    requests on one event loop (client/aio_http.py says why)."""
    body = (
        {
            "prompt": request.prompt_ids,
            "max_tokens": request.num_tokens,
            "temperature": temperature,
            "seed": request.seed,
            "ignore_eos": True,  # exactly the requested length, so every mode does the same work
            "stream": stream,
        }
        | ({"stream_options": {"include_usage": True}} if stream else {})
        | ({"model": model} if model else {})
    )
    start = time.perf_counter()
    try:
        arrivals, usage, replica, text = await _read(f"{url}/v1/completions", body, timeout)
    except RequestFailed as exc:
        return failure(str(exc), time.perf_counter() - start, request.num_tokens)
    if not stream:
        latency = time.perf_counter() - start
        counts = usage["prompt_tokens"], usage["completion_tokens"]
        return RequestResult(True, *counts, None, latency, None, request.num_tokens, replica=replica, text=text)
    return streamed(
        start,
        time.perf_counter(),
        arrivals,
        usage["prompt_tokens"],
        usage["completion_tokens"],
        request.num_tokens,
        replica=replica,
        text=text,
    )


async def _read(url: str, body: dict[str, Any], timeout: float) -> tuple[list[float], dict[str, int], str | None, str]:
    """When each text event arrived (none when not streamed), the usage, the replica that answered (X-Replica) and
    the text; raises RequestFailed for any error."""
    arrivals, usage, pieces = [], None, []
    try:
        async with post(url, body, timeout) as response:
            if response.status != 200:
                raise RequestFailed(f"HTTP {response.status}: {error_text(await response.body())}")
            replica = response.headers.get("x-replica")
            if not body["stream"]:
                answer = await response.json()
                return [], answer["usage"], replica, answer["choices"][0]["text"]
            async for arrived, data in response.events():
                if not data.startswith(b"{"):
                    continue  # the closing [DONE]
                event = decode_json(data)  # msgspec's: a fifth of json.loads's time on a token's event
                if "error" in event:
                    raise RequestFailed(f"{event['error']['type']}: {event['error']['message']}")
                if event["choices"] and event["choices"][0]["text"]:
                    arrivals.append(arrived)
                    pieces.append(event["choices"][0]["text"])
                usage = event.get("usage") or usage
    except (HttpError, TimeoutError, ValueError, KeyError, TypeError, IndexError) as exc:
        raise RequestFailed(f"malformed or broken answer: {type(exc).__name__}: {exc}") from exc
    if usage is None:
        raise RequestFailed("the stream ended without a usage event")
    return arrivals, usage, replica, "".join(pieces)
