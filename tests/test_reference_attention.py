"""The reference attention backend (gather + scaled_dot_product_attention) against attention written from scratch."""

import pytest
import torch
from attention_oracle import LAYOUTS, SHAPES, D, H, dense_attention, random_cache, scheduled

from generate.step_input import reference_groups
from model.attention import GatherSpace, LayerKV, ReferenceAttention

CPU = torch.device("cpu")
# chunks and decodes whose contexts are far apart, interleaved: several groups whose rows are not contiguous
MIXED = [(40, 100), (5, 900), (3, 120), (300, 310), (7, 20), (1, 300), (1, 1), (1, 1024), (1, 17), (1, 33), (1, 2)]
MIXED += [(1, 64), (1, 16), (1, 1000)]


@pytest.mark.parametrize("shapes", [*SHAPES, "mixed"])
@pytest.mark.parametrize("block_size", [16, 4])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_reference_equals_dense_attention(shapes, block_size, layout):
    seqs = scheduled(block_size, num_blocks=1200, shapes=SHAPES.get(shapes, MIXED), seed=len(shapes))
    gen = torch.Generator().manual_seed(0)
    caches = [random_cache(layout, 1200, block_size, gen) for _ in range(2)]
    rows = sum(s.num_scheduled_tokens for s in seqs)
    q = torch.randn((rows, H, D), generator=gen)
    groups = reference_groups(seqs, block_size, CPU)
    got = ReferenceAttention(groups, GatherSpace()).attend(q, LayerKV(*caches))
    torch.testing.assert_close(got.double(), dense_attention(q, *caches, seqs, block_size), atol=1e-5, rtol=1e-5)
    assert sorted(torch.cat([g.out_rows for g in groups]).tolist()) == list(range(rows)), "every row exactly once"


def test_no_sequence_is_padded_to_twice_its_context():
    block_size = 16
    seqs = scheduled(block_size, num_blocks=1200, shapes=MIXED, seed=1)
    rows, first = {}, 0  # step row -> the blocks its sequence's context fills
    for seq in seqs:
        blocks = -(-(seq.num_computed_tokens + seq.num_scheduled_tokens) // block_size)
        rows |= {r: blocks for r in range(first, first + seq.num_scheduled_tokens)}
        first += seq.num_scheduled_tokens
    groups = reference_groups(seqs, block_size, CPU)
    assert sum(g.query_index.shape[1] == 1 for g in groups) > 1, "decodes of far-apart contexts group apart"
    for group in groups:
        width = group.key_blocks.shape[1]  # every sequence of the group is padded to this many blocks
        assert all(width < 2 * rows[r] for r in group.out_rows.tolist())
