"""The strongest baseline nobody here wrote: transformers' own continuous batching, offline, on the same workload.

transformers 5.x batches continuously over a paged cache (`ContinuousBatchingManager`, what
`model.generate_batch` drives): a request joins the running batch at the next step and leaves it
at its own length, as in this server. Requests are added at their arrival times, each with its
own `max_new_tokens` and end-of-text disabled, so every request gets exactly its requested length;
transformers timestamps each generated token, which gives TTFT, gaps and latency from the arrival.
No HTTP in between: the most favourable reading of it.
"""

import dataclasses
import time
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from benchmarks.engine_vs_transformers import to_transformers
from client.baseline import timed_result
from client.metrics import RequestResult
from client.workloads import Workload
from config import EngineSettings
from generate.engine import device_and_dtype
from model.loader import load_model

# Chosen on the 2-core CPU (REFERENCE: paged sdpa beat paged eager there, and a budget of 512 tokens per
# step beat 256 and 2048); on CUDA transformers sizes the step and the cache from the free memory itself.
CPU_MAX_BATCH_TOKENS = 512
ATTENTION = "sdpa"  # read through the paged cache: "paged|sdpa"
RESULT_TIMEOUT_S = 3600.0


def cb_settings(device: torch.device, workload: Workload) -> dict[str, Any]:
    """The continuous-batching configuration for this device: on CPU a cache that holds every request at
    once (transformers sizes it from GPU memory otherwise) and the step budget above."""
    if device.type == "cuda":
        return {}
    block = _block_size(ContinuousBatchingConfig())
    blocks = sum(-(-(len(r.prompt_ids) + r.num_tokens) // block) for r in workload.requests)
    return {"num_blocks": blocks + 1, "max_batch_tokens": CPU_MAX_BATCH_TOKENS}


def run_cb_baseline(
    workload: Workload, settings: EngineSettings, temperature: float
) -> tuple[list[RequestResult], float, list[list[int]], dict[str, Any]]:
    """Every request's result and generated tokens, in order, the run's wall time and the settings it ran with."""
    device, dtype = device_and_dtype(settings)
    hf = to_transformers(load_model(settings.model, device, dtype, settings.seed).model).to(device, dtype)
    hf.set_attn_implementation(ATTENTION)
    torch.manual_seed(workload.requests[0].seed if workload.requests else 0)
    generation = GenerationConfig(
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=0,  # the server samples from the whole vocabulary
        top_p=1.0,
        max_new_tokens=max((r.num_tokens for r in workload.requests), default=1),
        eos_token_id=None,  # transformers then disables end-of-text: exactly the requested lengths
        pad_token_id=0,
    )
    config = ContinuousBatchingConfig(**cb_settings(device, workload))
    manager = hf.init_continuous_batching(generation_config=generation, continuous_batching_config=config)
    if device.type == "cuda":
        manager.warmup()  # its CUDA graphs captured before the clock starts, as generate_batch does
    manager.start()
    try:
        start = time.perf_counter()
        for i, (request, offset) in enumerate(zip(workload.requests, workload.offsets, strict=True)):
            # Sleeping here replays the arrivals; no result is awaited.
            time.sleep(max(0.0, start + offset - time.perf_counter()))
            added = manager.add_request(
                request.prompt_ids, request_id=str(i), max_new_tokens=request.num_tokens, record_timestamps=True
            )
            assert added == str(i), "transformers refused a request"
        outputs = _collect(manager, len(workload.requests))
        duration_s = time.perf_counter() - start
        used = _settings_used(hf, manager, device, dtype)
    finally:
        manager.stop(block=True)
    results = [_result(workload, i, outputs[i], start) for i in range(len(workload.requests))]
    return results, duration_s, [list(outputs[i].generated_tokens) for i in range(len(outputs))], used


def _collect(manager: Any, count: int) -> dict[int, Any]:
    """Every request's finished output, by index; raises if transformers stops producing them."""
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while len(outputs) < count:
        output = manager.get_result(timeout=1.0)
        if output is None:
            if not manager.is_running() or time.monotonic() > deadline:
                raise RuntimeError(f"transformers' continuous batching stopped with {len(outputs)}/{count} done")
            continue
        if output.is_finished():
            outputs[int(output.request_id)] = output
    return outputs


def _result(workload: Workload, i: int, output: Any, start: float) -> RequestResult:
    request, stamps = workload.requests[i], output.timestamps
    assert len(output.generated_tokens) == request.num_tokens == len(stamps), "not the requested length"
    return timed_result(request, workload.offsets[i], stamps, start)


def _settings_used(hf: Any, manager: Any, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """What the run used, as transformers resolved it (attention, cache blocks, step budget)."""
    config = manager.continuous_batching_config
    cache = getattr(manager.batch_processor, "cache", None)
    return {
        "attention": hf.config._attn_implementation,
        "block_size": _block_size(config),
        "num_blocks": getattr(cache, "num_blocks", config.num_blocks),
        "max_batch_tokens": getattr(cache, "max_batch_tokens", config.max_batch_tokens),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
    }


def _block_size(config: ContinuousBatchingConfig) -> int:
    """Tokens per cache block: `page_size` from transformers 5.2x, `block_size` before."""
    names = {f.name for f in dataclasses.fields(config)}
    return getattr(config, "page_size" if "page_size" in names else "block_size")
