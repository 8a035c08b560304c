"""The Axolotl plugin: one YAML line gives Axolotl's SFT in-batch merging and the exact tree loss.

    plugins:
      - hf_tree.integrations.axolotl.TreePlugin
    tree_max_packed_tokens: 8192   # optional (these keys are validated by ``TreeArgs``)

Axolotl tokenizes and masks each sample as it always does (``chat_template``/``messages``, ``alpaca``, ``completion``,
``input_output``, ...; ``train_on_inputs``, ``roles_to_train``, ``train_on_eos``): the plugin takes its rows'
``input_ids`` and ``labels`` (``labels == -100`` is out of the loss), makes each row one branch and merges each
micro-batch's rows into tries by their tokens (``AxolotlTreeCollator``), so rows sharing a system prompt or earlier
turns compute them once; the trainer (``hf_tree.integrations.axolotl_trainer``) is Axolotl's own with hf_tree's tree
loss, divisor and ``dedup_ratio`` logs, and trains Axolotl's update. With ``rl: dpo`` the trainer stays Axolotl's
``AxolotlDPOTrainer`` and the plugin puts hf_tree's tree head on its policy and reference once it is created
(``install_dpo_tree_heads``: each pair's prompt computed once, TRL 1.9 computes the loss). Axolotl options that cannot
combine with trees, other ``rl:`` trainers among them, are refused at config validation (``TreeArgs``), naming the key
and the fix (docs/axolotl.md).
"""

from __future__ import annotations

from typing import Any

from axolotl.integrations.base import BasePlugin
from pydantic import BaseModel, Field, model_validator

# Axolotl keys that cannot combine with trees, set to anything but off: (why, fix). Checked on the raw YAML, before
# anything loads.
_REFUSED_KEYS: dict[str, tuple[str, str]] = {
    "sample_packing": (
        "Axolotl's multipack concatenates rows into one sequence, which the plugin replaces: each micro-batch's rows "
        "are merged into one trie and packed by hf_tree",
        "set sample_packing: false",
    ),
    "eval_sample_packing": ("evaluation rows are packed as trees by the plugin", "set eval_sample_packing: false"),
    "batch_flattening": (
        "flattened batches have no place for a tree mask; the plugin packs rows itself",
        "set batch_flattening: false",
    ),
    "pretraining_dataset": (
        "streamed pretraining concatenates samples in its own collator, outside the plugin's trees",
        "tokenize the data as a regular dataset (datasets:), or remove the plugin",
    ),
    "reward_model": ("reward models pool one score per sequence in TRL's RewardTrainer", "remove the plugin"),
    "process_reward_model": ("process reward models score tokens with a classification head", "remove the plugin"),
    "orpo_alpha": ("ORPO's odds-ratio loss is computed by Axolotl on padded pairs", "remove orpo_alpha or the plugin"),
    "use_eaft": ("EAFT replaces the loss function, the plugin computes the tree loss", "set use_eaft: false"),
    "neftune_noise_alpha": (
        "NEFTune scales its noise by the packed row's length and draws one noise per shared token",
        "remove neftune_noise_alpha",
    ),
    "processor_type": ("multimodal rows are collated by Axolotl's processor collator", "remove the plugin"),
    "trainer_cls": ("the plugin's trainer class replaces Axolotl's trainer_cls", "remove trainer_cls"),
    "s2_attention": ("shifted sparse attention cannot express a tree mask", "set s2_attention: false"),
    "cut_cross_entropy": (
        "its fused loss scores the shifted padded rows, the plugin's tree loss scores each trie edge",
        "set cut_cross_entropy: false",
    ),
    "liger_cross_entropy": ("Liger's loss needs labels, the plugin computes the tree loss", "set it to false"),
    "liger_fused_linear_cross_entropy": (
        "Liger's fused loss needs labels, the plugin computes the tree loss",
        "set it to false",
    ),
    "chunked_cross_entropy": ("it patches the loss, the plugin computes the tree loss", "set it to false"),
    "unsloth_cross_entropy_loss": ("it patches the loss, the plugin computes the tree loss", "set it to false"),
}
_PARALLEL_KEYS = ("context_parallel_size", "sequence_parallel_degree")
# The one ``rl:`` trainer the plugin trees (Axolotl's AxolotlDPOTrainer, TRL 1.9's DPOTrainer), and the DPO keys it
# refuses there: (why, fix).
DPO = "dpo"
_REFUSED_DPO_KEYS: dict[str, tuple[str, str]] = {
    "dpo_use_liger_kernel": (
        "Liger's fused DPO loss runs the backbone and head itself, never the model's forward the tree head answers",
        "set dpo_use_liger_kernel: false",
    ),
    "dpo_padding_free": (
        "padding-free pairs have no place for a tree mask (TRL 1.9 turns it off anyway); the plugin packs pairs itself",
        "set dpo_padding_free: false",
    ),
}


def refused_setting(config: dict[str, Any]) -> str | None:
    """The first Axolotl setting in ``config`` (the raw YAML mapping) that cannot combine with trees, as the
    ``ValueError`` message naming it, the value and the fix; ``None`` when every setting can."""
    for key, (why, fix) in _REFUSED_KEYS.items():
        value = config.get(key)
        if value not in (None, False, 0, "", [], {}):
            return f"{key}={value!r} cannot combine with hf_tree's Axolotl plugin: {why}. Fix: {fix}."
    rl_message = refused_rl_setting(config)
    if rl_message is not None:
        return rl_message
    for key in _PARALLEL_KEYS:
        value = config.get(key)
        if value not in (None, 1):
            return (
                f"{key}={value!r} cannot combine with hf_tree's Axolotl plugin: Axolotl's ring attention shards "
                f"padded rows with a causal mask, not trees. Fix: set {key}: 1."
            )
    return None


def rl_of(config: Any) -> str | None:
    """The ``rl:`` value of a config (the raw YAML's string or Axolotl's ``RLType``) as a string; ``None`` if unset."""
    rl = config.get("rl")
    return None if rl in (None, False, "") else str(getattr(rl, "value", rl))


def refused_rl_setting(config: dict[str, Any]) -> str | None:
    """The ``ValueError`` message for an ``rl:`` trainer other than DPO, or a DPO option the tree head cannot honour;
    ``None`` for SFT and for tree-able DPO."""
    rl = rl_of(config)
    if rl is None:
        return None
    if rl != DPO:
        return (
            f"rl={rl!r} cannot combine with hf_tree's Axolotl plugin: of Axolotl's preference trainers it trees DPO "
            f"only (TRL 1.9's other trainers are not tree-exact through it). Fix: set rl: {DPO}, or remove the plugin."
        )
    for key, (why, fix) in _REFUSED_DPO_KEYS.items():
        if config.get(key):
            return (
                f"{key}={config[key]!r} cannot combine with hf_tree's Axolotl plugin under rl: dpo: {why}. Fix: {fix}."
            )
    return None


class TreeArgs(BaseModel):
    """The plugin's own YAML keys (Axolotl merges this model into its config schema and validates them)."""

    tree_max_packed_tokens: int | None = Field(
        default=None,
        json_schema_extra={
            "description": "Capacity of one packed tree row in (deduplicated) tokens. Default: sequence_len x "
            "micro_batch_size, the padded batch's budget, so each micro-batch's trie fits one row. A smaller value "
            "splits larger tries by their branches (exact; the shared prefix is repeated). At least sequence_len."
        },
    )
    tree_merge_in_batch: bool = Field(
        default=True,
        json_schema_extra={
            "description": "Merge each micro-batch's rows into tries by their tokens (a shared system prompt or "
            "earlier turns computed once). False packs each row as its own tree (nothing shared)."
        },
    )
    tree_self_check: bool = Field(
        default=True,
        json_schema_extra={
            "description": "Before the first step, probe the model with a tiny tree against its branches run alone "
            "and refuse a model that is not tree-exact (hf_tree.models.check)."
        },
    )

    @model_validator(mode="before")
    @classmethod
    def refuse_settings_trees_cannot_honour(cls, data: Any) -> Any:
        """``ValueError`` for an Axolotl key that cannot combine with trees, and for a row capacity below
        ``sequence_len`` (a row must hold Axolotl's longest sample)."""
        if not isinstance(data, dict):
            return data
        message = refused_setting(data)
        if message is not None:
            raise ValueError(message)
        capacity, sequence_len = data.get("tree_max_packed_tokens"), data.get("sequence_len")
        if capacity is not None and isinstance(sequence_len, int) and not capacity >= sequence_len:
            raise ValueError(
                f"tree_max_packed_tokens={capacity!r} is below sequence_len={sequence_len}: a packed row must hold "
                "Axolotl's longest sample. Raise tree_max_packed_tokens, or leave it unset (sequence_len x "
                "micro_batch_size)."
            )
        return data


class TreePlugin(BasePlugin):
    """``plugins: [hf_tree.integrations.axolotl.TreePlugin]``: Axolotl's SFT and DPO on merged tries
    (docs/axolotl.md)."""

    def get_input_args(self) -> str:
        return f"{__name__}.TreeArgs"

    def get_trainer_cls(self, cfg: Any) -> type | None:
        """SFT: Axolotl's trainer with the tree loss. DPO: ``None``, Axolotl's own trainer (its RL builder passes a
        plugin's class no model), treed in ``post_trainer_create``."""
        from hf_tree.integrations.axolotl_trainer import tree_trainer_class

        message = refused_setting(dict(cfg))  # also for a cfg built in code, which skips the YAML validation
        if message is not None:
            raise ValueError(message)
        if rl_of(cfg) == DPO:
            return None
        return tree_trainer_class(self_check=cfg.tree_self_check is not False)

    def post_trainer_create(self, cfg: Any, trainer: Any) -> None:
        """DPO: the tree head on Axolotl's trainer's policy and reference (``install_dpo_tree_heads``)."""
        # Axolotl's plugin registry is process-wide and calls this hook for every later run, listed or not
        if rl_of(cfg) == DPO and f"{__name__}.{type(self).__name__}" in (cfg.plugins or ()):
            from hf_tree.integrations.axolotl_trainer import install_dpo_tree_heads

            install_dpo_tree_heads(trainer, cfg)

    def get_collator_cls_and_kwargs(self, cfg: Any, is_eval: bool = False) -> tuple[type, dict[str, Any]]:
        from hf_tree.integrations.axolotl_trainer import AxolotlTreeCollator
        from hf_tree.packing import PackingConfig

        sequence_len = int(cfg.sequence_len)
        batch_size = int((cfg.eval_batch_size or cfg.micro_batch_size) if is_eval else cfg.micro_batch_size)
        packing = PackingConfig(
            max_packed_tokens=cfg.tree_max_packed_tokens or sequence_len * batch_size,
            max_branch_tokens=sequence_len,  # Axolotl already cut or dropped longer samples: a longer row is a bug
            merge_in_batch=cfg.tree_merge_in_batch is not False,
        )
        return AxolotlTreeCollator, {"packing": packing}
