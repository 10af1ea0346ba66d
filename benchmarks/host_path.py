"""The server's own cost, with no model at all: ENGINE=sim over a runner whose every step sleeps a fixed time.

A GPU's step is short, so there the server's Python (scheduling, building, delivering, every streamed event's
JSON and socket write) sets the speed; this measures that Python on any machine. Each run is client/benchmark.py's
`saturate` with N streamed requests against ./server.sh dynamic on ENGINE=sim whose steps each take --step-ms
(the runner sleeps, holding no lock and no core), for each ENGINE_PROCESS, API_SERVER_COUNT (front ends: gunicorn
workers on the one engine process), STREAM_INTERVAL and N given. Printed:
output tok/s; the engine's host time per step: the step's time less the runner's sleep (mean and p50 over the
run's steps), and less all the simulated runner's time (its sleep, its cost model standing for a real runner's
input building, its made-up tokens standing for sampling: what is left is the engine's own, scheduling,
bookkeeping, delivery); and the server's CPU time per output token (all its processes: the engine's and the front
end's).

    python -m benchmarks.host_path                                   # 20 ms steps: 128 and 256 requests
    python -m benchmarks.host_path --step-ms 3 --requests 128 --engine-process off,on --stream-interval 1
    python -m benchmarks.host_path --requests 128 --engine-process on --api-server-count 1,2
    python -m benchmarks.host_path --loop-only --requests 128 --step-ms 1 --rounds 3

--loop-only measures the engine's own time without the server around it: the engine process's loop (its
EngineCore and BatchingManager over the same simulated runner) in this process, fed the requests a front end would
send (wire.Submit: a 60-token prompt, 500 tokens each, greedy), its messages taken off as its sender would, every
request --rounds times in turn. No HTTP, no front end, no client shares the cores with it, so its figure is the
engine's own, which a run through the server also pays, plus whatever the cores it shares cost it there: the step
less the runner's time from the step records (as above), and the loop's wall-clock time a step less the runner's
(between steps too: taking requests, handing the step's messages to the sender).
"""

import argparse
import contextlib
import functools
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from sim.profiles import write_fixed_step_profile

ROOT = Path(__file__).resolve().parent.parent
RUNNER_STAGES = ("build", "forward", "mask", "sample")  # what sim/runner.py's run() laps


def run(directory: Path, gpu: Path, layout: tuple[str, str], interval: int, requests: int) -> dict:
    engine_process, front_ends = layout
    out = directory / f"engine-{engine_process}-{front_ends}-interval-{interval}-{requests}"
    env = {**os.environ, "ENGINE": "sim", "SIM_MODEL": "gpt2", "SIM_GPU": str(gpu), "DTYPE": "", "TQDM_DISABLE": "1"}
    env.update(ENGINE_PROCESS=engine_process, API_SERVER_COUNT=front_ends, STREAM_INTERVAL=str(interval))
    command = [sys.executable, "client/benchmark.py", "--workload", "saturate", "--modes", "dynamic"]
    subprocess.run([*command, "--numsamples", str(requests), "--out", str(out)], cwd=ROOT, env=env, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    (result,) = json.loads((out / "results.json").read_text())["runs"]
    summary, steps, cpu = result["summary"], result["server_stats"]["recent_steps"], result["cpu"]
    stages = steps["stage_time_s"]
    sleep_s = stages["forward"]
    runner_s = sum(stages.get(stage, 0.0) for stage in RUNNER_STAGES)
    return {
        "out_tok_s": summary["output_tokens_per_s"],
        "host_ms": (steps["step_time_s"]["mean"] - sleep_s) * 1e3,
        "host_p50_ms": (steps["step_time_s"]["p50"] - sleep_s) * 1e3,
        "engine_ms": (steps["step_time_s"]["mean"] - runner_s) * 1e3,
        "cpu_us_per_token": cpu["server"] * summary["duration_s"] / summary["output_tokens"] * 1e6,
        "server_cores": cpu["server"],
    }


def loop_only(gpu: Path, requests: int, rounds: int) -> dict:
    """The engine process's loop in this process, over ENGINE=sim's runner (the module's --loop-only)."""
    from batching import wire
    from batching.engine_process import EngineCore
    from batching.manager import BatchingManager
    from config import Settings
    from sim.engine import simulated_engine
    from sim.runner import SimRunner

    settings = Settings.of(engine="sim", sim_model="gpt2", sim_gpu=str(gpu), dtype="")
    core = EngineCore(restarts=0)
    build = functools.partial(simulated_engine, settings.engine, announce=False)
    manager = BatchingManager(build, settings, core.flush)
    core.attach(manager)
    manager.start()
    params = wire.Params(500, 0.0, 0, 1.0, None, False, None, None, 0, 0.0, 0.0, 1.0, [], None)
    completion = wire.Completion(list(range(1000, 1060)), params, forks=False, faulty=False)
    runner = manager.engine.runner
    assert isinstance(runner, SimRunner)
    step_runner, runner_s = runner.run, [0.0]

    def timed_run(*args, **kwargs):  # the runner's whole time, sleep and cost model: not the engine's own
        start = time.perf_counter()
        try:
            return step_runner(*args, **kwargs)
        finally:
            runner_s[0] += time.perf_counter() - start

    runner.run = timed_run
    first, start = manager.engine.num_steps, time.perf_counter()
    for round_ in range(rounds):
        for rid in range(requests):
            ack = core.submit(wire.Submit(os.getpid(), round_ * requests + rid, [completion], [], 0, "", None, True))
            assert ack.refusal is None, ack
        while core.requests:  # as a front end: every message taken off
            with contextlib.suppress(queue.Empty):
                core.outgoing.get(timeout=0.1)
    elapsed, steps = time.perf_counter() - start, manager.engine.num_steps - first
    records = manager.engine.step_log.since(first)
    manager.shut_down(0)
    manager.join()
    own = [r.duration_s - sum(r.stages.get(stage, 0.0) for stage in RUNNER_STAGES) for r in records]
    return {"steps": steps, "engine_ms": statistics.mean(own) * 1e3, "loop_ms": (elapsed - runner_s[0]) / steps * 1e3}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--step-ms", type=float, default=20.0, help="each step's time (the runner sleeps it)")
    parser.add_argument("--requests", default="128,256")
    parser.add_argument("--engine-process", default="off,on")
    parser.add_argument("--api-server-count", default="1", help="front ends; above 1 with ENGINE_PROCESS=on only")
    parser.add_argument("--stream-interval", default="1,32")
    parser.add_argument("--rounds", type=int, default=1, help="each setting this many times, in turns")
    parser.add_argument("--loop-only", action="store_true", help="the engine's loop alone, in this process")
    args = parser.parse_args()
    if args.loop_only:
        print(f"the engine process's loop alone over ENGINE=sim, every step {args.step_ms:g} ms of sleep")
        print("requests | rounds | steps | engine's own ms/step (records) | loop's ms/step less the runner")
        with tempfile.TemporaryDirectory() as tmp:
            gpu = write_fixed_step_profile(Path(tmp), args.step_ms / 1e3)
            for requests in args.requests.split(","):
                r = loop_only(gpu, int(requests), args.rounds)
                own, loop = r["engine_ms"], r["loop_ms"]
                print(f"{requests:>8} | {args.rounds:>6} | {r['steps']:>5} | {own:30.3f} | {loop:.3f}")
        return 0
    print(f"ENGINE=sim, every step {args.step_ms:g} ms of sleep; saturate, every request streamed")
    print("requests | ENGINE_PROCESS | API_SERVER_COUNT | STREAM_INTERVAL | out tok/s | host ms/step (mean, p50) | "
          "engine's own ms/step | server CPU µs/token")  # fmt: skip
    layouts = [
        (process, count)
        for process in args.engine_process.split(",")
        for count in args.api_server_count.split(",")
        if process == "on" or count == "1"
    ]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        gpu = write_fixed_step_profile(directory, args.step_ms / 1e3)
        for requests in args.requests.split(","):
            for interval in args.stream_interval.split(","):
                for _ in range(args.rounds):
                    for layout in layouts:
                        r = run(directory, gpu, layout, int(interval), int(requests))
                        print(
                            f"{requests:>8} | {layout[0]:>14} | {layout[1]:>16} | {interval:>15} | "
                            f"{r['out_tok_s']:9.0f} | "
                            f"{r['host_ms']:10.2f}, {r['host_p50_ms']:5.2f}    | {r['engine_ms']:10.2f} | "
                            f"{r['cpu_us_per_token']:8.1f}",
                            flush=True,
                        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
