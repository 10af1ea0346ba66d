"""The peers comparison's parts that need no peer: the tokenizer files llama.cpp's converter and vLLM read, the
requests, the greedy agreement, the summary's rounds, the memory of a process tree, and the errors when a peer is
missing."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.gguf_files import tokenizer_files, write_tokenizer_json
from benchmarks.peers import main, parse_args, requests_for, workload
from benchmarks.peers_report import same_outputs, summary_rows
from client import memory
from client.memory import PeakMemory, tree_memory_kb
from model.tokenizer import EOT_ID, load_tokenizer

# REFERENCE §1's known ids, and text that exercises spaces, digits, contractions and bytes beyond ASCII
KNOWN = {"hello world": [31373, 995], "Hello world": [15496, 995], " The quick brown fox": [383, 2068, 7586, 21831]}
MIXED = "It's 2026: naïve café-goers don't pay €3.50\n\n  for   tea — 東京 🙂"


def test_the_tokenizer_files_make_gpt2s_tokenizer(tmp_path):
    """vocab.json and merges.txt rebuilt from the tiktoken ranks tokenize as GPT-2 does, through transformers
    (what llama.cpp's converter loads them with)."""
    import json

    from transformers import AutoTokenizer

    vocab, merges = tokenizer_files()
    (tmp_path / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (tmp_path / "merges.txt").write_text("\n".join(merges) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))  # what names the tokenizer's class
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert len(merges) == 1 + 50_000 and len(vocab) == EOT_ID + 1
    for text, ids in KNOWN.items():
        assert hf.encode(text) == ids
    assert hf.encode(MIXED) == load_tokenizer().encode(MIXED)


def test_the_tokenizer_json_makes_gpt2s_tokenizer(tmp_path):
    """tokenizer.json (what vLLM loads, through transformers) encodes and decodes as the server's tokenizer."""
    import json

    from transformers import AutoTokenizer

    write_tokenizer_json(*tokenizer_files(), tmp_path / "tokenizer.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    hf = AutoTokenizer.from_pretrained(tmp_path)
    for text, ids in KNOWN.items():
        assert hf.encode(text) == ids
    ours = load_tokenizer().encode(MIXED + "<|endoftext|>", allowed_special="all")
    assert hf.encode(MIXED + "<|endoftext|>") == ours and ours[-1] == EOT_ID
    assert hf.decode(ours) == MIXED + "<|endoftext|>"


def test_requests_are_deterministic_within_their_ranges():
    args = parse_args(["--seed", "3", "--numsamples", "50"])
    drawn = requests_for(args)
    assert drawn == requests_for(args) and drawn != requests_for(parse_args(["--seed", "4", "--numsamples", "50"]))
    assert all(16 <= len(r.prompt_ids) <= 256 and 16 <= r.num_tokens <= 128 for r in drawn)
    assert all(0 <= t < EOT_ID for r in drawn for t in r.prompt_ids)  # no end-of-text inside a prompt
    assert workload("all-at-once", drawn, args).offsets == [0.0] * 50
    offsets = workload("one-per-second", drawn, args).offsets
    assert offsets == sorted(offsets) and 20 < offsets[-1] < 90  # 49 gaps of a second on average


def test_bad_arguments_are_refused(capsys):
    for argv in (["--prompt-tokens", "900,1000"], ["--shapes", "bursty"], ["--server-env", "DTYPE"]):
        with pytest.raises(SystemExit):
            parse_args(argv)
    assert "--server-env takes KEY=VALUE" in capsys.readouterr().err


def test_the_servers_kv_pool_holds_llama_servers_context_unless_sized_by_hand():
    """KV_CACHE_BLOCKS overrides KV_CACHE_GB in the server, so a default pool must not come with a user's size."""
    args = parse_args([])
    blocks, block = int(args.server_env["KV_CACHE_BLOCKS"]), 16
    assert blocks * block == int(args.llama_flags.split("-c ")[1].split()[0])
    sized = parse_args(["--server-env", "KV_CACHE_GB=2", "--server-env", "DTYPE=bfloat16"]).server_env
    assert sized == {"KV_CACHE_GB": "2", "DTYPE": "bfloat16"}


def test_a_missing_llama_server_is_one_line_naming_the_flag_and_the_readme(tmp_path, capsys):
    assert main(["--llama-server", str(tmp_path / "nowhere"), "--work-dir", str(tmp_path)]) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "--llama-server" in error and "docs/benchmarks.md" in error
    assert not any(tmp_path.iterdir())  # nothing converted, nothing started


def test_vllm_needs_the_python_of_its_own_environment(tmp_path, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--systems", "ours,vllm"])
    assert "--vllm-python" in capsys.readouterr().err
    argv = ["--systems", "ours,vllm", "--vllm-python", str(tmp_path / "nowhere"), "--work-dir", str(tmp_path)]
    assert main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert "\n" not in error and "--vllm-python" in error
    assert not any(tmp_path.iterdir())  # nothing written, nothing started
    # a python that cannot import vllm (this one: vLLM is never installed beside the server)
    assert main([*argv[:3], sys.executable, *argv[4:]]) == 2
    assert "cannot import vllm" in capsys.readouterr().err


def _run(texts: list[str | None]) -> dict:
    return {"requests": [{"ok": text is not None, "text": text} for text in texts]}


def test_outputs_agree_when_only_broken_characters_are_rendered_differently():
    ours = _run(["abc", "x\ufffdy", "tail\ufffd", "same", None])
    theirs = _run(["abc", "x\ufffd\ufffdy", "tail", "different", "failed on our side"])
    assert same_outputs(ours, theirs) == 3


def test_each_round_compares_the_systems_that_ran_in_it():
    """The summary's round-by-round column: each system's throughput over this server's in the same round (the
    runs alternate), least and most, with their spread; this server's own row has none."""
    from statistics import stdev

    def run(system: str, repeat: int, tok_s: float) -> dict:
        summary = {"output_tokens_per_s": tok_s, "ttft_ms": None, "itl_ms": None, "requests_ok": 1}
        return {"shape": "burst", "system": system, "repeat": repeat, "summary": summary, **_run(["a"])}

    # the engine alone is faster in every round by a different amount; the means alone would hide which
    runs = [run("offline", 1, 120.0), run("ours", 1, 100.0), run("offline", 2, 99.0), run("ours", 2, 90.0)]
    runs += [run("offline", 3, 126.0), run("ours", 3, 105.0)]
    header, rows = summary_rows(runs)
    column = header.index("round by round")
    by_system = {row[1]: row[column] for row in rows}
    assert by_system == {"offline": f"1.10-1.20x (sd {stdev([1.2, 1.1, 1.2]):.3f})", "ours": "-"}
    one_round = summary_rows(runs[:2])[1]
    assert {row[1]: row[column] for row in one_round} == {"offline": "1.20x", "ours": "-"}


# Holds about 200 MiB in a child of the process the sampler watches, says so, then waits for stdin to close.
HOLDER = "import sys; block = b'1' * (200 * 2**20); print('held', flush=True); sys.stdin.read()"
PARENT = "import subprocess, sys\nsubprocess.run([sys.executable, '-c', sys.argv[1]])"


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="no /proc smaps_rollup")
def test_peak_memory_counts_the_whole_process_tree():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        with PeakMemory(parent.pid) as memory:
            assert parent.stdout.readline() == "held\n"
            assert tree_memory_kb(parent.pid)[0] > 200 * 1024  # the child's pages count as the parent's
    finally:
        parent.stdin.close()
        parent.wait(timeout=30)
    peaks = memory.peaks_mib()
    assert peaks["rss_mib"] > 200 and 200 < peaks["pss_mib"] <= peaks["rss_mib"]


# Grows by 20 MiB at each line it reads, and says so; ends when stdin closes.
GROWER = "import sys\nheld = []\nfor _ in sys.stdin:\n    held.append(b'1' * (20 * 2**20))\n    print('grown', flush=1)"


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="no /proc smaps_rollup")
def test_peak_memory_walks_a_process_only_when_its_rss_grows(monkeypatch):
    """The page-table walk for PSS, process by process: at its first sample, after its own RSS has grown, and at the
    stop. A parent whose memory stays put is walked twice, however often its child grows."""
    walks, samples = [], []
    monkeypatch.setattr(memory, "SAMPLE_EVERY_S", 0.005)
    monkeypatch.setattr(memory, "pss_kb", lambda pid: walks.append(pid) or 1)
    resident_kb = memory.resident_kb
    monkeypatch.setattr(memory, "resident_kb", lambda root: samples.append(root) or resident_kb(root))
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, GROWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )

    def grow() -> None:
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline() == "grown\n"

    def sampled_twice_more() -> None:  # the sampler has seen the tree as it is now
        count, deadline = len(samples), time.monotonic() + 30
        while len(samples) < count + 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # polling the sampler's count, with a deadline

    try:
        grow()  # the child is running
        with memory.PeakMemory(parent.pid) as peaks:
            for _ in range(3):
                sampled_twice_more()
                grow()
            sampled_twice_more()
    finally:
        parent.stdin.close()
        parent.wait(timeout=30)
    (child,) = set(walks) - {parent.pid}
    assert walks.count(parent.pid) == 2  # its first sample and the stop
    assert walks.count(child) >= 5  # its first sample, after each of its 3 growths, and the stop
    assert peaks.rss_kb > 80 * 1024 and peaks.pss_kb == 2  # each process's PSS (1 here) summed


def test_the_offline_system_is_the_engine_on_the_same_requests(tiny_checkpoint, hf_greedy, tmp_path):
    """benchmarks/offline_engine.py, as benchmarks.peers runs it for `offline`: every request's greedy tokens
    (transformers' own), its wall time and the cores busy meanwhile."""
    from client.launch import ROOT, server_env

    requests = [([464, 46371, 28356], 5), ([40, 588, 257, 3797, 13], 7)]
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    env = server_env(MODEL=str(tiny_checkpoint), KV_CACHE_BLOCKS="256", DTYPE="float32")
    command = [sys.executable, "-m", "benchmarks.offline_engine", str(tmp_path / "requests.json")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    assert out["tokens"] == [hf_greedy(prompt, n) for prompt, n in requests]
    assert out["duration_s"] > 0 and (out["cpu"] is None or out["cpu"]["server"] > 0)
