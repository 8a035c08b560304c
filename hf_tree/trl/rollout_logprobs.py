"""The log-prob pass shared by ``TreeGRPOTrainer`` and ``TreeRLOOTrainer``: TRL's online RL trainers score the
completions of a group (one prompt, G completions) through ``_get_per_token_logps_and_entropies`` (old policy,
reference and policy passes); here each pass packs the rows that share prompt tokens into trees.

Both TRL trainers have the same method contract and the same fused head (``log_probs`` and ``entropy`` on the
policy, ``log_probs`` on the reference), so one mixin serves both. It is the one owner of that TRL hook: the policy
pass over prompts shared across micro-batches (``hf_tree.trl.shared_prompts``) is one of the passes it chooses from.
"""

from __future__ import annotations

from typing import Any

import torch
from trl.extras.profiling import profiling_decorator

from hf_tree.models.dropout import warn_if_dropout
from hf_tree.models.quantization import log_quantized_base
from hf_tree.trl.glue import TreeFusedHead, install_tree_heads, log_tree_stats, warn_if_padding_numbered_positions
from hf_tree.trl.shared_prompts import SharedPromptPolicyMixin


class TreeRolloutLogProbsMixin(SharedPromptPolicyMixin):
    """Placed before TRL's ``GRPOTrainer``/``RLOOTrainer`` in the bases (their ``args`` a config with
    ``TreeRolloutArguments``). The subclass calls ``_install_rollout_tree_passes`` after TRL's ``__init__``.

    Attributes:
        tree_head: the policy's tree fused head (its ``layout_stats`` are logged); ``None`` with
            ``tree_forward=False``.
    """

    tree_head: TreeFusedHead | None = None

    def _install_rollout_tree_passes(self, cast_lm_head_to_fp32: bool = False) -> None:
        """Put the tree fused head on the policy and reference (what TRL's ``__init__`` gave its own head), then
        decide whether the shared-prompt policy pass runs (``_check_shared_prompts``)."""
        log_quantized_base(self.model)
        if self.args.tree_forward:
            self.tree_head = install_tree_heads(
                self, ("log_probs", "entropy"), temperature=self.temperature, cast_lm_head_to_fp32=cast_lm_head_to_fp32
            )
            warn_if_dropout(self.model, "set disable_dropout=True (it also zeroes LoRA's dropout)")
            warn_if_padding_numbered_positions(self.model, type(self).__name__.removeprefix("Tree"))
        self._check_shared_prompts()  # tree_share_across_microbatches

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
        ``None``) and, with ``compute_aux_loss``, the MoE router loss as TRL computes it.

        One of three passes: TRL's own (``tree_forward=False``); the policy pass over the optimizer step's shared
        prompts (``SharedPromptPolicyMixin._shared_policy_logps``, when it applies); else the packed pass."""
        if not self.args.tree_forward:
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
        shared = self._shared_policy_logps(
            model, input_ids, attention_mask, logits_to_keep, compute_entropy, compute_aux_loss, multimodal_inputs
        )
        if shared is not None:
            return shared
        return self._packed_logps(
            model,
            input_ids,
            attention_mask,
            logits_to_keep,
            batch_size,
            compute_entropy,
            compute_aux_loss,
            multimodal_inputs,
        )

    def _packed_logps(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        batch_size: int | None,
        compute_entropy: bool,
        compute_aux_loss: bool,
        multimodal_inputs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The packed pass: all ``B`` rows are packed together (groups are never cut by ``batch_size``); each
        backbone call holds at most ``batch_size * T`` packed tokens, the tokens of one TRL forward."""
        # Only the completion tokens are scored, as in TRL
        labels = input_ids.masked_fill(attention_mask == 0, -100)
        labels[:, :-logits_to_keep] = -100
        rows_per_forward = batch_size or input_ids.size(0)
        # MoE: TRL's router loss is the mean of one per forward chunk of batch_size rows; the tree weights each
        # packed token by the rows of each chunk that contain it (hf_tree.models.router_loss).
        router_inputs = {"output_router_logits": True, "tree_router_chunk_rows": rows_per_forward}
        with self.accelerator.autocast():
            outputs = model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                labels=labels,
                fused_lm_head=True,
                tree_tokens_per_forward=rows_per_forward * input_ids.size(1),
                **(router_inputs if compute_aux_loss else {}),
                **multimodal_inputs,  # images: hf_tree.vision.rows (each distinct image encoded once per pass)
            )
        logps = outputs.log_probs[:, -logits_to_keep:]
        entropies = outputs.entropy[:, -logits_to_keep:] if compute_entropy else None
        if compute_entropy:  # the policy pass: log how much the trees saved (nothing if it scored nothing)
            log_tree_stats(self)
        return logps, entropies, outputs.aux_loss if compute_aux_loss else None
