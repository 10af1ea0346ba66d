"""One random GPT-2 checkpoint for two servers: a Hugging Face directory for this one, GGUF files for llama.cpp.

The Hugging Face directory holds config.json and model.safetensors (what model/loader.py reads) and the
GPT-2 tokenizer files vocab.json and merges.txt, rebuilt from the offline tiktoken ranks (llama.cpp's
convert_hf_to_gguf.py loads the tokenizer through transformers and checks its pre-tokenizer against
GPT-2's), and the same as tokenizer.json (what vLLM loads). Everything is written once into the work
directory; a rerun finds it there.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import tiktoken.load
import torch

from benchmarks.engine_vs_transformers import to_transformers
from model.loader import load_model
from model.tokenizer import EOT_ID, EOT_TOKEN, VOCAB_FILE, VOCAB_SHA256

GGUF_TYPES = ("f32", "f16")
CONVERTER = "convert_hf_to_gguf.py"


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte (its encoder.py `bytes_to_unicode`): printable Latin-1 bytes stand
    for themselves, the others map to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return {b: chr(b) if b in printable else chr(next(extra)) for b in range(256)}


def bpe_parts(ranks: dict[bytes, int], token: bytes, max_rank: int) -> list[bytes]:
    """`token` merged by byte-pair encoding using only merges of rank below `max_rank`: for a token of that rank,
    the two parts its own merge joins."""
    parts = [bytes([b]) for b in token]
    while True:
        pairs = [(ranks.get(a + b), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        best = min(((rank, i) for rank, i in pairs if rank is not None and rank < max_rank), default=None)
        if best is None:
            return parts
        i = best[1]
        parts[i : i + 2] = [parts[i] + parts[i + 1]]


def tokenizer_files() -> tuple[dict[str, int], list[str]]:
    """GPT-2's vocab.json (printable token -> id) and merges.txt lines, from the tiktoken ranks."""
    ranks = tiktoken.load.load_tiktoken_bpe(str(VOCAB_FILE), expected_hash=VOCAB_SHA256)
    show = byte_to_unicode()
    printable = lambda token: "".join(show[b] for b in token)
    vocab = {printable(token): rank for token, rank in ranks.items()} | {EOT_TOKEN: EOT_ID}
    merges = ["#version: 0.2"]
    for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
        if len(token) == 1:
            continue  # a byte: no merge made it
        parts = bpe_parts(ranks, token, rank)
        assert len(parts) == 2, (token, parts)
        merges.append(f"{printable(parts[0])} {printable(parts[1])}")
    return vocab, merges


def write_hf_checkpoint(model: str, seed: int, directory: Path) -> Path:
    """random:`model`'s weights from `seed` (as the server draws them) with the tokenizer, in `directory`."""
    if (directory / "model.safetensors").is_file() and (directory / "tokenizer.json").is_file():
        return directory
    loaded = load_model(f"random:{model}", torch.device("cpu"), torch.float32, seed)
    hf = to_transformers(loaded.model)
    hf.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())
    # transformers 5 no longer writes GPT-2's n_ctx, which the converter reads as the context length
    (directory / "config.json").write_text(json.dumps(config | {"n_ctx": config["n_positions"]}, indent=2))
    vocab, merges = tokenizer_files()
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (directory / "merges.txt").write_text("\n".join(merges) + "\n")
    write_tokenizer_json(vocab, merges, directory / "tokenizer.json")
    return directory


def write_tokenizer_json(vocab: dict[str, int], merges: list[str], path: Path) -> None:
    """The same tokenizer as one tokenizer.json (the `tokenizers` library's), which vLLM loads: transformers 5's
    GPT2TokenizerFast built from vocab.json and merges.txt alone encodes every text to no tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    pairs = [tuple(line.split(" ")) for line in merges[1:]]  # after the "#version" line
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's split pattern
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(EOT_TOKEN, special=True)])
    tokenizer.save(str(path))


def convert_to_gguf(hf_dir: Path, llama_src: Path, out_type: str, out: Path) -> Path:
    """`hf_dir` as a GGUF file of `out_type`, by llama.cpp's own converter with its own gguf-py."""
    if out.is_file():
        return out
    converter = llama_src / CONVERTER
    if not converter.is_file():
        raise FileNotFoundError(f"no {CONVERTER} in {llama_src}: give --llama-src, llama.cpp's source directory")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(llama_src / "gguf-py"), os.environ.get("PYTHONPATH", "")])}
    partial = out.with_suffix(".partial")  # a conversion cut short is never taken for a finished one
    command = [sys.executable, str(converter), str(hf_dir), "--outtype", out_type, "--outfile", str(partial)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{CONVERTER} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    partial.rename(out)
    return out


def prepare(
    model: str, seed: int, work_dir: Path, llama_src: Path | None, gguf_types: tuple[str, ...] = GGUF_TYPES
) -> tuple[Path, dict[str, Path]]:
    """The Hugging Face directory and a GGUF file per `gguf_types` for random:`model` from `seed`, under
    `work_dir`. Without `llama_src` the GGUF files must be there already."""
    base = work_dir / f"{model}-seed{seed}"
    hf_dir = write_hf_checkpoint(model, seed, base / "hf")
    ggufs = {}
    for out_type in gguf_types:
        out = base / f"{model}-{out_type}.gguf"
        if not out.is_file() and llama_src is None:
            raise FileNotFoundError(f"{out} is not there yet: give --llama-src to convert it")
        ggufs[out_type] = convert_to_gguf(hf_dir, llama_src, out_type, out) if llama_src else out
    return hf_dir, ggufs
