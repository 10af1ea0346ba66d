"""The baseline nobody here wrote: transformers' `generate` in static batches, offline, on the same workload.

Requests are replayed at their arrival times. Whenever the model is free it takes every request that has
arrived (up to the batch size, and as many as fit the context once left-padded), generates the longest
requested length for all of them, and gives each its own first `num_tokens` tokens. A logits processor
timestamps every step, so each request's first token, gaps and end are measured as if `generate`
streamed — the most favourable reading of a static batch.
"""

import time
from collections import deque

import torch
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from benchmarks.engine_vs_transformers import to_transformers
from client.metrics import RequestResult
from client.workloads import CONTEXT, Request, Workload
from config import EngineSettings
from generate.engine import device_and_dtype
from model.loader import load_model
from model.tokenizer import EOT_ID


class StepClock(LogitsProcessor):
    """Records when each generation step's logits are ready."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.times = device, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # kernels run ahead of Python: time the finished step
        self.times.append(time.perf_counter())
        return scores


def run_baseline(
    workload: Workload, settings: EngineSettings, batch_size: int, temperature: float
) -> tuple[list[RequestResult], float, list[list[int]]]:
    """Every request's result and generated tokens, in order, and the run's wall time; weights and device as the
    server's."""
    device, dtype = device_and_dtype(settings)
    hf = to_transformers(load_model(settings.model, device, dtype, settings.seed).model).to(device, dtype)
    torch.manual_seed(workload.requests[0].seed if workload.requests else 0)
    results: list[RequestResult | None] = [None] * len(workload.requests)
    tokens: list[list[int]] = [[] for _ in workload.requests]
    waiting = deque(range(len(workload.requests)))
    start = time.perf_counter()
    while waiting:
        # Sleeping here waits for the next arrival when the model is idle; no result is awaited.
        time.sleep(max(0.0, start + workload.offsets[waiting[0]] - time.perf_counter()))
        batch = _take_batch(waiting, workload, time.perf_counter() - start, batch_size)
        step_times, generated = _generate(hf, [workload.requests[i] for i in batch], temperature, device)
        for i, row in zip(batch, generated):
            results[i] = timed_result(workload.requests[i], workload.offsets[i], step_times, start)
            tokens[i] = row[: workload.requests[i].num_tokens]
    return results, time.perf_counter() - start, tokens


def _take_batch(waiting: deque[int], workload: Workload, now_s: float, batch_size: int) -> list[int]:
    """The arrived requests at the head of the queue that fit one left-padded batch; at least one."""
    batch = [waiting.popleft()]
    while waiting and len(batch) < batch_size and workload.offsets[waiting[0]] <= now_s:
        candidate = [workload.requests[i] for i in [*batch, waiting[0]]]
        if max(len(r.prompt_ids) for r in candidate) + max(r.num_tokens for r in candidate) > CONTEXT:
            break
        batch.append(waiting.popleft())
    return batch


@torch.inference_mode()
def _generate(
    hf, batch: list[Request], temperature: float, device: torch.device
) -> tuple[list[float], list[list[int]]]:
    """Run one static batch; the time each step's token was ready, and each row's generated tokens."""
    width = max(len(r.prompt_ids) for r in batch)
    input_ids = torch.tensor([[EOT_ID] * (width - len(r.prompt_ids)) + r.prompt_ids for r in batch])  # [B, P]
    mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in batch])  # [B, P]
    new_tokens = max(r.num_tokens for r in batch)
    config = GenerationConfig(
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=temperature > 0,
        temperature=temperature if temperature > 0 else None,
        top_k=0,  # transformers samples from the top 50 by default; the server from the whole vocabulary
        top_p=1.0,
        eos_token_id=None,  # exactly the requested lengths, as the server runs them (ignore_eos)
        pad_token_id=EOT_ID,
    )
    clock = StepClock(device)
    out = hf.generate(
        input_ids.to(device),
        attention_mask=mask.to(device),
        generation_config=config,
        logits_processor=LogitsProcessorList([clock]),
    )
    assert out.shape == (len(batch), width + new_tokens) and len(clock.times) == new_tokens
    return clock.times, out[:, width:].tolist()


def timed_result(request: Request, offset_s: float, step_times: list[float], start: float) -> RequestResult:
    """One request's timings: from its arrival (`offset_s` after `start`) to its own first and last token, the
    first `request.num_tokens` of `step_times`."""
    arrived_at, mine = start + offset_s, step_times[: request.num_tokens]
    return RequestResult(
        ok=True,
        prompt_tokens=len(request.prompt_ids),
        output_tokens=request.num_tokens,
        ttft_s=mine[0] - arrived_at,
        latency_s=mine[-1] - arrived_at,
        error=None,
        requested_tokens=request.num_tokens,
        itl_s=tuple(b - a for a, b in zip(mine, mine[1:])),
        sent_s=offset_s,
    )
