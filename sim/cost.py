"""The cost model: how long one engine step takes, as a roofline sum over FLOPs and bytes.

A step computes `new_tokens` tokens for each of its sequences (a whole prompt, the uncached
tail of one, or a single decode token), each ending at `context_len` tokens. Its time is

    overhead + FLOPs / (peak FLOP/s * compute efficiency * GPUs)
             + bytes / (bandwidth * bandwidth efficiency * GPUs)

FLOPs: 2 per weight of the transformer blocks for every token computed, 2 per LM-head weight
for one row per sequence (only each sequence's last position needs logits; the embedding
lookup costs none), and 4 * n_layer * d_model per query-key pair of attention (q.k and the
weighted sum of values). Bytes: every weight once, the keys/values each sequence attends over,
and the new keys/values written. A mixed step (prefills beside decodes) pays for both parts.
Tensor parallelism is taken as perfect: communication between GPUs is not modelled.
"""

from collections.abc import Iterable
from typing import NamedTuple

from sim.profiles import GpuProfile, ModelProfile


class StepCost(NamedTuple):
    compute_s: float
    memory_s: float
    overhead_s: float
    total_s: float


def attention_pairs(new_tokens: int, context_len: int) -> int:
    """Query-key pairs of causal attention for the last `new_tokens` positions of `context_len`."""
    assert 0 < new_tokens <= context_len
    # query i (0-based among the new ones) sees context_len - new_tokens + i + 1 keys
    return new_tokens * context_len - new_tokens * (new_tokens - 1) // 2


def step_flops(model: ModelProfile, seqs: Iterable[tuple[int, int]]) -> float:
    """FLOPs of one step over (new_tokens, context_len) per sequence."""
    seqs = list(seqs)
    tokens = sum(n for n, _ in seqs)
    pairs = sum(attention_pairs(n, c) for n, c in seqs)
    blocks = 2 * model.n_layer * model.layer_params * tokens
    lm_head = 2 * model.vocab_size * model.d_model * len(seqs)
    return blocks + lm_head + 4 * model.n_layer * model.d_model * pairs


def step_bytes(model: ModelProfile, seqs: Iterable[tuple[int, int]]) -> float:
    """Bytes one step moves: the weights, the KV each sequence reads, the KV it writes."""
    seqs = list(seqs)
    kv_read = sum(c for _, c in seqs) * model.kv_bytes_per_token
    kv_written = sum(n for n, _ in seqs) * model.kv_bytes_per_token
    return model.weight_bytes + kv_read + kv_written


def step_cost(gpu: GpuProfile, model: ModelProfile, seqs: Iterable[tuple[int, int]], num_gpus: int = 1) -> StepCost:
    seqs = list(seqs)
    assert seqs and num_gpus >= 1
    compute = step_flops(model, seqs) / (gpu.flops * gpu.compute_efficiency * num_gpus)
    memory = step_bytes(model, seqs) / (gpu.bandwidth * gpu.bandwidth_efficiency * num_gpus)
    return StepCost(compute, memory, gpu.step_overhead_s, gpu.step_overhead_s + compute + memory)
