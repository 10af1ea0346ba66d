"""GPT-2's matrix products on this CPU: torch's default (MKL for float32) against oneDNN (model/cpu_linear.py).

Each of a layer's four products and the LM head, at each batch size (rows: one token each, as in a decode
step), timed alternately for the two libraries, the median of --repeats runs; their largest difference too.

python -m benchmarks.cpu_linear --model gpt2 --rows 1,64,256
python -m benchmarks.cpu_linear --model gpt2-medium --dtype bfloat16
"""

import argparse
import statistics
import time

import torch

from model.cpu_features import cpu_flags
from model.cpu_linear import onednn_available
from model.gpt2 import PRESETS


def products(model: str) -> dict[str, tuple[int, int]]:
    """Name -> (in, out) features of each product in a GPT-2 layer, and of the LM head."""
    c = PRESETS[model]
    e = c.n_embd
    return {"c_attn": (e, 3 * e), "attn.c_proj": (e, e), "c_fc": (e, 4 * e), "mlp.c_proj": (4 * e, e),
            "lm_head": (e, c.vocab_size)}  # fmt: skip


def timed(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def measure(rows: int, features: tuple[int, int], dtype: torch.dtype, repeats: int) -> tuple[float, float, float]:
    """Median ms of torch's F.linear and of oneDNN's, alternated, and the largest |difference| of their outputs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(rows, features[0], generator=gen).to(dtype)
    w = (torch.randn(features[1], features[0], generator=gen) * 0.02).to(dtype)
    b = torch.zeros(features[1], dtype=dtype)
    aten = lambda: torch.nn.functional.linear(x, w, b)
    onednn = lambda: torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    ours, theirs = [], []
    with torch.inference_mode():
        aten(), onednn()  # first calls: allocations, oneDNN's primitive cache
        for _ in range(repeats):
            ours += timed(aten, 1)
            theirs += timed(onednn, 1)
        diff = (aten().float() - onednn().float()).abs().max().item()
    return statistics.median(ours) * 1e3, statistics.median(theirs) * 1e3, diff


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2", choices=sorted(PRESETS))
    parser.add_argument("--rows", default="1,64,256", help="rows of each product (a decode step's batch)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    assert onednn_available(), "this torch has no oneDNN linear op"
    dtype = getattr(torch, args.dtype)
    flags = sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}, flags {flags}")
    print(f"{'product':>12} {'rows':>5} {'torch ms':>9} {'oneDNN ms':>10} {'speed-up':>9} {'max |diff|':>11}")
    for rows in map(int, args.rows.split(",")):
        totals = [0.0, 0.0]
        for name, features in products(args.model).items():
            ours, theirs, diff = measure(rows, features, dtype, args.repeats)
            totals[0] += ours * (1 if name == "lm_head" else PRESETS[args.model].n_layer)
            totals[1] += theirs * (1 if name == "lm_head" else PRESETS[args.model].n_layer)
            print(f"{name:>12} {rows:>5} {ours:>9.3f} {theirs:>10.3f} {ours / theirs:>8.2f}x {diff:>11.2e}")
        print(f"{'all products':>12} {rows:>5} {totals[0]:>9.2f} {totals[1]:>10.2f} {totals[0] / totals[1]:>8.2f}x")


if __name__ == "__main__":
    main()
