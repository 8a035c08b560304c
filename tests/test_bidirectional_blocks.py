"""The bidirectional-block overlay of the tree mask (``bidirectional_block``: Gemma 3's image tokens).

Query ``i`` sees key ``j`` iff ``tree(i, j) or block[i] == block[j] >= 0``, and with a sliding window also
``depth(i) - depth(j) < window``: on one sequence this is exactly transformers' Gemma 3 mask
(``AND(sliding_window, OR(causal, blockwise))``), and every engine that honours the overlay (reference, blocked, the
automatic CPU engine, flex) matches the dense reference on real packed rows with blocks inside tree nodes.
"""

from __future__ import annotations

import random
from functools import partial

import pytest
import torch
from transformers.masking_utils import (
    and_masks,
    blockwise_overlay,
    causal_mask_function,
    or_masks,
    sliding_window_overlay,
)

from hf_tree.attention import (
    ENGINES,
    TreeAttentionOptions,
    blocked_tree_attention,
    dense_tree_mask,
    flex_tree_attention,
    reference_tree_attention,
    tree_attention_forward,
)
from hf_tree.attention.flex import tree_block_mask
from hf_tree.attention.segments import cpu_tree_attention, segment_tree_attention
from tests.helpers import detached64, relative_error, run
from tests.workloads import packed_rows, qkv

pytestmark = pytest.mark.usefixtures("one_torch_thread")
WINDOWS = [pytest.param(None, id="global"), pytest.param(3, id="window3")]
TOLERANCE = 1e-9


def blocks_in_nodes(kv_end: torch.Tensor, seed: int) -> torch.Tensor:
    """``[B, N]`` block ids (``-1``: none), rising along each row: random runs of 2-7 tokens inside segments (runs of
    equal ``kv_end``, i.e. inside one tree node), as ``hf_tree.vision.forward.image_blocks`` numbers image runs."""
    rng = random.Random(seed)
    blocks = torch.full(kv_end.shape, -1, dtype=torch.int64)
    for row, ends in enumerate(kv_end.tolist()):
        start, next_id = 0, 0
        for j in range(1, len(ends) + 1):
            if j < len(ends) and ends[j] == ends[start]:
                continue
            s = start
            while j - s >= 2:  # segment [start, j): a few blocks inside it
                a = rng.randint(s, j - 2)
                b = min(j, a + rng.randint(2, 7))
                if rng.random() < 0.7:
                    blocks[row, a:b] = next_id
                    next_id += 1
                s = b + rng.randint(0, 3)
            start = j
    assert (blocks >= 0).sum() > 10
    return blocks


def test_one_sequence_mask_is_gemma3s_own():
    """A single branch: the overlay, with and without a window, equals transformers' composition for Gemma 3."""
    n = 24
    token_type_ids = torch.zeros(1, n, dtype=torch.int64)
    token_type_ids[0, 3:9] = 1  # an image longer than the window
    token_type_ids[0, 12:16] = 1
    token_type_ids[0, 16:19] = 1  # adjacent to the previous run: one block, as Gemma 3 groups them
    from transformers.models.gemma3.modeling_gemma3 import get_block_sequence_ids_for_mask

    block_ids = get_block_sequence_ids_for_mask(token_type_ids)
    kv_end = torch.full((1, n), n)
    depth = torch.arange(n)[None]
    grid = torch.arange(n)
    for window in (None, 3):
        theirs = or_masks(causal_mask_function, blockwise_overlay(block_ids))
        if window is not None:
            theirs = and_masks(sliding_window_overlay(window), theirs)
        expected = torch.stack([torch.stack([theirs(0, 0, q, k) for k in grid]) for q in grid])
        mine = dense_tree_mask(kv_end, depth, window, block_ids)[0]
        assert torch.equal(mine, expected.bool())


def test_overlay_in_a_tree_is_each_branchs_mask():
    """Two branches after a shared image: each branch's rows of the tree mask are its own Gemma 3 mask."""
    # row: [0 1 | img img img | 5] then branch A [6 7], branch B [8 img img 11] (a second image in B's node)
    kv_end = torch.tensor([[12, 12, 12, 12, 12, 12, 8, 8, 12, 12, 12, 12]])
    depth = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7, 6, 7, 8, 9]])
    blocks = torch.tensor([[-1, -1, 0, 0, 0, -1, -1, -1, -1, 1, 1, -1]])
    mask = dense_tree_mask(kv_end, depth, None, blocks)[0]
    for path in ([0, 1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]):
        path = torch.tensor(path)
        ids = blocks[0, path]
        own = torch.tril(torch.ones(len(path), len(path), dtype=torch.bool))
        own |= (ids[:, None] == ids[None, :]) & (ids[:, None] >= 0)
        assert torch.equal(mask[path][:, path], own)
    assert not mask[6:8, 8:].any() and not mask[8:, 6:8].any()  # siblings stay apart


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("heads", [(4, 2), (4, 4)], ids=lambda h: f"{h[0]}x{h[1]}")
@pytest.mark.parametrize("tile_elements", [64, None], ids=["small-tiles", "default-tiles"])
def test_blocked_matches_reference_with_blocks(window, heads, tile_elements):
    """Small tiles cut blocks between query blocks (their later tokens join as masked keys)."""
    kv_end, position_ids = packed_rows(seed=31, max_packed_tokens=128)
    blocks = blocks_in_nodes(kv_end, seed=1)
    q, k, v = qkv(kv_end, heads, torch.float64)
    options = dict(scaling=0.37, sliding_window=window, bidirectional_block=blocks)
    out, grads = run(
        partial(blocked_tree_attention, tile_elements=tile_elements), q, k, v, kv_end, position_ids, **options
    )
    ref, ref_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    plain, _ = run(reference_tree_attention, q, k, v, kv_end, position_ids, scaling=0.37, sliding_window=window)
    assert relative_error(plain, ref) > 1e-3  # the overlay matters on these rows
    assert relative_error(out, ref) <= TOLERANCE
    assert all(relative_error(g, r) <= TOLERANCE for g, r in zip(grads, ref_grads))


def test_cpu_engine_sends_blocks_to_the_blocked_engine():
    kv_end, position_ids = packed_rows(seed=32)
    blocks = blocks_in_nodes(kv_end, seed=2)
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    out, grads = run(cpu_tree_attention, q, k, v, kv_end, position_ids, scaling=0.5, bidirectional_block=blocks)
    ref, ref_grads = run(
        reference_tree_attention, q, k, v, kv_end, position_ids, scaling=0.5, bidirectional_block=blocks
    )
    assert relative_error(out, ref) <= TOLERANCE
    assert all(relative_error(g, r) <= TOLERANCE for g, r in zip(grads, ref_grads))
    none = torch.full_like(blocks, -1)  # no block: the plain tree mask (the segments engine may run)
    out, _ = run(cpu_tree_attention, q, k, v, kv_end, position_ids, scaling=0.5, bidirectional_block=none)
    ref, _ = run(reference_tree_attention, q, k, v, kv_end, position_ids, scaling=0.5)
    assert relative_error(out, ref) <= TOLERANCE
    with pytest.raises(ValueError, match="bidirectional_block=set.*blocked_tree_attention"):
        segment_tree_attention(q, k, v, kv_end, TreeAttentionOptions(scaling=0.5, bidirectional_block=blocks))
    with pytest.raises(ValueError, match="shaped like kv_end"):
        blocked_tree_attention(q, k, v, kv_end, TreeAttentionOptions(scaling=0.5, bidirectional_block=blocks[:, 1:]))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", WINDOWS)
def test_flex_forward_matches_reference_with_blocks_on_cpu(window):
    """Flex's eager CPU forward evaluates the block mask and ``mask_mod`` (with the overlay) on every element."""
    kv_end, position_ids = packed_rows(seed=33, max_packed_tokens=160, pad_to_multiple_of=16)
    blocks = blocks_in_nodes(kv_end, seed=3)
    q, k, v = qkv(kv_end, (4, 2), torch.float64)
    options = dict(scaling=0.37, sliding_window=window, bidirectional_block=blocks)
    out, _ = run(flex_tree_attention, q, k, v, kv_end, position_ids, backward=False, **options)
    ref, _ = run(reference_tree_attention, q, k, v, kv_end, position_ids, backward=False, **options)
    assert relative_error(out, ref) <= TOLERANCE


@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("block_size", [8, 16])
def test_block_mask_keeps_every_tile_the_overlay_opens(window, block_size):
    """The BlockMask (block summaries, never the N x N mask) against the dense mask cut into tiles: no visible pair is
    skipped, a "full" tile is truly full, and ``mask_mod`` on the kept tiles gives the dense mask exactly."""
    kv_end, position_ids = packed_rows(seed=34, max_packed_tokens=120, pad_to_multiple_of=16)
    blocks = blocks_in_nodes(kv_end, seed=4)
    batch, n = kv_end.shape
    block_mask = tree_block_mask(kv_end, position_ids, window, block_size=block_size, bidirectional_block=blocks)
    dense = dense_tree_mask(kv_end, position_ids, window, blocks)
    tiles = dense.view(batch, n // block_size, block_size, -1, block_size)
    kept = block_mask.to_dense()[:, 0].bool()
    full_only = type(block_mask).from_kv_blocks(
        block_mask.full_kv_num_blocks, block_mask.full_kv_indices, BLOCK_SIZE=block_size, seq_lengths=(n, n)
    )
    assert (kept >= tiles.any(dim=(2, 4))).all() and (full_only.to_dense()[:, 0].bool() <= tiles.all(dim=(2, 4))).all()
    # mask_mod on index grids inside the kept tiles = the dense mask there
    grid = torch.arange(n)
    rows = torch.arange(batch)[:, None, None]
    from_mod = block_mask.mask_mod(rows, None, grid[:, None], grid[None, :])
    element_kept = kept.repeat_interleave(block_size, 1).repeat_interleave(block_size, 2)
    assert torch.equal(from_mod & element_kept, dense)
    without = tree_block_mask(kv_end, position_ids, window, block_size=block_size)
    assert (kept.sum() > without.to_dense().bool().sum()) or window is not None  # later block tiles are kept


def test_overlay_needs_kv_end_and_the_packed_engines():
    kv_end, position_ids = packed_rows(seed=35)
    blocks = blocks_in_nodes(kv_end, seed=5)
    q, k, v = (t.detach() for t in qkv(kv_end, (4, 2), torch.float64))
    module = torch.nn.Module()
    with pytest.raises(ValueError, match="needs kv_end"):
        tree_attention_forward(module, q, k, v, None, scaling=0.5, bidirectional_block=blocks)
    out, _ = tree_attention_forward(
        module, q, k, v, None, scaling=0.5, kv_end=kv_end, position_ids=position_ids, bidirectional_block=blocks
    )
    ref = reference_tree_attention(q, k, v, kv_end, TreeAttentionOptions(scaling=0.5, bidirectional_block=blocks))
    assert relative_error(out, ref) <= TOLERANCE
    from hf_tree.attention import attention_engine_scope

    with attention_engine_scope(ENGINES["reference"]), pytest.raises(ValueError, match="attention_engine_scope"):
        tree_attention_forward(module, q, k, v, None, scaling=0.5, kv_end=kv_end, bidirectional_block=blocks)


@pytest.mark.gpu
@pytest.mark.parametrize("engine", ["flex", "blocked"])
@pytest.mark.parametrize("window", WINDOWS)
def test_cuda_engines_with_blocks_within_twice_eager_in_float32(engine, window):
    kv_end, position_ids = packed_rows(seed=36, num_trees=12, max_packed_tokens=400, pad_to_multiple_of=128)
    blocks = blocks_in_nodes(kv_end, seed=6).cuda()
    kv_end, position_ids = kv_end.cuda(), position_ids.cuda()
    q, k, v = qkv(kv_end, (4, 2), torch.float32, device="cuda")
    options = dict(scaling=0.35, sliding_window=window, bidirectional_block=blocks)
    exact_out, exact_grads = run(reference_tree_attention, *detached64((q, k, v)), kv_end, position_ids, **options)
    out, grads = run(ENGINES[engine], q, k, v, kv_end, position_ids, **options)
    eager_out, eager_grads = run(reference_tree_attention, q, k, v, kv_end, position_ids, **options)
    assert relative_error(out, exact_out) <= 2 * relative_error(eager_out, exact_out)
    for grad, eager_grad, exact in zip(grads, eager_grads, exact_grads):
        assert relative_error(grad, exact) <= 2 * relative_error(eager_grad, exact)
