"""A GPT-2 that has learned something, as a measuring instrument: trained here, on text every machine has.

A random checkpoint's next-token distributions are nearly flat, so they can neither show a lossy mode's damage
(a quantized KV cache, int8 weights) nor hide it. This trains a small GPT-2 (GPT-2's config shape and tokenizer)
on CPython's standard library, the source and docstrings of every module of the running interpreter
(`pydoc_data/topics.py`, the language reference, among them): text nobody here wrote, on every machine with
Python. A file goes to the held-out set by a hash of its path relative to the library (1 in 20), so the same
Python splits alike everywhere. It saves the model in the Hugging Face layout that MODEL loads, with
`instrument.json`: what it read, how long it trained, and the held-out loss and perplexity of the trained model
beside the same model untrained.

    python -m benchmarks.train_instrument --out ../instrument-gpt2                 # 6 layers, 384 wide, 20 min
    python -m benchmarks.train_instrument --out /tmp/tiny --preset tiny --minutes 0.3   # seconds: for tests

transformers' GPT2LMHeadModel, AdamW with a short warm-up and cosine decay, 128-token windows drawn at random
from the training text, bfloat16 autocast where the CPU multiplies bfloat16 natively (float32 weights and
optimizer), until --minutes pass or --steps are done.
"""

import argparse
import hashlib
import json
import math
import random
import sysconfig
import time
from pathlib import Path

import torch

from model.cpu_features import native_bfloat16
from model.tokenizer import EOT_ID, load_tokenizer

PRESETS = {
    "small": dict(
        n_layer=6, n_head=6, n_embd=384
    ),  # the instrument: ~30M parameters, ~11M of them outside the embedding
    "tiny": dict(n_layer=2, n_head=2, n_embd=64),  # seconds: peaked enough for tests
}
HELD_OUT = 20  # one file in this many
EVAL_WINDOWS = 64


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__")
    return sorted(p for p in root.rglob("*.py") if not set(p.relative_to(root).parts) & set(skip))


def held_out(path: Path) -> bool:
    relative = path.relative_to(Path(sysconfig.get_paths()["stdlib"])).as_posix()
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % HELD_OUT == 0


def token_stream(files: list[Path], limit: int) -> torch.Tensor:
    """The files' text as GPT-2 tokens, each file followed by <|endoftext|>, up to `limit` tokens."""
    tokenizer, ids = load_tokenizer(), []
    for path in files:
        ids += tokenizer.encode_ordinary(path.read_text(encoding="utf-8", errors="replace")) + [EOT_ID]
        if len(ids) >= limit:
            break
    return torch.tensor(ids[:limit], dtype=torch.long)


def windows(tokens: torch.Tensor, starts: list[int], length: int) -> torch.Tensor:
    return torch.stack([tokens[s : s + length + 1] for s in starts])  # [B, length + 1]


@torch.no_grad()
def held_out_loss(model, tokens: torch.Tensor, length: int, autocast: bool) -> float:
    """Mean next-token loss (nats) over the first EVAL_WINDOWS non-overlapping windows of the held-out text."""
    model.eval()
    starts = list(range(0, len(tokens) - length - 1, length))[:EVAL_WINDOWS]
    losses = []
    for i in range(0, len(starts), 16):
        batch = windows(tokens, starts[i : i + 16], length)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses.append(model(batch[:, :-1], labels=batch[:, :-1]).loss.float().item())  # labels shift inside
    model.train()
    return sum(losses) / len(losses)


def main() -> int:
    from transformers import GPT2Config, GPT2LMHeadModel  # a benchmark's (and tests') dependency, not the server's

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the checkpoint directory to write")
    parser.add_argument("--preset", default="small", choices=sorted(PRESETS))
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--train-tokens", type=int, default=20_000_000, help="read at most this much training text")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--length", type=int, default=128, help="tokens a training window")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    files = stdlib_files()
    train_files, eval_files = [f for f in files if not held_out(f)], [f for f in files if held_out(f)]
    train, held = token_stream(train_files, args.train_tokens), token_stream(eval_files, EVAL_WINDOWS * args.length + 1)
    print(f"{len(train_files)} files, {len(train):,} tokens to train on; {len(eval_files)} held out ({len(held):,})")

    torch.manual_seed(args.seed)
    config = GPT2Config(n_positions=1024, **PRESETS[args.preset])
    model = GPT2LMHeadModel(config)
    autocast = native_bfloat16()
    untrained = held_out_loss(model, held, args.length, autocast)
    print(f"untrained: held-out loss {untrained:.3f} nats, perplexity {math.exp(untrained):,.0f}")

    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    rng, budget_s, start = random.Random(args.seed), args.minutes * 60, time.monotonic()
    step, seen = 0, 0
    while step < args.steps and (elapsed := time.monotonic() - start) < budget_s:
        progress = max(elapsed / budget_s, step / args.steps)  # warm-up, then cosine to a tenth, by clock or steps
        for group in optimizer.param_groups:
            warm = min(1.0, (step + 1) / min(50, max(1, args.steps // 5)))
            group["lr"] = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        batch = windows(train, [rng.randrange(len(train) - args.length - 1) for _ in range(args.batch)], args.length)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step, seen = step + 1, seen + batch.numel()
        if step % 100 == 0:
            print(f"step {step}: train loss {loss.item():.3f} ({seen:,} tokens, {elapsed / 60:.1f} min)", flush=True)
    trained = held_out_loss(model, held, args.length, autocast)
    minutes = (time.monotonic() - start) / 60
    print(f"trained {step} steps, {seen:,} tokens, {minutes:.1f} min: held-out loss {trained:.3f} nats, "
          f"perplexity {math.exp(trained):,.1f} (untrained {math.exp(untrained):,.0f})")  # fmt: skip

    out = Path(args.out)
    model.save_pretrained(out)
    record = {
        "preset": args.preset, **PRESETS[args.preset], "text": "CPython standard library (.py files)",
        "python": sysconfig.get_python_version(), "train_files": len(train_files), "held_out_files": len(eval_files),
        "steps": step, "tokens_seen": seen, "minutes": round(minutes, 2), "bfloat16_autocast": autocast,
        "held_out_loss": round(trained, 4), "held_out_perplexity": round(math.exp(trained), 2),
        "untrained_held_out_loss": round(untrained, 4), "untrained_held_out_perplexity": round(math.exp(untrained), 1),
    }  # fmt: skip
    (out / "instrument.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"saved to {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
