"""Decode step time of the engine, in process, against the memory-bandwidth floor of that step.

For each batch size, `batch` random prompts of `--context` tokens are prefilled, then decode
steps are timed (the device synchronised around them): mean step time, tokens/s, and the
floor — bytes a decode step must read (every weight once, every sequence's keys/values) and
write (the new keys/values), over the device's memory bandwidth — with the step's time split
into its stages (schedule, build, forward, sample) from the engine's step records. On a GPU the
host does not wait for the forward pass until sampling reads the tokens back, so there the
forward stage is the launch time and the wait lands in sample. With asynchronous scheduling
(ASYNC_SCHEDULING, on wherever CUDA graphs run) a step's record runs from its launch to the
read of its tokens, while the next step is built: its stages overlap the next one's, and only
the step time is the loop's.

EngineSettings come from the environment as for the server (ATTENTION_BACKEND, CUDA_GRAPHS,
ASYNC_SCHEDULING, DEVICE, DTYPE), so the same command measures each backend:

    DEVICE=cuda python -m benchmarks.decode_step --batch-sizes 1,32,128,256 --context 200
    DEVICE=cuda ATTENTION_BACKEND=reference CUDA_GRAPHS=off python -m benchmarks.decode_step
    python -m benchmarks.decode_step --model gpt2 --batch-sizes 1,8 --steps 10      # CPU
    DEVICE=cuda python -m benchmarks.decode_step --profile     # and a profiler's table of one decode step per batch
    DEVICE=cuda python -m benchmarks.decode_step --sweep --batch-sizes 32,128,256   # the kernel's knobs instead
    python -m benchmarks.decode_step --model gpt2 --ops --batch-sizes 64 --context 256   # CPU kernels alone
    python -m benchmarks.decode_step --model gpt2 --ops --batch-sizes 64 --kv-cache-dtype int8   # over an int8 cache

--ops times the CPU kernels (model/cpu_attention.cpp) alone, every layer's cache in turn (a pool far past the
last-level cache, as a step reads it): storing a step's keys and values (one row per sequence, and a prompt chunk
of --context rows) and a decode row's attention per sequence, each in GB/s of the bytes it must move against a
large copy's. Over an int8 cache (--kv-cache-dtype int8, or KV_CACHE_DTYPE) those bytes are the int8 rows and
their float32 scales (one per token and head), and a store reads rows in the model's dtype and writes them quantized.
"""

import argparse
import math
import statistics
import time
from dataclasses import replace
from types import SimpleNamespace

import torch

from config import EngineSettings
from generate.engine import Engine, device_and_dtype, set_products
from generate.model_runner import ModelRunner
from generate.sequence import SamplingParams, Sequence
from kvcache.block_manager import BlockManager
from model.attention import CACHE_DTYPES
from model.gpt2 import GPT, PRESETS, GPTConfig
from model.loader import load_model

BLOCK_SIZE = 16
WARMUP_STEPS = 3  # past the first decode step: every code path and graph bucket in use


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-medium", choices=sorted(PRESETS), help="preset, random weights")
    parser.add_argument("--batch-sizes", default="1,32,128,256")
    parser.add_argument(
        "--context", type=int, default=200, help="prompt tokens per sequence (the table gives the mean context timed)"
    )
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per batch size")
    parser.add_argument("--bandwidth", type=float, help="bytes/s for the floor (default: a large copy's, measured)")
    parser.add_argument("--profile", action="store_true", help="print torch.profiler's table of one decode step")
    parser.add_argument(
        "--sweep", action="store_true", help="time one layer's decode attention under every kernel setting instead"
    )
    parser.add_argument("--heads", type=int, help="--sweep: attention heads (default: the model's)")
    parser.add_argument("--ops", action="store_true", help="time the CPU kernels alone instead (store, attention)")
    parser.add_argument(
        "--scattered-blocks",
        action="store_true",
        help="--ops: each sequence's blocks anywhere in the pool, as a long-used pool's free queue gives them (default:"
        " where the server's allocator puts a burst's: prompts admitted together, then grown to --context together)",
    )
    parser.add_argument(
        "--kv-cache-dtype", choices=("auto", "int8"), help="the cache's dtype (default: KV_CACHE_DTYPE's, or auto)"
    )
    return parser.parse_args()


def step_bytes(model: GPT, dtype: torch.dtype, batch: int, context: float, cache: torch.dtype | None = None) -> float:
    """What one decode step must move: every weight once, each sequence's cache read, its new key/value written
    (in `cache`'s dtype with their scales, None: the model's)."""
    element = torch.tensor([], dtype=dtype).element_size()
    with torch.device("meta"):  # the float model's parameters: the products' own modules hold theirs in other forms
        weights = sum(p.numel() for p in GPT(model.config).parameters()) * element  # the tied LM head counted once
    return weights + batch * (context + 1) * model.config.kv_bytes_per_token(dtype, cache)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs it asynchronously; the CPU already has)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes/s of a large tensor copy (read + write): the device's practical memory bandwidth.

    No kernel reaches a datasheet's figure, so the floor is what a copy of far more than the caches
    achieves on this device.
    """
    # 1 GiB each way on a CPU too: a server CPU's last-level cache may hold hundreds of MiB (480 on a Xeon here,
    # where a copy of 64 MiB measured 15-40 % above one of 1 GiB)
    src = torch.randint(0, 256, (512 * 2**20 if device.type == "cuda" else 2**30,), dtype=torch.uint8)
    src = src.to(device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = math.inf
    for _ in range(10):  # the best of ten, as the kernels' figures are a best of trials: a VM's neighbours vary
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best


def time_ops(
    config: GPTConfig,
    dtype: torch.dtype,
    batch: int,
    context: int,
    bandwidth: float,
    cache_dtype: torch.dtype | None,
    scattered: bool = False,
) -> None:
    """Print the CPU kernels' ms per layer and GB/s: storing keys and values, and a decode step's attention, over a
    cache in `dtype` or (cache_dtype int8) quantized, each sequence's blocks where the server's allocator puts a
    burst's (burst_tables) or (`scattered`) anywhere in the pool."""
    from model import cpu_attention
    from model.attention import LayerKV, paged_cache, paged_scales

    assert cpu_attention.available(), cpu_attention.build_problem()
    H, D, L, per_seq = config.n_head, config.head_dim, config.n_layer, -(-(context + 1) // BLOCK_SIZE)
    pool = dict(blocks=batch * per_seq, block_size=BLOCK_SIZE, heads=H)
    cache = paged_cache(L, 2, **pool, head_dim=D, dtype=cache_dtype or dtype)  # [L, 2, NB, bs, H, D]
    scales = paged_scales(L, 2, **pool, device="cpu") if cache_dtype else None  # [L, 2, NB, bs, H]
    # every page written before the clock starts
    if cache_dtype is None:
        cache.normal_()
    else:
        cache.random_(-127, 128)
        scales.uniform_(0.01, 0.02)
    if scales is None:
        layers = [LayerKV(k, v) for k, v in cache]
    else:
        layers = [LayerKV(k, v, k_scale, v_scale) for (k, v), (k_scale, v_scale) in zip(cache, scales)]
    scatter = torch.randperm(batch * per_seq).view(batch, per_seq)  # [B, W]: blocks anywhere in the pool
    tables = scatter if scattered else burst_tables(batch, context)  # [B, W]
    row_bytes = H * D * cache.element_size() + (H * 4 if cache_dtype else 0)  # a token's keys (or values) in a layer
    row_in = H * D * torch.tensor([], dtype=dtype).element_size()  # a new row, as the model computes it

    def per_layer(run, repeats: int, trials: int = 5) -> float:  # the best of trials, each over every layer
        run(0)
        best = math.inf
        for _ in range(trials):
            start = time.perf_counter()
            for _ in range(repeats):
                for layer in range(L):
                    run(layer)
            best = min(best, (time.perf_counter() - start) / (repeats * L))
        return best

    def store(rows: torch.Tensor, slots: torch.Tensor) -> tuple[float, float]:  # seconds, bytes/s
        seconds = per_layer(lambda i: cpu_attention.CpuAttention.store(layers[i], rows, rows, slots), 20)
        return seconds, 2 * rows.shape[0] * (row_in + row_bytes) / seconds  # keys and values, read and written

    new = torch.randn(max(batch, context), H, D).to(dtype)  # [T, H, D]
    decode_slots = tables[:, -1] * BLOCK_SIZE  # each sequence's last block
    chunk_slots = tables[0, :].repeat_interleave(BLOCK_SIZE)[:context] * BLOCK_SIZE + torch.arange(context) % BLOCK_SIZE
    q, lens = torch.randn(batch, H, D).to(dtype), torch.full((batch,), context)
    query_start = torch.arange(batch + 1)
    attend = lambda i: cpu_attention._kernel(q, layers[i], query_start, lens, tables, D**-0.5)  # noqa: E731
    attention = per_layer(attend, 3)
    rows = [
        ("store_kv, a decode row per sequence", *store(new[:batch], decode_slots)),
        (f"store_kv, a {context}-token prompt chunk", *store(new[:context], chunk_slots)),
        (f"attention, a decode row per sequence over {context} keys", attention,
         2 * batch * context * row_bytes / attention),
    ]  # fmt: skip
    print(f"batch {batch}, {cache.dtype} cache: op | ms a layer | GB/s | of a copy's {bandwidth / 1e9:.1f}")
    for name, seconds, rate in rows:
        print(f"  {name} | {1000 * seconds:.4f} | {rate / 1e9:.1f} | {100 * rate / bandwidth:.0f}%")


def burst_tables(batch: int, context: int) -> torch.Tensor:
    """[B, W] block tables as the server's allocator (kvcache/block_manager.py) lays out a burst in a fresh pool:
    `batch` prompts of half the context admitted one after another, each with room for its growth, then every
    sequence grown a token at a time together to `context` + 1 tokens."""
    per_seq, prompt = -(-(context + 1) // BLOCK_SIZE), max(1, context // 2)
    blocks = BlockManager(batch * per_seq, BLOCK_SIZE, prefix_cache=False)
    seqs = [
        SimpleNamespace(token_ids=[0] * prompt, block_table=[], num_shared_tokens=0, num_committed_blocks=0,
                        reads_prefix_cache=False, lora_id=0)
        for _ in range(batch)
    ]  # fmt: skip
    for seq in seqs:
        blocks.allocate(seq, room=per_seq - blocks.blocks_for(prompt))
    for _ in range(prompt, context + 1):
        for seq in seqs:
            seq.token_ids.append(0)
            blocks.append_slot(seq)
    return torch.tensor([seq.block_table for seq in seqs])


def make_engine(model: GPT, settings: EngineSettings, batch: int, context: int, steps: int) -> tuple[Engine, int]:
    """An engine whose budget lets the whole batch decode at once, and whose pool holds every sequence to
    its end; with the tokens each sequence generates, so that none ends before the timed steps are done.

    The first prompts decode while the last are prefilled. Those decodes take at most batch - 1 of
    a step's budget, and the budget is at least twice the batch, so the prefill's steps are bounded.
    """
    budget = max(2 * batch, settings.batch_token_budget(model.wte.weight.is_cuda, model.config.n_positions))
    prefill_steps = -(-batch * context // (budget - batch + 1))
    new_tokens = prefill_steps + WARMUP_STEPS + steps + 2
    assert context + new_tokens <= model.config.n_positions, f"{context} + {new_tokens} tokens exceed the context"
    needed = batch * -(-(context + new_tokens) // BLOCK_SIZE)
    blocks = needed + needed // 50 + 2  # room for the scheduler's admission watermark
    settings = replace(
        settings, block_size=BLOCK_SIZE, kv_cache_blocks=blocks, max_batch_size=batch, max_batch_tokens=budget
    )
    return Engine(ModelRunner.from_settings(model, blocks, settings), blocks, settings, "bench"), new_tokens


def time_decode(
    engine: Engine, model: GPT, batch: int, context: int, steps: int, new_tokens: int, profile: bool = False
) -> tuple[float, dict[str, float], float]:
    """Mean seconds per decode step of `batch` sequences of `context` prompt tokens, the mean seconds per
    stage, and the mean context the timed steps attended over (prompt and what was decoded by then); with
    `profile`, prints the profiler's table of one more decode step."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    for _ in range(batch):
        prompt = torch.randint(0, model.config.vocab_size, (context,), generator=gen).tolist()
        engine.add(Sequence(prompt, params))
    while engine.scheduler.waiting or any(s.num_generated == 0 for s in engine.scheduler.running):
        engine.step()  # the prefill, in as many chunks as the budget needs
    for _ in range(WARMUP_STEPS):
        engine.step()
    assert len(engine.scheduler.running) == batch, "the whole batch must decode together"
    synchronize(model.wte.weight.device)
    first = engine.num_steps + 1
    tokens_before = sum(len(s.token_ids) for s in engine.scheduler.running)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(model.wte.weight.device)
    seconds = (time.perf_counter() - start) / steps
    mean_context = (2 * tokens_before + batch * (steps - 1)) / (2 * batch)
    records = [r for r in engine.step_log.since(first - 1)]
    stages = {name: statistics.mean(r.stages.get(name, 0.0) for r in records) for name in records[0].stages}
    if profile:
        print(profile_step(engine, model.wte.weight.device, batch))
    while engine.has_work():
        engine.step()
    return seconds, stages, mean_context


def profile_step(engine: Engine, device: torch.device, batch: int) -> str:
    """torch.profiler's table of one decode step: where the time goes, kernel by kernel on a GPU."""
    from torch.profiler import ProfilerActivity, profile

    on_gpu = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * on_gpu
    with profile(activities=activities) as prof:
        engine.step()
        synchronize(device)
    table = prof.key_averages().table(sort_by="cuda_time_total" if on_gpu else "cpu_time_total", row_limit=30)
    return f"profile of one decode step at batch {batch}:\n{table}"


def main() -> None:
    args = parse_args()
    settings = EngineSettings.from_env()
    if args.kv_cache_dtype:
        settings = replace(settings, kv_cache_dtype=args.kv_cache_dtype)
    device, dtype = device_and_dtype(settings)
    cache_dtype = CACHE_DTYPES[settings.kv_cache_dtype]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.sweep:
        from benchmarks.kernel_sweep import sweep  # needs triton

        print(f"{args.model}: one layer's decode attention on {device}, {dtype}, prompts of {args.context} tokens")
        config = PRESETS[args.model]
        config = replace(config, n_head=args.heads, n_embd=args.heads * config.head_dim) if args.heads else config
        sweep(config, batch_sizes, args.context, dtype, device, args.steps)
        return
    if args.ops:
        bandwidth = args.bandwidth or copy_bandwidth(device)
        print(f"{args.model}'s CPU kernels, {dtype}, {torch.get_num_threads()} threads, torch {torch.__version__}")
        for batch in batch_sizes:
            time_ops(PRESETS[args.model], dtype, batch, args.context, bandwidth, cache_dtype, args.scattered_blocks)
        return
    model = load_model(f"random:{args.model}", device, dtype).model
    set_products(model, settings, device, dtype)  # as the server does (Engine.from_settings)
    bandwidth = args.bandwidth or copy_bandwidth(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"{args.model} (random weights) on {name}, {dtype}, torch {torch.__version__}")
    print(f"prompts of {args.context} tokens; the floor at {bandwidth / 1e9:.0f} GB/s")
    for i, batch in enumerate(batch_sizes):
        engine, new_tokens = make_engine(model, settings, batch, args.context, args.steps)
        if i == 0:
            graphs = "on" if engine.runner.graphs else "off"
            products = f"CPU_LINEAR={settings.cpu_linear}; QUANTIZATION={settings.quantization or 'none'}"
            cache = f"KV_CACHE_DTYPE={settings.kv_cache_dtype}"
            print(f"attention: {engine.runner.attention}; {cache}; CUDA graphs: {graphs}; {products}")
            print(
                "batch | context | step ms |   tok/s | floor ms | floor/step | schedule | build | forward | sample (ms)"
            )
        seconds, stages, context = time_decode(engine, model, batch, args.context, args.steps, new_tokens, args.profile)
        floor = step_bytes(model, dtype, batch, context, cache_dtype) / bandwidth
        parts = " | ".join(
            f"{1000 * stages.get(stage, 0.0):.2f}" for stage in ("schedule", "build", "forward", "sample")
        )
        print(
            f"{batch:>5} | {context:7.0f} | {1000 * seconds:7.2f} | {batch / seconds:7.0f} | {1000 * floor:8.3f} | "
            f"{100 * floor / seconds:9.1f}% | {parts}"
        )
        model.kv_cache = None  # the next engine allocates its own pool


if __name__ == "__main__":
    main()
