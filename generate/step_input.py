"""Turn the scheduled sequences into the flat StepBatch the model runs on."""

import torch

from generate.sequence import Sequence
from model.gpt2 import AttentionGroup, StepBatch


def build_step_batch(seqs: list[Sequence], block_size: int, device: torch.device) -> StepBatch:
    """Rows: the scheduled tokens of each sequence, in the order given (multi-token chunks first);
    logits rows: those of each sequence's logits positions (Sequence.logits_positions), in order."""
    input_ids, positions, slots, logits_rows = [], [], [], []
    for seq in seqs:
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + seq.num_scheduled_tokens
        assert end > start, "a scheduled sequence has a token to compute"
        input_ids += seq.token_ids[start:end]
        positions += range(start, end)
        slots += (seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, end))
        logits_rows += (len(input_ids) - end + p for p in seq.logits_positions())
    prefills = [s for s in seqs if s.num_scheduled_tokens > 1]
    assert seqs[: len(prefills)] == prefills, "prefills must come first"
    groups = []
    if prefills:
        groups.append(_prefill_group(prefills, block_size))
    if len(prefills) < len(seqs):
        groups.append(
            _decode_group(seqs[len(prefills) :], block_size, first_row=len(input_ids) - len(seqs) + len(prefills))
        )
    to = dict(device=device, non_blocking=True)
    return StepBatch(
        input_ids=torch.tensor(input_ids).to(**to),
        positions=torch.tensor(positions).to(**to),
        slot_mapping=torch.tensor(slots).to(**to),
        groups=[AttentionGroup(*(t if t is None else t.to(**to) for t in g)) for g in groups],
        logits_rows=torch.tensor(logits_rows, dtype=torch.long).to(**to),
    )


def _key_blocks(seqs: list[Sequence], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's blocks up to the end of its chunk, padded with block 0; and those context lengths."""
    context = torch.tensor([s.num_computed_tokens + s.num_scheduled_tokens for s in seqs])  # [B]
    width = -(-int(context.max()) // block_size)
    tables = [s.block_table[:width] for s in seqs]
    return torch.tensor([t + [0] * (width - len(t)) for t in tables]), context  # [B, nb], [B]


def _decode_group(seqs: list[Sequence], block_size: int, first_row: int) -> tuple:
    key_blocks, context = _key_blocks(seqs, block_size)  # [B, nb], [B]
    query_index = torch.arange(first_row, first_row + len(seqs)).unsqueeze(1)  # [B, 1]
    mask = torch.arange(key_blocks.shape[1] * block_size) < context.unsqueeze(1)  # [B, Lk]
    return query_index, key_blocks, mask[:, None, None, :], None  # mask [B, 1, 1, Lk]


def _prefill_group(seqs: list[Sequence], block_size: int) -> tuple:
    key_blocks, context = _key_blocks(seqs, block_size)  # [B, nb], [B]
    new = torch.tensor([s.num_scheduled_tokens for s in seqs])  # [B]
    first_row = torch.cumsum(new, 0) - new  # [B]
    longest = int(new.max())
    i = torch.arange(longest)  # query offsets
    real = i < new.unsqueeze(1)  # [B, Lq]
    query_index = torch.where(real, first_row.unsqueeze(1) + i, 0)  # [B, Lq]
    query_pos = context.unsqueeze(1) - new.unsqueeze(1) + i  # [B, Lq] position of each query
    key_pos = torch.arange(key_blocks.shape[1] * block_size)  # [Lk]
    # Causal, which also hides padded keys from real queries; padded queries see key 0
    # at least (so no NaN) and their rows are dropped.
    mask = key_pos <= query_pos.unsqueeze(2)  # [B, Lq, Lk]
    valid_rows = real.flatten().nonzero().squeeze(1)  # [rows]
    return query_index, key_blocks, mask.unsqueeze(1), valid_rows
