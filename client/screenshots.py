"""Pictures of /dashboard in every mode under the same load, for docs/operations.md.

    MODEL=random:gpt2 python -m client.screenshots --out docs/dashboard

For each mode: start ./server.sh (settings from the environment, as the benchmark does), open
the page in headless Chromium, send a benchmark workload (the same prompts, lengths, seeds and
arrival times for every mode) and take the picture the same number of seconds into it.
Needs Playwright and a Chromium (see client/browser.py).
"""

import argparse
import functools
import tempfile
import threading
import time
from pathlib import Path

from client.browser import chromium
from client.client import run_load
from client.launch import running_server
from client.stream import stream_completion
from client.workloads import WORKLOADS, Workload, build
from config import MODES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("docs/dashboard"))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--workload", choices=WORKLOADS, default="seed-like")
    parser.add_argument("--numsamples", type=int, default=60)
    parser.add_argument("--rate", type=float, default=1.0, help="arrivals per second")
    parser.add_argument("--mean-tokens", type=float, default=48.0)
    parser.add_argument("--at", type=float, default=45.0, help="seconds into the load when the picture is taken")
    parser.add_argument("--width", type=int, default=1400, help="browser window width in pixels")
    return parser.parse_args(argv)


def shoot(mode: str, workload: Workload, args: argparse.Namespace, log_dir: Path) -> Path:
    path = args.out / f"{mode}.png"
    # No API key (the page would ask for one); a short grace, since the load is cut off at the picture.
    with running_server(mode, log_dir, API_KEY="", SHUTDOWN_GRACE_S="1") as url, chromium() as browser:
        page = browser.new_page(viewport={"width": args.width, "height": 1000})
        page.goto(f"{url}/dashboard")  # open before the load, so the charts over time cover all of it
        send = functools.partial(stream_completion, url, temperature=1.0, timeout=3600)
        load = threading.Thread(target=run_load, args=(send, workload.requests, workload.offsets), daemon=True)
        load.start()
        time.sleep(args.at)  # the moment of the picture, the same in every mode
        page.screenshot(path=str(path), full_page=True)
    load.join()  # the server has stopped: what was still running has failed fast
    return path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    workload = build(args.workload, args.numsamples, args.rate, args.mean_tokens)
    with tempfile.TemporaryDirectory() as log_dir:
        for mode in args.modes.split(","):
            print(f"{mode}: {shoot(mode, workload, args, Path(log_dir))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
