"""The segment-id tile tables (`backends/triton/segment_tables.py`) against a direct computation.

CPU: the kernels run in Triton's interpreter. Sorted ids (packed documents, uneven
lengths, a ragged last tile, strided views) give the exact ranges; ids that ever
decrease give every tile.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from exattn.backends.triton.segment_tables import segment_tile_ranges

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def expected_ranges(row_ids, col_ids, block_rows, block_cols):
    """For each row block, the column tiles holding an id of the block (sorted ids: a contiguous run,
    widened to the tiles whose id range straddles it), or every tile when some ids decrease; then the
    tiles holding the block's one id alone (sorted ids, a block of one id), else an empty range at lo."""
    tiles = -(-col_ids.shape[1] // block_cols)
    out = []
    for b in range(row_ids.shape[0]):
        rows, cols = row_ids[b].tolist(), col_ids[b].tolist()
        ordered = rows == sorted(rows) and cols == sorted(cols)
        entry = []
        for start in range(0, len(rows), block_rows):
            low, high = min(rows[start:start + block_rows]), max(rows[start:start + block_rows])
            meets = [t for t in range(tiles) if min(cols[t * block_cols:(t + 1) * block_cols]) <= high
                     and max(cols[t * block_cols:(t + 1) * block_cols]) >= low]
            if not ordered:
                lo_hi = [0, tiles]
            elif meets:
                lo_hi = [meets[0], meets[-1] + 1]
            else:  # no tile meets: an empty range at the first tile above the block's ids
                above = [t for t in range(tiles) if max(cols[t * block_cols:(t + 1) * block_cols]) >= low]
                first = above[0] if above else tiles
                lo_hi = [first, first]
            alone = [t for t in range(tiles) if set(cols[t * block_cols:(t + 1) * block_cols]) == {low}]
            if ordered and low == high and alone:
                entry.append(lo_hi + [alone[0], alone[-1] + 1])
            else:
                entry.append(lo_hi + [lo_hi[0], lo_hi[0]])
        out.append(entry)
    return torch.tensor(out, dtype=torch.int32).reshape(row_ids.shape[0], -1, 4)


def documents(lengths, batch=2):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None].expand(batch, -1)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(lengths=st.lists(st.integers(1, 90), min_size=1, max_size=8), block_rows=st.sampled_from([16, 64]),
       block_cols=st.sampled_from([16, 32]), shuffled=st.booleans())
def test_ranges_match_a_direct_count(lengths, block_rows, block_cols, shuffled):
    ids = documents(lengths).to(torch.int32).contiguous()
    if shuffled and len(lengths) > 1:
        ids = (ids * 7 % len(lengths)).to(torch.int32)
    keys = ids[:, ::2]  # a strided view of other lengths
    ranges = segment_tile_ranges(ids, keys, block_rows, block_cols)
    torch.testing.assert_close(ranges, expected_ranges(ids, keys, block_rows, block_cols), rtol=0, atol=0)
