"""TRL glue of the tree log-prob passes: the fused head (``TreeFusedHead``, its ``TreeHeadSettings`` and installer)
and what ``TreeGRPOTrainer``, ``TreeRLOOTrainer``, ``TreeDPOTrainer`` and ``TreeKTOTrainer`` share (head installation
on policy and reference), and with ``TreeRewardTrainer`` (argument preparation, logs).

The layout and the kernel the head runs are ``hf_tree.trl.logprobs``; the config fields ``hf_tree.trl.arguments``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.modeling_outputs import MoeCausalLMOutputWithPast
from trl.trainer.utils import get_config_model_id

from hf_tree.attention.names import TREE_ATTENTION_NAME
from hf_tree.models.check import check_model_for_trees, self_check_setting
from hf_tree.models.check_guard import keep_training_kernels
from hf_tree.models.introspection import causal_lm_of
from hf_tree.packing import check_max_packed_tokens
from hf_tree.trainer import tree_model_init_kwargs, use_tree_attention
from hf_tree.trl.compat import fused_causal_lm_output, unscored_fused_output
from hf_tree.trl.logprobs import (
    FUSED_OUTPUTS,
    layout_scored_rows,
    scatter_to_rows,
    tree_logits,
    tree_token_log_probs,
)
from hf_tree.trl.tree_forward import TreeForward
from hf_tree.versions import require_tested_trl
from hf_tree.vision.rows import ROW_FAMILIES, ROW_IMAGE_INPUTS, RowMedia

require_tested_trl()  # TRL internals below (the fused_lm_head call contract) change between minors: hf_tree.trl.compat
# Inputs of a fused-head call that are ignored (``None`` values, e.g. from PEFT's forward, are ignored too).
IGNORED_INPUTS = ("use_cache", "return_dict")
logger = logging.getLogger("hf_tree")
# Absolute position embeddings numbered with ``torch.arange`` when no ``position_ids`` are given (transformers 5.24),
# so TRL's GRPO/RLOO training forward numbers a left-padded prompt from its padding. OPT and BioGPT number from the
# attention mask (padding-free, as the trees and ``generate`` do); rotary models see position differences only.
PADDING_NUMBERED_POSITIONS = frozenset({"gpt2", "gpt_bigcode", "ctrl"})


def check_tree_model(model: PreTrainedModel, name: str = "model") -> None:
    """Raise ``ValueError`` unless ``model`` can run the tree fused head (a text causal LM on ``tree_flash``).

    How its logits are scored (scale, softcap, or a refusal) and the tree self-check are decided on the first call
    (``hf_tree.models.check.check_model_for_trees``), on the device the model then runs on."""
    config = model.config
    if config._attn_implementation != TREE_ATTENTION_NAME:
        raise ValueError(
            f"{name} uses attn_implementation={config._attn_implementation!r}, which ignores the tree mask. Load it "
            f"with attn_implementation='{TREE_ATTENTION_NAME}' (after `import hf_tree`; without kv_end it is exactly "
            f"sdpa, so generation is unchanged), e.g. model_init_kwargs={{'attn_implementation': "
            f"'{TREE_ATTENTION_NAME}'}}, or call {name}.set_attn_implementation('{TREE_ATTENTION_NAME}')."
        )
    if config.get_text_config() is not config and config.model_type not in ROW_FAMILIES:
        raise ValueError(
            f"{name} is a {type(model).__name__} with a separate text config (a vision-language model of "
            f"model_type={config.model_type!r}); tree log-probs support text-only causal LMs and the vision-language "
            f"families {list(ROW_FAMILIES)} (hf_tree.vision). Set tree_forward=False."
        )


@dataclass(frozen=True)
class TreeHeadSettings:
    """What the tree fused head of one model computes and how it packs (``add_tree_fused_lm_head``).

    Attributes:
        outputs: per-token fields to compute, among ``FUSED_OUTPUTS``.
        temperature, cast_lm_head_to_fp32: as given to TRL's ``add_fused_lm_head`` for this model.
        max_packed_tokens: packed row capacity; ``None``: the call's tokens per forward.
        self_check: run ``hf_tree.models.check``'s refusals and probe before the first tree pass (``None``: on
            unless ``HF_TREE_SELF_CHECK=0``).
        merge_in_batch: merge the call's rows into tries by their tokens; ``False``: each row a tree of its own.
        logits_forward: also answer plain calls (``model(input_ids, attention_mask)``, no labels, no cache) from the
            packed trees, with the logits of every real token gathered back to the padded rows (``tree_logits``):
            TRL 1.9's DPO and KTO read ``outputs.logits`` themselves (``hf_tree.trl.compat``). Generation, which
            passes a cache, runs the previous forward.
    """

    outputs: tuple[str, ...] = ("log_probs",)
    temperature: float = 1.0
    cast_lm_head_to_fp32: bool = False
    max_packed_tokens: int | None = None
    self_check: bool | None = None
    merge_in_batch: bool = True
    logits_forward: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "outputs", tuple(self.outputs))
        unknown = sorted(set(self.outputs) - set(FUSED_OUTPUTS))
        if unknown:
            raise ValueError(f"outputs={self.outputs!r} holds unknown fields {unknown}; choose among {FUSED_OUTPUTS}.")
        check_max_packed_tokens(self.max_packed_tokens, none_allowed=True)


class TreeFusedHead(TreeForward):
    """The tree fused head of one model (``add_tree_fused_lm_head``): its settings, the forward it replaced and the
    packing of its last call (``TreeForward``)."""

    def __init__(self, settings: TreeHeadSettings) -> None:
        self.settings = settings

    def __call__(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        *,
        fused_lm_head: bool = False,
        labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | int | None = None,
        tree_tokens_per_forward: int | None = None,
        tree_router_chunk_rows: int | None = None,
        **kwargs: Any,
    ) -> Any:
        plain_logits = not fused_lm_head and self._answers_plain_call(input_ids, labels, kwargs)
        if not fused_lm_head and not plain_logits:
            for key, value in (("labels", labels), ("num_items_in_batch", num_items_in_batch)):
                if value is not None:
                    kwargs[key] = value
            return self.previous_forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        for key in IGNORED_INPUTS:
            kwargs.pop(key, None)
        return self._fused_call(
            model,
            input_ids,
            attention_mask,
            labels,
            num_items_in_batch,
            tree_tokens_per_forward,
            tree_router_chunk_rows,
            kwargs,
            plain_logits,
        )

    def _answers_plain_call(self, input_ids: torch.Tensor | None, labels: Any, inputs: dict[str, Any]) -> bool:
        """Whether a call without ``fused_lm_head`` gets tree logits (``TreeHeadSettings.logits_forward``): token
        ids, no labels (a loss) and no cache (generation) asked for."""
        cached = inputs.get("cache") is not None or inputs.get("past_key_values") is not None
        return self.settings.logits_forward and input_ids is not None and labels is None and not cached

    def _fused_call(
        self,
        model: PreTrainedModel,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        labels: torch.Tensor | None,
        num_items_in_batch: torch.Tensor | int | None,
        tokens_per_forward: int | None,
        router_chunk_rows: int | None,
        other_inputs: dict[str, Any],
        plain_logits: bool = False,
    ) -> Any:  # TRL's FusedCausalLMOutput; with plain_logits a MoeCausalLMOutputWithPast
        settings = self.settings
        output_router_logits = bool(other_inputs.pop("output_router_logits", False))
        media = RowMedia.from_rows(model, input_ids, other_inputs)  # takes the image inputs out of other_inputs
        if media is not None and output_router_logits:
            raise ValueError(
                "router_aux_loss_coef != 0 with image inputs: the MoE router loss of vision-language trees is not "
                "tested yet. Set router_aux_loss_coef=0.0, or tree_forward=False."
            )
        unsupported = sorted(k for k, v in other_inputs.items() if v is not None and v is not False)
        if unsupported:
            raise ValueError(
                f"the tree log-prob head got model inputs {unsupported} it does not support (it handles text "
                f"input_ids, attention_mask, labels and output_router_logits, and {list(ROW_IMAGE_INPUTS)} of "
                "hf_tree.vision's models; no position_ids, shift_labels or other vision inputs). Set "
                "tree_forward=False to use TRL's own forward."
            )
        if plain_logits:  # every real token with a real predecessor, in one forward as the plain call
            labels = every_real_token(input_ids, attention_mask)
        if labels is None:
            raise ValueError("fused_lm_head=True needs labels (-100 where no token is scored).")
        # First call: refuse models the tree passes would get wrong; the original forward, not the model, runs the
        # probe (calling the model again inside its own forward would rerun FSDP's root hooks).
        logit_head = check_model_for_trees(model, settings.self_check, forward=self.previous_forward)
        tokens_per_forward = tokens_per_forward or input_ids.numel()
        # TRL's router loss is one per forward of router_chunk_rows rows (GRPO's batch_size chunks), averaged.
        router_chunk_rows = (router_chunk_rows or input_ids.shape[0]) if output_router_logits else None
        capacity = settings.max_packed_tokens or tokens_per_forward
        rows = input_ids if media is None else media.input_ids  # placeholders as image ids: rows merge by images too
        layout = layout_scored_rows(rows, attention_mask, labels, capacity, router_chunk_rows, settings.merge_in_batch)
        # the last call's packing, for the trainers' logs; None when nothing is packed (no stale ratio to log)
        self.layout_stats = layout.stats if layout.num_scored else None
        router_inputs = {"output_router_logits": True} if output_router_logits else {}
        if layout.num_scored == 0 and plain_logits:  # rows of one token: the model's own call
            return self.previous_forward(input_ids=input_ids, attention_mask=attention_mask, **router_inputs)
        if layout.num_scored == 0:  # nothing to score: the model's forward keeps the zero output connected to it
            return unscored_fused_output(
                self.previous_forward, input_ids, attention_mask, labels, settings.outputs, router_inputs
            )
        model_inputs = None if media is None else media.model_inputs
        if plain_logits:
            logits, aux_loss = tree_logits(model, layout, logit_head, tokens_per_forward, model_inputs)
            return MoeCausalLMOutputWithPast(logits=logits, aux_loss=aux_loss)  # aux_loss: None without MoE
        values = tree_token_log_probs(
            model,
            layout,
            settings.temperature,
            settings.outputs,
            tokens_per_forward,
            settings.cast_lm_head_to_fp32,
            logit_head,
            model_inputs=model_inputs,
        )
        aux_loss = values.pop("aux_loss", None)
        per_token = {
            name: scatter_to_rows(value, layout.output_index, layout.output_shape) for name, value in values.items()
        }
        label_mask = labels[:, 1:] != -100
        divisor = label_mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -per_token["log_probs"].sum() / divisor
        if aux_loss is not None:  # as TRL's fused head: plus the config's coefficient times the router loss
            loss = loss + getattr(model.config.get_text_config(), "router_aux_loss_coef", 0.0) * aux_loss
        return fused_causal_lm_output(loss=loss, label_mask=label_mask, aux_loss=aux_loss, **per_token)


def every_real_token(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """``[B, T]`` labels that score every real token (``attention_mask`` 1, or all without one) except each row's
    first, which has no predecessor; ``-100`` elsewhere."""
    real = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask != 0
    labels = input_ids.masked_fill(~real, -100)
    labels[torch.arange(labels.shape[0]), real.int().argmax(1)] = -100
    return labels


def add_tree_fused_lm_head(
    model: PreTrainedModel, settings: TreeHeadSettings | None = None, name: str = "model"
) -> TreeFusedHead:
    """Replace the fused head that TRL's ``add_fused_lm_head`` installed on ``model`` (on a TRL without one, TRL 1.9:
    the model's forward) by the tree one.

    ``model(..., labels=labels, fused_lm_head=True)`` then returns a ``FusedCausalLMOutput`` with the same fields
    and layout as TRL's, computed on packed trees; it also accepts ``tree_tokens_per_forward=`` (packed tokens per
    backbone call, default ``B * T``). With ``output_router_logits=True`` (an MoE model), ``aux_loss`` is the router
    load-balancing loss of the padded batch, each packed token weighted by the rows that contain it
    (``hf_tree.models.router_loss``); ``tree_router_chunk_rows=`` gives the mean over chunks of that many rows, as TRL's
    GRPO computes one per forward chunk. Without ``fused_lm_head`` the previous forward runs (generation is
    unchanged), except for the uncached calls that ``TreeHeadSettings.logits_forward`` answers. Calling it again
    replaces the head (and its settings).

    Args:
        model: the causal LM (the base model of a PEFT model), loaded with ``attn_implementation="tree_flash"``.
        settings: what the head computes (``None``: ``TreeHeadSettings()``, log-probs only).
        name: how errors refer to the model.

    Returns:
        The installed head: its ``layout_stats`` is the packing of the last call (what the trainers log).
    """
    check_tree_model(model, name)
    head = TreeFusedHead(settings or TreeHeadSettings())
    head.install(model)
    return head


# ----------------------------------------------- shared by the TRL tree trainers (GRPO, RLOO, DPO, KTO; reward: some)
def prepare_trl_args(args: Any, config_class: type, model: Any, trainer_name: str) -> Any:
    """The tree trainer's arguments: ``args`` (TRL's default naming when ``None``); with ``tree_forward`` on, the
    model on ``tree_flash`` as ``TreeSFTTrainer`` does it: by name, ``model_init_kwargs["attn_implementation"]``
    becomes ``tree_flash`` (``None``/unset silently, another name with a warning); an instance is switched
    (``hf_tree.trainer.use_tree_attention``).

    Raises:
        ValueError: for a plain TRL config, which lacks the tree fields, or a model that cannot be switched.
    """
    if args is None:
        name = model if isinstance(model, str) else get_config_model_id(model.config)
        args = config_class(f"{name.split('/')[-1]}-{trainer_name}")
    if not isinstance(args, config_class):
        raise ValueError(
            f"args is a {type(args).__name__}; the tree trainer needs a {config_class.__name__} (the same fields plus "
            "the tree ones): swap the config class too."
        )
    if args.tree_forward and isinstance(model, str):
        args.model_init_kwargs = tree_model_init_kwargs(args.model_init_kwargs)
    elif args.tree_forward:
        use_tree_attention(model)
    return args


def log_tree_stats(trainer: Any) -> None:
    """Append the dedup ratio (branch tokens / packed tokens) of the last call of the trainer's tree forward
    (``trainer.tree_head``, a ``TreeForward``) to a TRL trainer's metrics; nothing when that call scored no token
    (e.g. every completion masked by ``mask_truncated_completions``), none ran or ``tree_forward=False``."""
    stats = None if trainer.tree_head is None else trainer.tree_head.layout_stats
    if stats is None:
        return
    mode = "train" if trainer.model.training else "eval"
    trainer._metrics[mode]["tree/dedup_ratio"].append(stats.dedup_ratio)


def warn_if_padding_numbered_positions(model: Any, trainer_name: str) -> None:
    """Say once, at start, that a ``PADDING_NUMBERED_POSITIONS`` model's tree log-probs differ from TRL's left-padded
    ones when prompts of unequal length share a generation batch, by how much, and how to train TRL's update."""
    config = causal_lm_of(model).config
    if config.model_type not in PADDING_NUMBERED_POSITIONS:
        return
    logger.warning(
        "hf_tree: %s (model_type=%r) adds absolute position embeddings, and TRL's %s training forward numbers a "
        "left-padded prompt from its padding (token k of a row with p pad tokens gets position p + k), while the tree "
        "forward numbers every row from its first token, as generate does. With prompts of unequal length in a batch "
        "the log-probs, and so the update, differ from TRL's (one GRPO step on a tiny GPT-2, prompts of 5 and 3 "
        "tokens: 0.51 relative over all parameters, 0.86 on the position embeddings; prompts of equal length: 9e-9, "
        "rounding). Set tree_forward=False to train TRL's update.",
        type(causal_lm_of(model)).__name__,
        config.model_type,
        trainer_name,
    )


def install_tree_heads(
    trainer: Any,
    policy_outputs: Sequence[str],
    temperature: float = 1.0,
    cast_lm_head_to_fp32: bool = False,
    logits_forward: bool = False,
) -> TreeFusedHead:
    """Put the tree fused head on a TRL trainer's policy (the base model of a PEFT policy) and reference model.

    Args:
        trainer: a ``TreeGRPOTrainer``/``TreeRLOOTrainer``/``TreeDPOTrainer``/``TreeKTOTrainer`` after TRL's
            ``__init__`` installed its own heads (its ``args`` carry ``max_packed_tokens`` and ``tree_self_check``).
        policy_outputs: per-token fields the policy pass computes (the reference computes ``log_probs`` only).
        temperature, cast_lm_head_to_fp32: as TRL gives them to its ``add_fused_lm_head``.
        logits_forward: plain calls get tree logits too (``TreeHeadSettings.logits_forward``).

    Returns:
        The policy's head (the trainer logs its packing).
    """
    settings = TreeHeadSettings(
        temperature=temperature,
        max_packed_tokens=trainer.args.max_packed_tokens,
        self_check=self_check_setting(trainer.args.tree_self_check),
        cast_lm_head_to_fp32=cast_lm_head_to_fp32,
        # the preference configs declare it (InBatchMergeArguments); the online RL trainers always merge
        merge_in_batch=getattr(trainer.args, "merge_in_batch", True),
        logits_forward=logits_forward,
    )
    policy = causal_lm_of(trainer.model)
    head = add_tree_fused_lm_head(policy, replace(settings, outputs=tuple(policy_outputs)))
    keep_training_kernels(policy)  # no-grad passes (reference precompute, evaluation) must not repack 4-bit weights
    if trainer.ref_model is not None:
        add_tree_fused_lm_head(causal_lm_of(trainer.ref_model), settings, name="ref_model")
    return head
