"""Tree context parallel: each rank computes its shard of a packed row and sees every key through an all-gather.

Inside ``tree_context_parallel(...)`` every ``tree_flash`` attention layer of a model forward on the rank's
shard (``shard_batch_for_context_parallel``) runs ``ContextParallelAttention``: the rank's keys/values are
all-gathered from the CP group with an autograd all-gather (its backward is a reduce-scatter, so each rank
receives the key/value gradients every other rank's queries produced), and the rank's query rows attend to
the keys they can see under their rows of the tree mask, evaluated on *global* indices from ``kv_end``. The
model's own parameters see nothing unusual, so FSDP2/DDP wrap it as usual.

Loss edges are scored on the rank that owns the predicting position and every rank divides by the global
``num_loss_items``: the CP losses sum to the cp=1 loss, and parameter gradients summed over the CP group
(what DDP/FSDP do, up to their averaging, undone by scaling the loss by the number of processes) equal cp=1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from hf_tree.attention import attention_engine_scope, scoped_attention_engine
from hf_tree.attention.engine import TreeAttentionOptions
from hf_tree.attention.mask import (
    check_sinks,
    check_window_depths,
    lowest_visible_depth,
    tree_mask_mod,
    visible_keys_per_query,
)
from hf_tree.attention.reference import masked_attention
from hf_tree.attention.torch_cp import refuse_torch_context_parallel as refuse_torch_context_parallel  # re-export
from hf_tree.parallel.plan import ContextParallelPlan

# Query rows per attention call; bounds the [rows, keys] mask and score tiles of one call.
DEFAULT_QUERY_BLOCK_SIZE = 1024
# Batch keys sharded along the sequence; every other key except the loss gather passes through unchanged.
SEQUENCE_KEYS = ("input_ids", "position_ids", "kv_end")


def active_context_parallel() -> ContextParallelAttention | None:
    """The tree context parallel attention of the enclosing ``tree_context_parallel`` block, if any (the
    attention engine scoped by ``hf_tree.attention.attention_engine_scope``)."""
    engine = scoped_attention_engine()
    return engine if isinstance(engine, ContextParallelAttention) else None


@contextlib.contextmanager
def suspend_context_parallel() -> Iterator[None]:
    """Run the block's tree forwards whole (the ordinary engines), even inside ``tree_context_parallel``: for
    work every rank does on the full row (``hf_tree.models.probe`` scopes ``None`` the same way, from below
    ``hf_tree.parallel``)."""
    with attention_engine_scope(None):
        yield


def _all_gather_rows(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Autograd all-gather along dim 0 (backward: reduce-scatter-sum). ``torch.distributed.nn.functional.
    all_gather`` is not used: it returns wrong gradients on gloo (non-contiguous scatter buffers)."""
    from torch.distributed import _functional_collectives as funcol

    try:
        gather = funcol.all_gather_single_autograd
    except AttributeError:  # older torch names it all_gather_tensor_autograd
        gather = funcol.all_gather_tensor_autograd
    out = gather(tensor, 0, group if group is not None else dist.group.WORLD)
    return funcol.wait_tensor(out)


@dataclass
class _QueryBlock:
    """Local query rows ``[q0, q1)`` (consecutive global ids) and the global ids of the keys they can see."""

    q0: int
    q1: int
    key_ids: torch.Tensor
    """``[K]`` int64, ascending: the ancestors of the block's first query (in any row) and the block itself."""


def _query_blocks(local_ids: torch.Tensor, kv_end: torch.Tensor, block_size: int) -> list[_QueryBlock]:
    """Runs of consecutive global ids of the rank's rows, cut to ``block_size``, with their keys.

    A query ``i`` of a run starting at ``a`` sees an earlier key ``j < a`` only if ``kv_end[j] > i >= a``, i.e.
    only ancestors of ``a``: the run needs ``{j < a : kv_end[j] > a} | [a, b)`` (siblings, other trees and
    padding never enter its attention call). ``kv_end``: ``[B, num_slots]`` int64 on the CPU.
    """
    ids = local_ids.tolist()
    reach = kv_end.max(0).values  # a key is needed if it is an ancestor in any row
    blocks, q0 = [], 0
    for q in range(1, len(ids) + 1):
        if q == len(ids) or ids[q] != ids[q - 1] + 1 or q - q0 == block_size:
            a, b = ids[q0], ids[q - 1] + 1
            ancestors = torch.nonzero(reach[:a] > a).flatten()
            blocks.append(_QueryBlock(q0, q, torch.cat([ancestors, torch.arange(a, b)])))
            q0 = q
    return blocks


def _block_attention(
    query: torch.Tensor,
    rows: torch.Tensor,
    query_ids: torch.Tensor,
    key_ids: torch.Tensor,
    key_rows: torch.Tensor,
    kv_end: torch.Tensor,
    positions: torch.Tensor,
    sliding_window: int | None,
    attention_chunk: int | None,
    scaling: float,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention of one query block.

    Args:
        query: ``[B, H, Q, D]`` the block's queries, global ids ``query_ids [Q]``.
        rows: ``[cp_size * L, 2, B, Hkv, D]`` the gathered keys and values of all ranks (rank-major slots).
        key_ids, key_rows: ``[K]`` global ids of the keys the block needs and their rows in ``rows``.
        kv_end, positions: ``[B, num_slots]`` of the global row (padding slots included); ``positions``: what the
            window and the chunks measure (``ContextParallelAttention._positions``).
        attention_chunk: chunk size in depths (Llama 4's chunked layers), or ``None``.
        sinks: ``[H]`` attention-sink logits that join each query's softmax denominator, or ``None``.

    Returns ``[B, H, Q, D]``. Run under activation checkpointing: the selected keys/values, the ``[B, Q, K]``
    mask and SDPA's tiles are rebuilt in backward instead of being kept.
    """
    key, value = rows.index_select(0, key_rows).movedim(0, 3).unbind(0)  # [B, Hkv, K, D] each
    batch_rows = torch.arange(kv_end.shape[0], device=kv_end.device)[:, None, None]
    mask_mod = tree_mask_mod(kv_end, positions, sliding_window, attention_chunk=attention_chunk)
    visible = mask_mod(batch_rows, None, query_ids[None, :, None], key_ids)
    visible = visible[:, None]  # [B, 1, Q, K], shared by the heads
    if softcap is None and sinks is None:  # SDPA's fused kernels take a boolean mask and GQA directly (no scores kept)
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=visible, scale=scaling, enable_gqa=query.shape[1] != key.shape[1]
        )
    return masked_attention(query, key, value, visible, scaling=scaling, softcap=softcap, sinks=sinks)


class ContextParallelAttention:
    """Tree attention of one rank's shard against the keys/values of the whole CP group (one forward).

    Built by ``tree_context_parallel``; ``hf_tree.attention.tree_attention_forward`` calls it (a
    ``TreeAttentionEngine``) while it is active. A query block attends only to the keys it can see (the ancestors
    of its first query and itself). Blocks run under activation checkpointing, so per rank and layer autograd keeps
    only the rank's queries and the gathered keys/values (``[cp_size * L, 2, B, Hkv, D]``, as at cp=1); a block's
    selected keys, mask and SDPA tiles live only while it is computed or recomputed in backward (the price:
    attention's forward runs twice).
    """

    def __init__(
        self,
        batch: dict[str, torch.Tensor],
        plan: ContextParallelPlan,
        rank: int,
        group: dist.ProcessGroup | None,
        query_block_size: int = DEFAULT_QUERY_BLOCK_SIZE,
    ) -> None:
        if not 0 <= rank < plan.cp_size:
            raise ValueError(f"rank={rank} is outside the plan's context-parallel group of size {plan.cp_size}.")
        if not isinstance(query_block_size, int) or query_block_size < 1:
            raise ValueError(f"query_block_size={query_block_size!r} must be a positive integer.")
        group_size = dist.get_world_size(group) if plan.cp_size > 1 else 1
        if group_size != plan.cp_size:
            raise ValueError(f"the plan is for cp_size={plan.cp_size} but the process group has {group_size} ranks.")
        kv_end = batch["kv_end"]
        if kv_end.shape[1] != plan.num_tokens:
            raise ValueError(
                f"the batch has rows of {kv_end.shape[1]} tokens but the plan was made for {plan.num_tokens}; pass "
                "the global (unsharded) batch the plan was built from."
            )
        self.plan, self.rank, self.group = plan, rank, group
        # Planning tensors stay on the CPU; _on() copies them to the device the attention runs on, once.
        self.kv_end = extend_to_slots(kv_end.detach().to("cpu", torch.int64), plan, "kv_end")
        self.position_ids = extend_to_slots(batch["position_ids"].detach().to("cpu", torch.int64), plan, "position_ids")
        # Each slot's depth (its number of ancestors, 0 for padding slots): what a chunked layer that passes no
        # position_ids (Llama 4) counts its chunks in, as hf_tree.attention.tree_attention_forward does at cp=1.
        self.depth = visible_keys_per_query(self.kv_end) - 1
        # The global row's length: checks of packed indices (Llama 4's temperature tuning) measure the whole row,
        # not the shard a layer sees (hf_tree.attention.tree_attention_forward reads it).
        self.row_tokens = plan.num_tokens
        self.blocks = _query_blocks(plan.indices[rank], self.kv_end, query_block_size)
        self.device: torch.device | None = None
        # Per (sliding window, attention chunk, measured in depths): each block's key ids and their rows in the
        # gathered keys/values, on the device (``_block_keys``).
        self._keys: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}

    def _on(self, device: torch.device) -> None:
        """Move the index tensors to ``device`` (first layer of the forward)."""
        if self.device == device:
            return
        self.device = device
        self.local_ids = self.plan.indices[self.rank].to(device)
        # Global slot id -> row of the rank-major gathered keys/values.
        self.slot_rows = torch.argsort(self.plan.indices.flatten()).to(device)
        self._keys = {}
        self.kv_end, self.position_ids, self.depth = (
            t.to(device) for t in (self.kv_end, self.position_ids, self.depth)
        )

    def _positions(
        self, layer_position_ids: torch.Tensor | None, sliding_window: int | None, attention_chunk: int | None
    ) -> tuple[torch.Tensor, bool]:
        """``[B, num_slots]`` what a layer's window and chunks measure, as at cp=1: the depths of ``kv_end`` for
        a chunked layer that passes no ``position_ids`` (Llama 4), else the batch's ``position_ids`` (of which the
        layer's ``layer_position_ids`` are this rank's shard); and whether they are the depths."""
        if layer_position_ids is None and attention_chunk is not None:
            return self.depth, True
        check_window_depths("tree context parallel", layer_position_ids, sliding_window, attention_chunk)
        return self.position_ids, False

    def _block_keys(
        self, positions: torch.Tensor, by_depth: bool, sliding_window: int | None, attention_chunk: int | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each block's key ids (on the device) and their rows in the gathered keys/values, for layers with
        ``sliding_window`` and ``attention_chunk`` measured in ``positions`` (computed once per such layer kind and
        forward).

        With a window or chunks, an ancestor ``j`` is kept only if some row could show it to some query of the
        block: ``position[j]`` at least the lowest visible position (``lowest_visible_depth``: the window's or the
        chunk's start) of the block's shallowest query, which is the smallest over its queries as that start never
        decreases with depth. Dropping the others changes nothing (the mask still decides), but a windowed or
        chunked layer's work becomes ``O(window)`` or ``O(chunk)`` keys per query instead of the query's depth.
        """
        kind = (sliding_window, attention_chunk, by_depth)
        if kind not in self._keys:
            positions = positions.cpu()
            local_ids, slot_rows = self.local_ids.cpu(), self.slot_rows.cpu()
            ids = []
            for b in self.blocks:
                key_ids = b.key_ids
                lowest = lowest_visible_depth(
                    positions[:, local_ids[b.q0 : b.q1]].min(), sliding_window, attention_chunk
                )
                if lowest is not None:
                    key_ids = key_ids[positions[:, key_ids].max(0).values >= lowest]
                ids.append(key_ids)
            self._keys[kind] = (
                [i.to(self.device) for i in ids],
                [slot_rows[i].to(self.device) for i in ids],
            )
        return self._keys[kind]

    def gather_keys_values(self, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``key/value [B, Hkv, L, D]`` of this rank -> ``[cp_size * L, 2, B, Hkv, D]`` of all ranks, rank-major."""
        rows = torch.stack([key, value]).movedim(3, 0).contiguous()  # slots first: the all-gather concatenates dim 0
        return _all_gather_rows(rows, self.group) if self.plan.cp_size > 1 else rows

    def gather_sequence(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's ``tensor`` (``L`` shard slots along ``dim``) -> the whole row's (``num_slots`` along
        ``dim``, in global slot order), for the tree mixers (their ``ShardedRows``,
        ``hf_tree.models.mixers.install``). Autograd all-gather: its backward hands each rank the gradient of its own
        slots, summed over the ranks' uses."""
        self._on(tensor.device)
        rows = tensor.movedim(dim, 0).contiguous()
        if self.plan.cp_size > 1:
            rows = _all_gather_rows(rows, self.group)
        return rows.index_select(0, self.slot_rows).movedim(0, dim)

    def local_slots(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """The whole row's ``tensor`` (``num_slots`` along ``dim``) -> this rank's slots (``L`` along ``dim``)."""
        self._on(tensor.device)
        return tensor.index_select(dim, self.local_ids)

    def row_kv_end(self, device: torch.device) -> torch.Tensor:
        """``[B, num_slots]`` subtree ends of the whole row (padding slots included) on ``device``: one tensor
        object for the whole forward, so ``hf_tree.models.mixers.tree_topology`` builds the topology once."""
        self._on(device)
        return self.kv_end

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_end: torch.Tensor,
        options: TreeAttentionOptions,
    ) -> torch.Tensor:
        """A ``TreeAttentionEngine`` over the rank's rows: ``query [B, H, L, D]``, ``key/value [B, Hkv, L, D]`` ->
        ``[B, L, H, D]``. ``options.sinks [H]``: attention-sink logits (their gradient stays on the rank, summed over
        ranks by DDP/FSDP); ``options.attention_chunk``: chunk size in depths (Llama 4's chunked layers: a query sees
        its ancestors of the same chunk); ``options.position_ids``: the layer's ``[B, L]`` position ids of the shard,
        or ``None``; only whether they are given is read (the whole row's come from the batch given at
        construction): without them a window is refused and chunks count depths, as at cp=1. Bidirectional blocks
        are refused."""
        if options.bidirectional_block is not None:
            raise ValueError(
                "tree context parallel got a bidirectional_block: it does not compute one. Train without context "
                "parallel."
            )
        sliding_window, attention_chunk = options.sliding_window, options.attention_chunk
        if query.shape[2] != self.plan.shard_len or kv_end.shape != self.kv_end.shape[:1] + (self.plan.shard_len,):
            raise ValueError(
                f"tree context parallel expects this rank's shard ([batch, {self.plan.shard_len}] rows, from "
                f"shard_batch_for_context_parallel) but the model got {query.shape[2]} query rows and kv_end of shape "
                f"{tuple(kv_end.shape)}."
            )
        check_sinks("tree context parallel", options.sinks, query.shape[1])
        self._on(query.device)
        positions, by_depth = self._positions(options.position_ids, sliding_window, attention_chunk)
        rows = self.gather_keys_values(key, value)
        block_key_ids, block_key_rows = self._block_keys(positions, by_depth, sliding_window, attention_chunk)
        outputs = [
            checkpoint(
                _block_attention,
                query[:, :, b.q0 : b.q1],
                rows,
                self.local_ids[b.q0 : b.q1],
                key_ids,
                key_rows,
                self.kv_end,
                positions,
                sliding_window,
                attention_chunk,
                options.scaling,
                options.softcap,
                options.sinks,
                use_reentrant=False,
            )
            for b, key_ids, key_rows in zip(self.blocks, block_key_ids, block_key_rows)
        ]
        return torch.cat(outputs, dim=2).transpose(1, 2).contiguous()


def extend_to_slots(values: torch.Tensor, plan: ContextParallelPlan, key: str, pad_token_id: int = 0) -> torch.Tensor:
    """``[B, N]`` sequence tensor -> ``[B, num_slots]`` with padding slots filled like the collator's padding
    (``input_ids``: ``pad_token_id``, ``position_ids``: 0, ``kv_end``: ``id + 1``, seen by itself only)."""
    extra = plan.num_slots - plan.num_tokens
    if key == "kv_end":
        fill = torch.arange(plan.num_tokens + 1, plan.num_slots + 1, device=values.device, dtype=values.dtype)
    else:
        fill = torch.full((extra,), pad_token_id if key == "input_ids" else 0, device=values.device, dtype=values.dtype)
    return torch.cat([values, fill.expand(values.shape[0], extra)], dim=1)


def shard_batch_for_context_parallel(
    batch: dict[str, torch.Tensor], plan: ContextParallelPlan, rank: int, pad_token_id: int = 0
) -> dict[str, torch.Tensor]:
    """The rank's part of a ``TreeDataCollator`` batch under ``plan``.

    ``input_ids``/``position_ids``/``kv_end`` become ``[B, L]`` (the rank's slots; ``kv_end`` keeps global
    values and only marks tree mode); the loss gather keeps the edges whose predicting position the rank owns,
    re-indexed into ``B * L``; ``num_loss_items`` stays the global divisor. A rank owning no edge gets one
    zero-weight edge, so its backward still runs the reduce-scatters the other ranks wait for.
    """
    num_rows, num_tokens = batch["kv_end"].shape
    if num_tokens != plan.num_tokens:
        raise ValueError(f"the batch has rows of {num_tokens} tokens but the plan was made for {plan.num_tokens}.")
    if not 0 <= rank < plan.cp_size:
        raise ValueError(f"rank={rank} is outside the plan's context-parallel group of size {plan.cp_size}.")
    local = dict(batch)
    ids = plan.indices[rank].to(batch["kv_end"].device)
    for key in SEQUENCE_KEYS:
        local[key] = extend_to_slots(batch[key], plan, key, pad_token_id).index_select(1, ids)
    owner, slot = (t.to(batch["loss_positions"].device) for t in plan.slot_owner())
    row, column = batch["loss_positions"] // num_tokens, batch["loss_positions"] % num_tokens
    mine = owner[column] == rank
    local["loss_positions"] = row[mine] * plan.shard_len + slot[column[mine]]
    local["loss_targets"] = batch["loss_targets"][mine]
    local["loss_weights"] = batch["loss_weights"][mine]
    if not bool(mine.any()):
        local["loss_positions"] = local["loss_positions"].new_zeros(1)
        local["loss_targets"] = local["input_ids"].reshape(-1)[:1].clone()
        local["loss_weights"] = local["loss_weights"].new_zeros(1)
    return local


@contextlib.contextmanager
def tree_context_parallel(
    batch: dict[str, torch.Tensor],
    plan: ContextParallelPlan,
    rank: int,
    group: dist.ProcessGroup | None = None,
    query_block_size: int = DEFAULT_QUERY_BLOCK_SIZE,
) -> Iterator[ContextParallelAttention]:
    """Route every ``tree_flash`` forward in the block through tree context parallel.

    Args:
        batch: the *global* batch the plan was built from (``kv_end``/``position_ids`` ``[B, N]``, any device).
        plan: ``plan_context_parallel(batch["kv_end"], cp_size)``, the same on every rank.
        rank: this process's rank in ``group``.
        group: the CP process group (``None``: the default group).

    Run forward *and backward* inside the block (gradient checkpointing recomputes attention in backward).
    """
    if active_context_parallel() is not None:
        raise ValueError("tree_context_parallel blocks cannot be nested.")
    context_parallel = ContextParallelAttention(batch, plan, rank, group, query_block_size)
    with attention_engine_scope(context_parallel):
        yield context_parallel
