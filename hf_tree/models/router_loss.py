"""The MoE router load-balancing loss of packed trees, weighted by token multiplicity.

transformers' MoE models (Mixtral, Qwen2/3-MoE, Qwen3.5-MoE, OLMoE, gpt-oss, ...) add
``router_aux_loss_coef * load_balancing_loss_func(router_logits, num_experts, top_k, attention_mask)`` to their
loss, and TRL turns it on by default (``router_aux_loss_coef=None`` takes the architecture's coefficient). That
function is Switch Transformer's ``num_experts * sum_e f_e * P_e``, where ``f_e`` (share of top-k assignments) and
``P_e`` (mean router probability) are means over the batch's tokens, weighted by the attention mask. It is a
product of batch means, not a sum over sequences, so it is *not* a sum of per-branch losses.

A per-branch batch holds a shared token once per branch that contains it; the packed tree holds it once, with the
same router logits (its hidden state is exact). Weighting each packed token by its **multiplicity** (how many
branches of the batch contain it; 0 on padding) gives both means, hence the loss and its gradient, of the
per-branch batch. The model's own function already takes float weights as its ``attention_mask``, so it is
called as the model calls it, with the multiplicities in place of the mask: one implementation, the model's.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable

import torch
from transformers import PreTrainedModel

# Parameters of transformers' load_balancing_loss_func, in order; another signature (e.g. Doge's product-key
# experts) cannot be called with weights this way and is refused.
LOAD_BALANCING_PARAMETERS = ("gate_logits", "num_experts", "top_k", "attention_mask")


def router_aux_loss_coef(model: PreTrainedModel) -> float:
    """The coefficient the model's own forward puts on its router loss; 0.0 when it computes none (a dense model,
    ``output_router_logits=False`` or a zero coefficient). TRL's trainers write their coefficient into this config."""
    config = model.config.get_text_config()
    if not getattr(config, "output_router_logits", False):
        return 0.0
    return float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)


def load_balancing_function(model: PreTrainedModel) -> Callable[..., torch.Tensor]:
    """The model's own ``load_balancing_loss_func`` (from its modeling module).

    Raises:
        ValueError: when the model's module has none, or one with another signature: the tree passes could not
            weight it by multiplicity, so its router loss would be wrong.
    """
    module = sys.modules[type(model).__module__]
    function = vars(module).get("load_balancing_loss_func")
    parameters = tuple(inspect.signature(function).parameters) if callable(function) else ()
    if parameters != LOAD_BALANCING_PARAMETERS:
        raise ValueError(
            f"{type(model).__name__} has output_router_logits=True with router_aux_loss_coef="
            f"{router_aux_loss_coef(model)}, but its module {module.__name__} has no load_balancing_loss_func"
            f"{LOAD_BALANCING_PARAMETERS}: hf_tree cannot reproduce that router loss over a tree. Set "
            "router_aux_loss_coef=0.0 (or config.output_router_logits=False) to train without it."
        )
    return function


def tree_router_loss(
    model: PreTrainedModel, router_logits: tuple[torch.Tensor, ...], multiplicity: torch.Tensor
) -> torch.Tensor:
    """The model's load-balancing loss of the per-branch batch, from the packed tree's router logits.

    Args:
        model: the causal LM whose forward produced ``router_logits`` (its own function computes the loss).
        router_logits: one ``[T, num_experts]`` tensor per MoE layer, ``T`` packed tokens (rows flattened).
        multiplicity: ``[T]`` or ``[C, T]``: branches of the batch that contain each packed token (0 on padding);
            ``C`` weightings give the mean of their ``C`` losses (TRL's GRPO averages the losses of its forward
            chunks).

    Returns:
        0-dim tensor: ``load_balancing_loss_func(router_logits, num_experts, top_k, multiplicity)`` (averaged over
        the ``C`` weightings).
    """
    function = load_balancing_function(model)
    num_experts = router_logits[0].shape[-1]
    # the top-k the model's own forward passes: DBRX keeps it on the model (from ffn_config.moe_top_k), not the config
    top_k = getattr(model, "num_experts_per_tok", None) or model.config.get_text_config().num_experts_per_tok
    weightings = multiplicity.reshape(-1, multiplicity.shape[-1]).to(router_logits[0].device)
    losses = [function(router_logits, num_experts, top_k, weights[None, :]) for weights in weightings]
    return torch.stack(losses).mean()
