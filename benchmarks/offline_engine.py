"""The engine without the server, on a benchmark's requests: `LLM.generate` over all of them at once, in a
fresh process, as a freshly started server would meet them (nothing warmed but what the engine warms itself).

benchmarks.peers runs it as the system `offline`: what the server's own path costs is the server's output
tok/s against this one's, on the same requests and settings. Reads the requests from a JSON file
([[prompt token ids, new tokens], ...]); the engine's settings from the environment, as ./server.sh does;
prints one JSON line: each request's generated token ids, the wall time of the generate call and the cores
busy during it (client.cpu's groups: this process as "server", and "other").

MODEL=DIR python -m benchmarks.offline_engine requests.json
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

from client import cpu
from config import EngineSettings
from generate.llm import LLM, SamplingParams


def main(argv: list[str]) -> int:
    (path,) = argv
    requests = json.loads(Path(path).read_text())
    llm = LLM(**dataclasses.asdict(EngineSettings.from_env()))
    params = [SamplingParams(max_tokens=new_tokens, temperature=0.0) for _, new_tokens in requests]
    before, began = cpu.sample(None), time.perf_counter()
    outputs = llm.generate([prompt for prompt, _ in requests], params)
    wall_s, used = time.perf_counter() - began, cpu.usage(before, cpu.sample(None))
    if used is not None:  # this process is the sampler's "client"
        used |= {"server": used["client"], "client": 0.0}
    tokens = [output.outputs[0].token_ids for output in outputs]
    print(json.dumps({"tokens": tokens, "duration_s": wall_s, "cpu": used}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
