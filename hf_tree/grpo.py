"""``TreeGRPOTrainer``: TRL's ``GRPOTrainer`` computing each prompt once per group in its log-prob passes.

GRPO scores the G completions of a prompt three times per step (old policy, reference, current policy), and TRL
runs the prompt once per completion each time. Here every log-prob pass packs the rows that share prompt tokens
into trees (one prompt node, one leaf per completion; rows are grouped by their tokens, so a micro-batch may hold
partial groups or several groups) and runs the model once on them. The one-line swap::

    from hf_tree.grpo import TreeGRPOConfig, TreeGRPOTrainer  # instead of trl's GRPOConfig, GRPOTrainer

Generation, rewards, advantages and the loss are TRL's own, and the log-probs and entropies equal TRL's (see
``hf_tree.logprobs`` and tests/test_grpo.py). The reference pass works with a separate reference model and with a
disabled PEFT adapter alike.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from trl import GRPOConfig, GRPOTrainer
from trl.extras.profiling import profiling_decorator

from hf_tree.dropout import warn_if_dropout
from hf_tree.saving import FSDPFullSaveMixin
from hf_tree.trl_glue import TreeLogProbArguments, install_tree_heads, log_tree_stats, prepare_trl_args


@dataclass
class TreeGRPOConfig(TreeLogProbArguments, GRPOConfig):
    """``GRPOConfig`` plus ``tree_logprobs`` and ``max_packed_tokens`` (see ``TreeLogProbArguments``)."""


class TreeGRPOTrainer(FSDPFullSaveMixin, GRPOTrainer):
    """``GRPOTrainer`` whose per-token log-probs and entropies come from packed prompt trees.

    Accepts exactly ``GRPOTrainer``'s arguments with ``args`` a ``TreeGRPOConfig`` (a plain ``GRPOConfig`` is
    refused: it lacks the tree fields). The model is put on ``tree_flash`` as ``TreeSFTTrainer`` does (a name loads
    with it, an instance on ``sdpa``/``eager`` is switched with a warning). Raises ``ValueError`` for what the tree
    passes do not support: a model that cannot be switched, vision-language models other than ``hf_tree.vision``'s
    and their inputs other than images, MoE router auxiliary losses, and configs that rescale logits.
    """

    def __init__(self, model: Any, reward_funcs: Any = None, args: TreeGRPOConfig | None = None, **kwargs: Any) -> None:
        args = prepare_trl_args(args, TreeGRPOConfig, model, "GRPO")
        super().__init__(model, reward_funcs, args, **kwargs)
        if not self.args.tree_logprobs:
            return
        install_tree_heads(
            self,
            ("log_probs", "entropy"),
            temperature=self.temperature,
            cast_lm_head_to_fp32=self.args.cast_lm_head_to_fp32,
        )
        warn_if_dropout(self.model, "set disable_dropout=True (it also zeroes LoRA's dropout)")

    @profiling_decorator
    def _get_per_token_logps_and_entropies(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None = None,
        compute_entropy: bool = False,
        compute_aux_loss: bool = False,
        **multimodal_inputs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """TRL's contract: ``input_ids``/``attention_mask`` ``[B, T]`` (left-padded prompts, right-padded
        completions) -> log-probs ``[B, logits_to_keep]`` of the last ``logits_to_keep`` columns, entropies (or
        ``None``), no aux loss. All ``B`` rows are packed together (groups are never cut by ``batch_size``); each
        backbone call holds at most ``batch_size * T`` packed tokens, the tokens of one TRL forward."""
        if not self.args.tree_logprobs:
            return super()._get_per_token_logps_and_entropies(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                batch_size,
                compute_entropy,
                compute_aux_loss,
                **multimodal_inputs,
            )
        if compute_aux_loss:
            raise ValueError("tree log-probs do not support the MoE aux loss (router losses); set tree_logprobs=False.")
        # Only the completion tokens are scored, as in TRL
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        tokens_per_forward = (batch_size or input_ids.size(0)) * input_ids.size(1)
        with self.accelerator.autocast():
            outputs = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                labels=labels,
                fused_lm_head=True,
                tree_tokens_per_forward=tokens_per_forward,
                **multimodal_inputs,  # images: hf_tree.vision.rows (each distinct image encoded once per pass)
            )
        logps = outputs.log_probs[:, -logits_to_keep:]
        entropies = outputs.entropy[:, -logits_to_keep:] if compute_entropy else None
        if compute_entropy:  # the policy pass: log how much the trees saved (nothing if it scored nothing)
            log_tree_stats(self, model)
        return logps, entropies, None
