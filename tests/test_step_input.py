"""The step's inputs: one upload split into views, each 16-byte aligned whatever the batch, so the Triton
kernel, which compiles a variant apart for a pointer not divisible by 16, meets one variant only."""

import torch
from attention_oracle import scheduled
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from generate.step_input import build_step_inputs, upload

CPU = torch.device("cpu")
# Generation's speed depends on how busy the machine is, not on what is tested.
RELAXED = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@RELAXED
@given(st.lists(st.lists(st.integers(-(2**40), 2**40), max_size=9), min_size=1, max_size=8))
def test_every_uploaded_view_is_16_byte_aligned_and_holds_its_array(arrays):
    named = {f"a{i}": a for i, a in enumerate(arrays)}
    views = upload(CPU, **named)
    assert list(views) == list(named)
    for name, values in named.items():
        assert views[name].tolist() == values and views[name].dtype == torch.int64
        assert views[name].data_ptr() % 16 == 0, (name, [len(a) for a in arrays])


@settings(RELAXED, max_examples=60)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 300)), min_size=1, max_size=12),
    st.sampled_from([1, 4, 16]),
)
def test_step_views_are_16_byte_aligned_for_any_batch(shapes, block_size):
    # (chunk, tokens before it) of each sequence: decodes, chunks and whole prompts of any length
    seqs = scheduled(block_size, num_blocks=4096, shapes=[(n, n + before) for n, before in shapes], seed=len(shapes))
    inputs = build_step_inputs(seqs, block_size, CPU)
    paged = inputs.paged
    views = [*inputs[:4], paged.query_start, paged.context_lens, paged.block_tables]
    assert all(view.data_ptr() % 16 == 0 for view in views)
    assert paged.query_start.tolist()[-1] == inputs.input_ids.shape[0] == sum(n for n, _ in shapes)
    assert paged.context_lens.tolist() == [s.num_computed_tokens + s.num_scheduled_tokens for s in seqs]
    for row, seq in zip(paged.block_tables.tolist(), seqs):
        assert row[: len(seq.block_table)] == seq.block_table[: len(row)]
