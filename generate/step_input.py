"""Turn the scheduled sequences into the flat inputs of one step.

Rows are the scheduled tokens of each sequence in the order given (multi-token chunks
first): whole prompts, prompt chunks, recomputed tails and single decode tokens, with no
padding. Every integer input goes to the device in one copy from pinned memory.
"""

from typing import NamedTuple

import torch

from generate.sequence import Sequence
from model.attention import AttentionGroup, PagedInputs


class StepInputs(NamedTuple):
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache slot of each row's key/value
    logits_rows: torch.Tensor  # [N] the rows of each sequence's logits positions (Sequence.logits_positions)
    paged: PagedInputs


def build_step_inputs(seqs: list[Sequence], block_size: int, device: torch.device) -> StepInputs:
    input_ids, positions, slots, logits_rows = [], [], [], []
    query_start, context_lens = [0], []
    for seq in seqs:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        assert end > start, "a scheduled sequence has a token to compute"
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += (seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, end))
        logits_rows += (len(input_ids) - end + p for p in seq.logits_positions())
        query_start.append(len(input_ids))
        context_lens.append(end)
    width = -(-max(context_lens) // block_size)
    tables = [
        t + [0] * (width - len(t)) for t in (s.block_table[: -(-c // block_size)] for s, c in zip(seqs, context_lens))
    ]
    t = upload(
        device,
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        logits_rows=logits_rows,
        query_start=query_start,
        context_lens=context_lens,
        block_tables=[b for row in tables for b in row],
    )
    max_query_len = max(s.num_scheduled_tokens for s in seqs)
    paged = PagedInputs(t["query_start"], t["context_lens"], t["block_tables"].view(len(seqs), width), max_query_len)
    return StepInputs(t["input_ids"], t["positions"], t["slot_mapping"], t["logits_rows"], paged)


ALIGN_BYTES = 16  # each view starts here: Triton compiles a kernel apart for pointers not divisible by 16


def upload(device: torch.device, **arrays: list[int]) -> dict[str, torch.Tensor]:
    """Integer arrays as int64 tensors on `device`, in one host-to-device copy from pinned memory.

    Each array starts at a multiple of ALIGN_BYTES in the copy (padded with zeros after the one before),
    whatever the lengths: a view at 8 bytes past would be a kernel variant of its own, compiled mid-serving.
    """
    per_slot = ALIGN_BYTES // 8  # int64s per aligned slot
    padded = [-(-len(a) // per_slot) * per_slot for a in arrays.values()]
    flat = [x for a, n in zip(arrays.values(), padded) for x in [*a, *[0] * (n - len(a))]]
    host = torch.tensor(flat, dtype=torch.int64, pin_memory=device.type == "cuda")  # [sum of padded sizes]
    moved = host.to(device, non_blocking=True)
    views = moved.split(padded)
    return {name: view[: len(a)] for (name, a), view in zip(arrays.items(), views)}


def reference_groups(seqs: list[Sequence], block_size: int, device: torch.device) -> list[AttentionGroup]:
    """The reference backend's attention groups: chunks and single rows apart, each by context length.

    Every sequence of a group is padded to the group's longest chunk and context, and gathering
    and attending over padding costs as much as over keys. So multi-token chunks and single rows
    group apart (a 500-token chunk never pads 100 decodes), and each by the power of two its
    block count rounds up to (no sequence is padded to more than twice its context).
    """
    buckets: dict[tuple[bool, int], list[tuple[int, Sequence]]] = {}  # -> (first row, sequence)
    row = 0
    for seq in seqs:
        blocks = -(-(seq.num_computed_tokens + seq.num_scheduled_tokens) // block_size)
        buckets.setdefault((seq.num_scheduled_tokens > 1, 1 << (blocks - 1).bit_length()), []).append((row, seq))
        row += seq.num_scheduled_tokens
    groups = [_group(*zip(*members), block_size) for members in buckets.values()]
    to = dict(device=device, non_blocking=True)
    return [AttentionGroup(*(t if t is None else t.to(**to) for t in g)) for g in groups]


def _group(first_rows: tuple[int, ...], seqs: tuple[Sequence, ...], block_size: int) -> tuple:
    """One group's padded query rows, key blocks and causal mask, and which of its outputs are which rows."""
    context = torch.tensor([s.num_computed_tokens + s.num_scheduled_tokens for s in seqs])  # [B]
    width = -(-int(context.max()) // block_size)
    tables = [s.block_table[:width] for s in seqs]
    key_blocks = torch.tensor([t + [0] * (width - len(t)) for t in tables])  # [B, nb] padded with block 0
    new = torch.tensor([s.num_scheduled_tokens for s in seqs])  # [B]
    i = torch.arange(int(new.max()))  # query offsets
    real = i < new.unsqueeze(1)  # [B, Lq]
    query_index = torch.where(real, torch.tensor(first_rows).unsqueeze(1) + i, 0)  # [B, Lq]
    query_pos = context.unsqueeze(1) - new.unsqueeze(1) + i  # [B, Lq] position of each query
    key_pos = torch.arange(width * block_size)  # [Lk]
    # Causal, which also hides padded keys from real queries; padded queries see key 0
    # at least (so no NaN) and their rows are dropped.
    mask = key_pos <= query_pos.unsqueeze(2)  # [B, Lq, Lk]
    valid_rows = None if bool(real.all()) else real.flatten().nonzero().squeeze(1)  # [rows]
    out_rows = query_index.flatten() if valid_rows is None else query_index.flatten()[valid_rows]  # [rows]
    return query_index, key_blocks, mask.unsqueeze(1), valid_rows, out_rows
