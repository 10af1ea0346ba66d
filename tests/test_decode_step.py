"""benchmarks/decode_step.py from its command line: a row per batch size, every sequence decoding together."""

import subprocess
import sys

from conftest import ROOT


def test_times_each_batch_size_with_the_whole_batch_decoding():
    # At batch 8 the prompts' 800 tokens take four steps of the CPU's 256-token budget, during
    # which the first prompts already decode: they must not run out of tokens before the timing ends.
    args = ["--model", "gpt2", "--batch-sizes", "1,8", "--context", "100", "--steps", "2"]
    run = subprocess.run(
        [sys.executable, "-m", "benchmarks.decode_step", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    rows = [[cell.strip() for cell in line.split("|")] for line in lines if line[:5].strip().isdigit()]
    assert [int(row[0]) for row in rows] == [1, 8]
    for batch, context, step_ms, tokens_per_s, floor_ms, *_ in rows:
        assert 100 < float(context) < 130  # the prompt, and what the timed steps decoded after it
        assert abs(float(tokens_per_s) - int(batch) * 1000 / float(step_ms)) <= 1  # both printed rounded
        assert 0 < float(floor_ms) < float(step_ms)  # no CPU step reaches its memory floor
