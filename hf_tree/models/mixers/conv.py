"""Tree-aware causal depthwise convolution (Qwen3.5 / Qwen3-Next GatedDeltaNet, Kimi delta attention, LFM2 ShortConv,
Mamba2 mixers).

A branch alone convolves each token with itself and its ``k - 1`` previous tokens, zero-padded before the first
token. In a packed tree the previous tokens of a branch are a token's nearest *ancestors*, not the previous row
positions: token i's window is ``[pred^{k-1}(i), ..., pred(i), i]`` with zeros above the root. That is one gather
of ``[N, k]`` indices (``TreeTopology.window``) and a weighted sum, on any device.
"""

from __future__ import annotations

import torch
from transformers.activations import ACT2FN

from hf_tree.models.mixers.topology import TreeTopology, tree_topology


def tree_causal_conv1d(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    topology: TreeTopology,
    **kwargs,
) -> torch.Tensor:
    """``causal_conv1d_fn`` over trie ancestors.

    Args:
        hidden_states: ``[B, C, N]`` (channels first, as the mixers pass it).
        weight: ``[C, k]`` depthwise kernel; ``weight[:, -1]`` multiplies the token itself.
        bias: ``[C]`` or None.
        activation: an ``ACT2FN`` name or None.
        topology: the packed batch's ``TreeTopology`` (shape ``[B, N]``).
        kwargs: the model's other keyword arguments, ignored (as the models' torch path does), except
            ``kv_prefix`` (depth-first execution, ``hf_tree.attention.prefix.PrefixCache``): the ancestors'
            convolution inputs precede the unit's (the row ``[prefix | unit]``), and the unit's inputs are recorded
            for its descendants, keyed by the kernel's storage (also the key of the state of the recurrence that
            follows in the same mixer, ``PrefixCache.recurrent_state_key``).

    Returns:
        ``[B, C, N]`` in ``hidden_states.dtype`` (computed in ``weight.dtype``, like the models' torch path).
    """
    prefix = kwargs.get("kv_prefix")
    if prefix is not None:
        prefix.mixer = weight.untyped_storage().data_ptr()  # the key of the recurrence that may follow
        cached = prefix.record(("conv", prefix.mixer), hidden_states)
        if cached is not None:
            row = torch.cat([cached.to(hidden_states.dtype), hidden_states], dim=2)
            out = tree_causal_conv1d(row, weight, bias, activation, topology=tree_topology(prefix.row_kv_end))
            return out[:, :, cached.shape[2] :]
    batch, channels, length = hidden_states.shape
    if topology.shape != (batch, length):
        raise ValueError(
            f"kv_end has shape {list(topology.shape)} but the convolution input has [batch, seq] = "
            f"{[batch, length]}; pass the kv_end of this batch."
        )
    width = weight.shape[-1]
    tokens = hidden_states.to(weight.dtype).transpose(1, 2).reshape(batch * length, channels)
    tokens = torch.cat([tokens, tokens.new_zeros(1, channels)])  # the zero row above every root
    windows = tokens[topology.window(width)]  # [B*N, k, C]
    out = torch.einsum("tkc,ck->tc", windows, weight)
    if bias is not None:
        out = out + bias
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.reshape(batch, length, channels).transpose(1, 2).to(hidden_states.dtype)
