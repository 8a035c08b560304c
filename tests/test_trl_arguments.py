"""The tree fields of the TRL tree configs (``hf_tree.trl.arguments``): one declaration per field shared by every
config that has it, one switch name (``tree_forward``) whose old names still work with a ``FutureWarning``, and the
validation each field's declaration carries."""

from __future__ import annotations

import warnings

import pytest
from transformers import HfArgumentParser

from hf_tree.trl.dpo import TreeDPOConfig
from hf_tree.trl.grpo import TreeGRPOConfig
from hf_tree.trl.kto import TreeKTOConfig
from hf_tree.trl.reward import TreeRewardConfig
from hf_tree.trl.rloo import TreeRLOOConfig

CONFIGS = (TreeGRPOConfig, TreeRLOOConfig, TreeDPOConfig, TreeKTOConfig, TreeRewardConfig)
# field -> the configs that have it
SHARED_FIELDS = {
    "tree_forward": CONFIGS,
    "max_packed_tokens": CONFIGS,
    "tree_self_check": CONFIGS,
    "merge_in_batch": (TreeDPOConfig, TreeKTOConfig, TreeRewardConfig),
    "tree_share_across_microbatches": (TreeGRPOConfig, TreeRLOOConfig),
    "tree_prefill_once_per_group": (TreeGRPOConfig, TreeRLOOConfig),
    "tree_logprobs": (TreeGRPOConfig, TreeRLOOConfig, TreeDPOConfig, TreeKTOConfig),
}
OLD_SWITCH_NAMES = {cls: "tree_logprobs" for cls in CONFIGS[:4]} | {TreeRewardConfig: "tree_rewards"}
COMMON = dict(output_dir="unused", use_cpu=True, report_to=[])


@pytest.mark.parametrize("name", sorted(SHARED_FIELDS))
def test_each_tree_field_is_declared_once(name):
    """Every config holds the same ``Field`` (type, default, help): inherited from one mixin, not re-declared."""
    declarations = {id(cls.__dataclass_fields__[name]) for cls in SHARED_FIELDS[name]}
    assert len(declarations) == 1, f"{name} is declared {len(declarations)} times"
    assert not [cls for cls in CONFIGS if cls not in SHARED_FIELDS[name] and name in cls.__dataclass_fields__]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda cls: cls.__name__)
def test_old_switch_name_still_works_with_a_future_warning(cls):
    old = OLD_SWITCH_NAMES[cls]
    with pytest.warns(FutureWarning, match=f"`{old}` is deprecated .* Use `tree_forward` instead") as caught:
        config = cls(**COMMON, **{old: False})
    assert config.tree_forward is False
    assert {record.filename for record in caught if old in str(record.message)} == {__file__}  # points at the caller
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cls(**COMMON, tree_forward=False).tree_forward is False
    assert not [record for record in caught if "tree_" in str(record.message)]  # the new name: no warning


def test_old_switch_name_from_the_command_line():
    """TRL's scripts parse the configs with ``HfArgumentParser``: the old flag still parses, with the warning."""
    with pytest.warns(FutureWarning, match="`tree_logprobs` is deprecated"):
        (config,) = HfArgumentParser(TreeDPOConfig).parse_args_into_dataclasses(
            ["--output_dir", "unused", "--use_cpu", "--report_to", "none", "--tree_logprobs", "False"]
        )
    assert config.tree_forward is False


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda cls: cls.__name__)
def test_tree_fields_are_validated(cls):
    with pytest.raises(ValueError, match="max_packed_tokens=1 must be an integer >= 2, or None"):
        cls(**COMMON, max_packed_tokens=1)
    if "merge_in_batch" in cls.__dataclass_fields__:  # PackingConfig's rule
        with pytest.raises(ValueError, match="merge_in_batch='yes' must be True or False"):
            cls(**COMMON, merge_in_batch="yes")
