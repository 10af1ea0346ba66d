"""benchmarks/decode_step.py from its command line: a row per batch size, every sequence decoding together; the
profiler's table of a decode step; the kernel's knobs swept."""

import itertools
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from model import cpu_attention, cpu_linear


def decode_step(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.decode_step", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ | env,
    )  # fmt: skip


def test_times_each_batch_size_with_the_whole_batch_decoding():
    # At batch 8 the prompts' 800 tokens take four steps of a 256-token budget, during which the
    # first prompts already decode: they must not run out of tokens before the timing ends.
    args = ("--model", "gpt2", "--batch-sizes", "1,8", "--context", "100", "--steps", "2", "--profile")
    run = decode_step(*args, MAX_BATCH_TOKENS="256")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    rows = [[cell.strip() for cell in line.split("|")] for line in lines if line[:5].strip().isdigit()]
    assert [int(row[0]) for row in rows] == [1, 8]
    for batch, context, step_ms, tokens_per_s, floor_ms, *_ in rows:
        assert 100 < float(context) < 130  # the prompt, and what the timed steps decoded after it
        assert abs(float(tokens_per_s) - int(batch) * 1000 / float(step_ms)) <= 1  # both printed rounded
        assert 0 < float(floor_ms) < float(step_ms)  # no CPU step reaches its memory floor
    # after each row, the profiler's table of one more decode step: the model's operators, with their times
    assert [line for line in lines if line.startswith("profile of one decode step")] == [
        "profile of one decode step at batch 1:",
        "profile of one decode step at batch 8:",
    ]
    # the products as the server runs them on a CPU in float32 (CPU_LINEAR=auto: oneDNN's), and the attention's
    linear = "mkldnn::_linear_pointwise" if cpu_linear.onednn_available() else "aten::addmm"
    attention = "gpt2_cpu::paged_attention" if cpu_attention.available() else "aten::bmm"
    assert "Self CPU" in run.stdout and linear in run.stdout and attention in run.stdout


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not __import__("torch").cuda.is_available(),
    reason="the kernel runs on CUDA or under Triton's interpreter",
)
def test_sweep_prints_every_knob_combination_with_the_default_first():
    pytest.importorskip("triton")
    tiny = ["--model", "gpt2", "--heads", "1", "--batch-sizes", "1", "--context", "8", "--steps", "1"]
    run = decode_step("--sweep", *tiny)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")] for line in run.stdout.splitlines() if line.count("|") == 8]
    header, rows = rows[0], rows[1:]
    assert header[1:4] == ["warps", "BLOCK_N", "BLOCK_M"]
    knobs = [(int(r[1]), int(r[2]), int(r[3]), r[4]) for r in rows]
    expected = set(itertools.product((2, 4, 8), (32, 64, 128), (1, 16), ("int32", "int64")))
    assert len(knobs) == len(expected) == 36 and set(knobs) == expected
    assert [r[0] for r in rows].count("*") == 1 and rows[0][0] == "*"  # the engine's default, marked once
    assert all(float(r[7]) > 0 and r[5:7] == ["1", "8"] for r in rows)


@pytest.mark.skipif(not cpu_attention.available(), reason="the CPU kernel does not build here")
@pytest.mark.parametrize("cache", ["auto", "int8"])
def test_ops_prints_each_cpu_kernel_with_the_rate_its_bytes_and_time_give(cache):
    args = ("--ops", "--model", "gpt2", "--batch-sizes", "2,3", "--context", "40", "--kv-cache-dtype", cache)
    run = decode_step(*args, DTYPE="float32")
    assert run.returncode == 0, run.stderr[-3000:]
    assert [line.split(":")[0] for line in run.stdout.splitlines() if line.startswith("batch")] == [
        f"batch {batch}, {'torch.int8' if cache == 'int8' else 'torch.float32'} cache" for batch in (2, 3)
    ]
    rows = [[c.strip() for c in line.split("|")] for line in run.stdout.splitlines() if line.startswith("  ")]
    assert [row[0] for row in rows] == 2 * [
        "store_kv, a decode row per sequence",
        "store_kv, a 40-token prompt chunk",
        "attention, a decode row per sequence over 40 keys",
    ]
    # a token's keys (or values) in a layer: float32, or int8 with a float32 scale per head; a store reads float32
    stored = 12 * 64 * 4 if cache == "auto" else 12 * 64 + 12 * 4
    for batch, (name, ms, gb_per_s, _) in zip((2, 2, 2, 3, 3, 3), rows, strict=True):
        if name.startswith("attention"):
            moved = 2 * batch * 40 * stored  # keys and values read
        else:
            rows_stored = batch if name.startswith("store_kv, a decode") else 40
            moved = 2 * rows_stored * (12 * 64 * 4 + stored)  # keys and values, read and written
        assert float(gb_per_s) == pytest.approx(moved / float(ms) / 1e6, rel=0.05, abs=0.15)  # both printed rounded
