"""One prompt forward per optimizer step in ``TreeGRPOTrainer``/``TreeRLOOTrainer``'s policy pass, even when TRL's
``per_device_train_batch_size`` cuts a group across micro-batches (``tree_share_across_microbatches=True``).

TRL runs the policy pass (the one with gradients) once per micro-batch, and the packed pass of
``hf_tree.trl.rollout_logprobs`` packs only that micro-batch's rows: a group of 8 completions in micro-batches of 2
forwards its prompt 4 times per optimizer step. Here the prompt's keys and values are computed once per optimizer
step and shared by the micro-batches, with the depth-first executor's machinery (``hf_tree.depth_first``,
``hf_tree.attention.prefix``):

- **Prompt pieces.** When a micro-batch's policy pass meets a prompt that a later micro-batch of the same optimizer
  step also holds (TRL's buffered micro-batches ``self._buffered_inputs[s % steps_per_generation]`` for the
  remaining steps ``s`` of the gradient-accumulation window), the prompt minus its last token is forwarded once,
  with gradients, recording each layer's post-RoPE keys/values (hybrids: also each convolution's inputs and each
  recurrence's final state) in ``PrefixCache.own``. Its graph stays alive; these entries are handed to later units
  as detached leaves with ``requires_grad``.
- **Units.** Each micro-batch's rows of that prompt then run as one packed mini-tree over the cached prompt: the
  prompt's last token (it predicts each completion's first token) and the trie of the completions. Rows whose prompt
  is not shared run as an ordinary packed tree (prompt and completions). TRL's fused log-prob kernel scores every
  completion token, and the pass returns TRL's ``[B, logits_to_keep]`` log-probs and entropies: TRL's
  ``_compute_loss`` and ``Trainer``'s backward are untouched, and that backward accumulates the cached leaves'
  gradients in ``.grad``.
- **Piece backward.** After the last micro-batch of the optimizer step (``training_step``, when accelerate's
  ``sync_gradients`` is set: before clipping and the optimizer step) every piece is backpropagated once with
  ``torch.autograd.backward([*entries], [*entry_leaf.grad])``; the parameters' ``.grad`` are
  then what TRL's per-row passes accumulate. The next optimizer step forwards its prompts again (new weights).
- **Several processes (DDP, FSDP2).** That backward needs the last micro-batch's leaf gradients, so it cannot precede
  the last micro-batch's synchronizing backward. Every micro-batch runs on ``DepthFirstRunner.local_model`` instead
  (gradients accumulate unreduced, no collective), then the pieces' backward, then ``_reduce_gradients``: one
  token's zero-loss forward and backward through the wrapped model, which reduces the whole step as DDP/FSDP2 do.

The old-policy and reference passes (no gradients) keep the packed pass: they are exact as they are.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from hf_tree.attention.prefix import PrefixCache
from hf_tree.depth_first_runner import DepthFirstRunner
from hf_tree.models.check import check_model_for_trees, self_check_setting
from hf_tree.models.introspection import backbone_of, causal_lm_of
from hf_tree.models.length_rope import check_rope_lengths
from hf_tree.models.router_loss import router_aux_loss_coef
from hf_tree.tree import Tree
from hf_tree.trl.arguments import TreeLogProbArguments
from hf_tree.trl.glue import TreeFusedHead
from hf_tree.trl.logprobs import fused_head_values, scatter_to_rows

OPTION = "tree_share_across_microbatches=True"
logger = logging.getLogger("hf_tree")


@dataclass
class TreeRolloutArguments(TreeLogProbArguments):
    """``TreeLogProbArguments`` plus the options of the online RL trainers (``TreeGRPOConfig``, ``TreeRLOOConfig``);
    DPO/KTO neither generate nor have micro-batches of one group, so their configs do not carry them."""

    tree_share_across_microbatches: bool | None = field(
        default=None,
        metadata={
            "help": "Policy pass: forward each prompt shared by several micro-batches of one optimizer step once "
            "(its keys/values are cached and backpropagated once after the step's last micro-batch) instead of once "
            "per micro-batch. Exact on one process (tests/test_grpo_depth_first.py) and on several under DDP or FSDP2, "
            "where the step's gradients are reduced after the prompts' backward (tests/test_shared_prompts_"
            "distributed.py). None (default): on where supported and where a micro-batch shares a prompt with "
            "another, else the per-micro-batch pass (exact too; logged where unsupported). True: on, and refused "
            "(ValueError) with several processes other than DDP/FSDP2 (FSDP1, HSDP, tensor parallel), DeepSpeed, "
            "fp16, an MoE router loss, a vision-language model, reentrant gradient checkpointing or "
            "tree_forward=False. False: off."
        },
    )

    tree_prefill_once_per_group: bool = field(
        default=True,
        metadata={
            "help": "Generation (TRL's transformers path, use_vllm=False): forward each distinct prompt once and "
            "expand its cache to the group's rows (keys/values and the conv/recurrent states of hybrids) instead of "
            "prefilling every copy; completions equal TRL's (tests/test_group_generation.py). Falls back to TRL's "
            "own call, logged once, for vLLM, continuous batching, FSDP/DeepSpeed on several processes, image prompts, "
            "beam search, a cache_implementation and caches it cannot expand (hf_tree.trl.group_generation). "
            "False: off."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tree_share_across_microbatches:  # explicitly on: refuse what it cannot do
            causes = self.shared_prompt_config_causes()
            if causes:
                raise ValueError(
                    f"{OPTION} does not support {'; '.join(causes)}. Set tree_share_across_microbatches=False."
                )

    def shared_prompt_config_causes(self) -> list[str]:
        """What in this config rules the shared policy pass out (empty: nothing)."""
        causes = []
        if not self.tree_forward:
            causes.append("tree_forward=False (it is a tree log-prob pass)")
        if self.gradient_checkpointing and (self.gradient_checkpointing_kwargs or {}).get("use_reentrant"):
            causes.append(
                "reentrant gradient checkpointing (it would drop the gradient of the cached prompt keys/values; "
                "use_reentrant=False is TRL's default)"
            )
        if self.fp16:
            causes.append("fp16 loss scaling (not tested; use bf16 or float32)")
        return causes


@dataclass
class _Piece:
    """A prompt (minus its last token) forwarded once in this optimizer step."""

    length: int
    outputs: list[torch.Tensor]
    """The piece's recorded entries (keys/values per layer), with their graph."""
    leaves: dict[Hashable, torch.Tensor]
    """Detached ``requires_grad`` copies that units read; their ``.grad`` accumulate over the micro-batches."""
    positions: torch.Tensor
    """``[1, length]`` depths."""
    global_step: int
    """The optimizer step (``Trainer.state.global_step``) whose weights it was computed with."""


@dataclass
class SharedPromptStats:
    """Tokens forwarded with gradients by the shared policy passes (for logs and tests)."""

    pieces: int = 0
    piece_tokens: int = 0
    unit_tokens: int = 0
    row_tokens: int = 0
    """Tokens of the scored rows (prompt and completion, up to the last scored token), as TRL forwards them."""


class _ScoredGroup(NamedTuple):
    """One prompt group's share of a shared policy pass."""

    predicting: torch.Tensor
    """``[M, D]`` the hidden states that predict the group's scored tokens."""
    targets: np.ndarray
    """``[M]`` the scored tokens."""
    output_index: np.ndarray
    """``[M]`` their flat index into TRL's ``[B, T - 1]`` output."""
    forwarded: int
    """Tokens forwarded for the group (its piece, when forwarded now, and its tree)."""


def _rows_by_prompt(ids: np.ndarray, real: np.ndarray, prompt_width: int) -> dict[tuple[int, ...], list]:
    """The rows of a micro-batch (``ids``/``real`` ``[B, T]``: token ids, not padding) that score a token, grouped by
    their prompt tokens: ``{prompt: [(row, first real column, scored columns [K] int64), ...]}``.

    Raises:
        ValueError: for a row that is not a non-empty left-padded prompt and a right-padded completion.
    """
    groups: dict[tuple[int, ...], list[tuple[int, int, np.ndarray]]] = defaultdict(list)
    for row in range(ids.shape[0]):
        run = np.nonzero(real[row])[0]
        columns = np.nonzero(real[row, prompt_width:])[0] + prompt_width
        if columns.size == 0:
            continue
        start = int(run[0])
        if run.size != int(run[-1]) + 1 - start or start >= prompt_width:
            raise ValueError(
                f"row {row}: {OPTION} needs a non-empty left-padded prompt and a right-padded completion (one "
                "contiguous run of real tokens)."
            )
        groups[tuple(ids[row, start:prompt_width].tolist())].append((row, start, columns))
    return groups


class SharedPromptPolicyMixin:
    """The base of ``TreeRolloutLogProbsMixin`` (``TreeGRPOTrainer``, ``TreeRLOOTrainer``), which calls
    ``_check_shared_prompts`` after TRL's ``__init__`` and ``_shared_policy_logps`` from its log-prob pass; a no-op
    unless ``args.tree_share_across_microbatches``."""

    tree_head: TreeFusedHead | None
    """The policy's tree fused head (``TreeRolloutLogProbsMixin`` installs it): its forward runs the first-use probe."""
    _shared_pieces: dict[tuple[int, ...], _Piece]
    shared_prompt_stats: SharedPromptStats
    _share_prompts: bool = False
    _defers_gradient_sync: bool = False
    """Several processes with sharing on: decided once, the same on every rank (``training_step``)."""

    def _shares_prompts(self) -> bool:
        return self._share_prompts

    def _check_shared_prompts(self) -> None:
        """Decide whether the shared policy pass runs: ``tree_share_across_microbatches=True`` raises ``ValueError``
        (naming the option) for what it cannot do, the default ``None`` turns it off there (logged), ``False`` off."""
        self._shared_pieces = {}
        self.shared_prompt_stats = SharedPromptStats()
        # the process layouts, model checks and collective-free module of depth-first units, which the pieces are
        self._depth_first = DepthFirstRunner(self.accelerator, self_check_setting(self.args.tree_self_check))
        setting = self.args.tree_share_across_microbatches
        self._share_prompts = setting is not False
        if setting is False:
            return
        try:
            self._refuse_shared_prompts()
        except ValueError as error:
            if setting:
                raise
            self._share_prompts = False
            logger.info(
                "hf_tree: the shared-prompt policy pass is off (%s); each micro-batch packs its own rows.", error
            )
        # kept even if the first shared pass's model probe turns sharing off on some rank: exact either way
        self._defers_gradient_sync = self._share_prompts and self.accelerator.num_processes > 1

    def _refuse_shared_prompts(self) -> None:
        """``ValueError`` naming the option for what the shared policy pass cannot do on this trainer."""
        causes = self.args.shared_prompt_config_causes()
        layout = self._depth_first.process_obstacle()  # DeepSpeed included
        if layout is not None:
            causes.append(layout)
        if getattr(self, "aux_loss_enabled", False) or router_aux_loss_coef(causal_lm_of(self.model)):
            causes.append("an MoE router load-balancing loss (a mean over the micro-batch's tokens)")
        config = causal_lm_of(self.model).config
        if config.get_text_config() is not config:
            causes.append(f"a vision-language model (model_type={config.model_type!r})")
        if causes:
            raise ValueError(
                f"{OPTION} does not support {'; '.join(causes)}. Set tree_share_across_microbatches=False."
            )
        self._refuse_model()

    def _refuse_model(self) -> None:
        """``DepthFirstRunner.refuse_model`` (MoE router loss, reentrant checkpointing), naming this option."""
        try:
            self._depth_first.refuse_model(causal_lm_of(self.model))
        except ValueError as error:
            raise ValueError(f"{OPTION}: {error} (or set tree_share_across_microbatches=False)") from error

    def _shared_policy_logps(
        self,
        model: torch.nn.Module,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        logits_to_keep: int,
        compute_entropy: bool,
        compute_aux_loss: bool,
        multimodal_inputs: dict[str, Any],
    ) -> tuple[torch.Tensor, torch.Tensor, None] | None:
        """TRL's log-probs and entropies of the policy pass (entropies asked for, gradients on, training) over the
        step's shared prompts; ``None`` for every other pass, and where ``_shared_policy_pass`` declines (the caller,
        ``TreeRolloutLogProbsMixin._get_per_token_logps_and_entropies``, then runs the packed pass)."""
        shared = self._shares_prompts() and compute_entropy and torch.is_grad_enabled() and self.model.training
        if not shared:
            return None
        images = sorted(k for k, v in multimodal_inputs.items() if v is not None)
        if images or compute_aux_loss:
            raise ValueError(
                f"{OPTION} does not support image inputs {images} or an MoE router loss. Set "
                "tree_share_across_microbatches=False."
            )
        return self._shared_policy_pass(model, input_ids, attention_mask, logits_to_keep)

    # ------------------------------------------------------------------------------------------ TRL hooks
    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None):
        """TRL's step; after the optimizer step's last micro-batch (accelerate's ``sync_gradients``, set by
        ``Trainer`` before clipping and the optimizer step), backpropagate the step's prompt pieces once.

        Under several processes (DDP, FSDP2) every micro-batch, the last one included, runs on
        ``DepthFirstRunner.local_model`` (no collective in its forwards and backwards: each rank holds its own pieces
        and units; gradients accumulate unreduced), then the pieces' backward, then ``_reduce_gradients`` reduces the
        whole step's gradients as DDP/FSDP2 reduce TRL's."""
        defer = self._defers_gradient_sync
        try:
            with self._depth_first.local_model(model) if defer else contextlib.nullcontext(model) as local:
                output = super().training_step(local, inputs, num_items_in_batch)
                if getattr(self, "_shared_pieces", None) and self.accelerator.sync_gradients:
                    self.backward_shared_prompts()
        except BaseException:
            self._shared_pieces = {}
            raise
        if defer and self.accelerator.sync_gradients:
            self._reduce_gradients(model)
        return output

    def _reduce_gradients(self, model: torch.nn.Module) -> None:
        """The engine's own gradient reduction of everything the step accumulated: one synchronizing forward and
        backward of one token with a zero loss on every rank (DDP all-reduces, FSDP2 reduce-scatters, each averaging
        over ranks exactly as after TRL's last micro-batch; adding the zero gradient changes nothing)."""
        token = torch.zeros((1, 1), dtype=torch.long, device=self.accelerator.device)
        with self.accelerator.autocast():
            logits = model(input_ids=token, use_cache=False).logits
        self.accelerator.backward(logits.float().sum() * 0.0)

    def backward_shared_prompts(self) -> None:
        """Backpropagate every prompt piece of the step with its leaves' accumulated gradients, once."""
        pieces, self._shared_pieces = self._shared_pieces, {}
        outputs, grads = [], []
        for piece in pieces.values():
            for tensor, leaf in zip(piece.outputs, piece.leaves.values()):
                if tensor.requires_grad and leaf.grad is not None:
                    outputs.append(tensor)
                    grads.append(leaf.grad)
        if outputs:
            torch.autograd.backward(outputs, grads)

    # ------------------------------------------------------------------------------------------ the pass
    def _later_prompts(self) -> set[tuple[int, ...]]:
        """Prompts (real tokens) of the micro-batches after the current one in this optimizer step that are already
        generated (TRL's buffer); empty when that cannot be told. Only decides what is cached, never exactness."""
        buffered = getattr(self, "_buffered_inputs", None)
        if not buffered:
            return set()
        per_generation = self.args.steps_per_generation
        generate_every = per_generation * self.num_iterations
        accumulation = self.current_gradient_accumulation_steps
        step = self._step
        window_end = (step // accumulation + 1) * accumulation
        prompts: set[tuple[int, ...]] = set()
        for later in range(step + 1, window_end):
            if later // generate_every != step // generate_every:
                break
            batch = buffered[later % per_generation]
            ids, mask = batch["prompt_ids"].detach().cpu().numpy(), batch["prompt_mask"].detach().cpu().numpy()
            prompts.update(tuple(row[m != 0].tolist()) for row, m in zip(ids, mask))
        return prompts

    def _shared_policy_pass(
        self, model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, logits_to_keep: int
    ) -> tuple[torch.Tensor, torch.Tensor, None] | None:
        """TRL's ``[B, logits_to_keep]`` log-probs and entropies; ``None`` when nothing is scored (the packed pass
        then returns TRL's zero output connected to the model) or, with the default (automatic) setting, when no
        prompt of the micro-batch is shared or the model's first-use probe rules the pass out (the packed pass runs)."""
        ids = input_ids.detach().cpu().numpy()
        real = attention_mask.detach().cpu().numpy() != 0
        groups = _rows_by_prompt(ids, real, ids.shape[1] - logits_to_keep)
        if not groups:
            return None
        self._refuse_stale_pieces()

        later = self._later_prompts()
        automatic = self.args.tree_share_across_microbatches is None
        if automatic and not any(prompt in later or prompt in self._shared_pieces for prompt in groups):
            return None  # nothing to share: the per-micro-batch packed pass
        checked = self._checked_for_shared_pass(model, automatic)
        if checked is None:
            return None
        causal_lm, logit_head = checked
        backbone = backbone_of(causal_lm)
        device = causal_lm.get_input_embeddings().weight.device
        scored = [
            self._score_prompt_group(backbone, causal_lm, prompt, rows, ids, later, device)
            for prompt, rows in groups.items()
        ]
        log_probs, entropy = self._values_in_trl_order(causal_lm, logit_head, scored, ids.shape, logits_to_keep, device)

        mode = "train" if self.model.training else "eval"
        forwarded = sum(group.forwarded for group in scored)
        self._metrics[mode]["tree/dedup_ratio"].append(int(real.sum()) / max(forwarded, 1))
        return log_probs, entropy, None

    def _refuse_stale_pieces(self) -> None:
        """``RuntimeError`` when prompt pieces of an earlier optimizer step were never backpropagated."""
        stale = [p for p in self._shared_pieces.values() if p.global_step != self.state.global_step]
        if stale:  # backward_shared_prompts did not run on the last micro-batch of the previous optimizer step
            self._shared_pieces = {}
            raise RuntimeError(
                f"{OPTION}: prompt pieces of optimizer step {stale[0].global_step} were never backpropagated (their "
                "gradient is missing from that step). The trainer's training_step must run on every micro-batch, "
                "with accelerate's sync_gradients set on the last one, as transformers.Trainer does."
            )

    def _checked_for_shared_pass(self, model: torch.nn.Module, automatic: bool) -> tuple[Any, Any] | None:
        """``(causal LM, its logit head)`` after the first-use check and the depth-first probe; ``None`` when the
        probe rules the shared pass out under the automatic setting (then off for good, with one log line).

        Raises:
            ValueError: when the probe rules it out and ``tree_share_across_microbatches=True``.
        """
        unwrapped = self.accelerator.unwrap_model(model)
        causal_lm = causal_lm_of(unwrapped)
        self_check = self_check_setting(self.args.tree_self_check)
        logit_head = check_model_for_trees(causal_lm, self_check, forward=self.tree_head.previous_forward)
        try:
            self._depth_first.check_model(unwrapped, causal_lm, logit_head)
        except ValueError as error:
            if not automatic:
                raise ValueError(f"{OPTION}: {error} (or set tree_share_across_microbatches=False)") from error
            self._share_prompts = False  # no piece exists yet: the first shared pass probes the model
            logger.warning("hf_tree: the shared-prompt policy pass is off: %s", error)
            return None
        return causal_lm, logit_head

    def _score_prompt_group(
        self,
        backbone: torch.nn.Module,
        causal_lm: torch.nn.Module,
        prompt: tuple[int, ...],
        rows: list[tuple[int, int, np.ndarray]],
        ids: np.ndarray,
        later: set[tuple[int, ...]],
        device: torch.device,
    ) -> _ScoredGroup:
        """One prompt's rows (``_rows_by_prompt``) as one packed tree over the prompt's piece (forwarded first when a
        later micro-batch of the step holds the prompt too; without a piece the tree holds the prompt)."""
        width = ids.shape[1]
        stats = self.shared_prompt_stats
        forwarded = 0
        piece = self._shared_pieces.get(prompt)
        if piece is None and len(prompt) > 1 and prompt in later:
            piece = self._forward_piece(backbone, causal_lm, prompt, device)
            forwarded += piece.length
        offset = piece.length if piece is not None else 0
        sequences = [ids[row, start + offset : int(columns[-1]) + 1].tolist() for row, start, columns in rows]
        tree = Tree.from_sequences(sequences, branch_fields={"row": [r for r, _, _ in rows]})
        position_ids = torch.from_numpy(tree.position_ids + offset)[None].to(device)
        kv_end = torch.from_numpy(tree.kv_end)[None].to(device=device, dtype=torch.int32)
        extra = {}
        if piece is not None:
            extra["kv_prefix"] = PrefixCache.over(piece.leaves, piece.positions, kv_end, position_ids)
        check_rope_lengths(causal_lm.config, position_ids)
        with self.accelerator.autocast():
            hidden = backbone(
                input_ids=torch.from_numpy(tree.input_ids)[None].to(device),
                position_ids=position_ids,
                kv_end=kv_end,
                use_cache=False,
                **extra,
            ).last_hidden_state[0]
        forwarded += tree.num_tokens
        stats.unit_tokens += tree.num_tokens
        local, targets, output_index = [], [], []
        for branch, (row, start, columns) in enumerate(rows):
            flat = tree.branch_flat_indices(branch)
            local.append(flat[columns - start - offset - 1])  # the token before each scored one
            targets.append(ids[row, columns])
            output_index.append(row * (width - 1) + columns - 1)
            stats.row_tokens += int(columns[-1]) + 1 - start
        predicting = hidden.index_select(0, torch.from_numpy(np.concatenate(local)).to(device))
        return _ScoredGroup(predicting, np.concatenate(targets), np.concatenate(output_index), forwarded)

    def _values_in_trl_order(
        self,
        causal_lm: torch.nn.Module,
        logit_head: Any,
        scored: list[_ScoredGroup],
        batch_shape: tuple[int, int],
        logits_to_keep: int,
        device: torch.device,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The groups' scored tokens through TRL's fused head, as ``[B, logits_to_keep]`` log-probs and entropies
        (``batch_shape``: the micro-batch's ``(B, T)``)."""
        batch_size, width = batch_shape
        # TRL's row order (its kernel's float32 gradients round by the order of the rows it scores)
        output_index = np.concatenate([group.output_index for group in scored])
        order = np.argsort(output_index, kind="stable")
        hidden = torch.cat([group.predicting for group in scored]).index_select(0, torch.from_numpy(order).to(device))
        values = fused_head_values(
            causal_lm,
            hidden,
            torch.from_numpy(np.concatenate([group.targets for group in scored])[order]),
            self.temperature,
            ("log_probs", "entropy"),
            getattr(self.args, "cast_lm_head_to_fp32", False),
            logit_head,
        )
        index, shape = torch.from_numpy(output_index[order]), (batch_size, width - 1)
        log_probs, entropy = (
            scatter_to_rows(values[k], index, shape)[:, -logits_to_keep:] for k in ("log_probs", "entropy")
        )
        return log_probs, entropy

    def _forward_piece(
        self, backbone: torch.nn.Module, causal_lm: torch.nn.Module, prompt: tuple[int, ...], device: torch.device
    ) -> _Piece:
        """Forward ``prompt`` minus its last token with gradients, recording its keys/values for later units."""
        length = len(prompt) - 1
        position_ids = torch.arange(length, device=device)[None]
        kv_end = torch.full((1, length), length, dtype=torch.int32, device=device)
        prefix = PrefixCache.over({}, position_ids[:, :0], kv_end, position_ids)
        check_rope_lengths(causal_lm.config, position_ids)
        with self.accelerator.autocast():
            backbone(
                input_ids=torch.tensor([prompt[:length]], device=device),
                position_ids=position_ids,
                kv_end=kv_end,
                kv_prefix=prefix,
                use_cache=False,
            )
        outputs = list(prefix.own.values())
        leaves = {key: t.detach().requires_grad_(t.requires_grad) for key, t in prefix.own.items()}
        piece = _Piece(length, outputs, leaves, position_ids, self.state.global_step)
        self._shared_pieces[prompt] = piece
        self.shared_prompt_stats.pieces += 1
        self.shared_prompt_stats.piece_tokens += length
        return piece
