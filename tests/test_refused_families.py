"""Families refused by name (hf_tree.attention.families, and the recurrent mixers of hf_tree.models.check) are refused
with their family and reason in the first message, wherever they enter: ``from_pretrained(...,
attn_implementation="tree_flash")``, a tree trainer's ``__init__`` with an instance on its own attention, and
``tree_causal_lm_loss``. Before, Bloom got "load it with tree_flash" and then, so loaded, "load it with sdpa or eager".
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_tree import Tree, TreeDataCollator, TreeSFTConfig, TreeSFTTrainer, TreeTrainer, TreeTrainingArguments
from hf_tree.attention.families import REFUSED_FAMILIES
from hf_tree.loss import tree_causal_lm_loss
from hf_tree.zoo import tiny_config as zoo_tiny_config
from tests.helpers import VOCAB, common_args, tiny_model, word_tokenizer
from tests.workloads import branch_groups, prompt_completion_dataset, tree_dataset

BLOOM_REFUSAL = "hf_tree refuses Bloom models .*ALiBi"


def tiny_bloom(attn: str) -> torch.nn.Module:
    return tiny_model("bloom", vocab_size=VOCAB, n_head=4, n_layer=2, attn=attn)


@pytest.mark.parametrize("model_type", sorted(REFUSED_FAMILIES))
def test_every_refused_family_is_refused_on_load_by_name(model_type):
    try:
        config = zoo_tiny_config(model_type, 0)
    except Exception as error:  # noqa: BLE001 - a type this transformers lacks or cannot shrink
        pytest.skip(f"{model_type}: {error}")
    family, why = REFUSED_FAMILIES[model_type]
    try:
        AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="tree_flash")
    except ValueError as error:
        assert f"hf_tree refuses {family} models" in str(error) and why in str(error)
    except Exception as error:  # noqa: BLE001 - the tiny config fails inside the model, before the check can run
        pytest.skip(f"{model_type}: the zoo's tiny config does not build: {error}")
    else:
        pytest.fail(f"{model_type} loaded with tree_flash")


@pytest.mark.parametrize(
    ("family", "settings"),
    [("falcon", {}), ("falcon", {"alibi": True}), ("gpt_neo", {"num_layers": 2, "attention_types": [[["global"], 2]]})],
)
def test_legacy_attention_classes_are_refused_by_name(family, settings):
    """Falcon and GPT-Neo pick their own attention classes by the attention name (tree_flash looks like flash-attn to
    them: Falcon then called an undefined flash-attn function): refused by name, with the reason."""
    with pytest.raises(ValueError, match="hf_tree refuses (Falcon|GPT-Neo) models .*own eager/sdpa/flash attention"):
        tiny_model(family, vocab_size=VOCAB, **settings)


def test_from_pretrained_with_tree_flash_names_bloom_and_alibi(tmp_path):
    tiny_bloom("eager").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=BLOOM_REFUSAL):
        AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="tree_flash")


def test_tree_trainer_init_names_bloom_and_alibi(tmp_path):
    with pytest.raises(ValueError, match=BLOOM_REFUSAL):
        TreeTrainer(
            model=tiny_bloom("eager"),
            args=TreeTrainingArguments(**common_args(tmp_path, "bloom", 2, 1)),
            train_dataset=tree_dataset(branch_groups(num_trees=2)),
        )


@pytest.mark.parametrize("by_path", [False, True])
def test_tree_sft_trainer_init_names_bloom_and_alibi(tmp_path, by_path):
    model = tiny_bloom("eager")
    if by_path:  # TRL loads it with tree_flash (model_init_kwargs): refused on load
        model.save_pretrained(tmp_path / "bloom")
        model = str(tmp_path / "bloom")
    with pytest.raises(ValueError, match=BLOOM_REFUSAL):
        TreeSFTTrainer(
            model=model,
            args=TreeSFTConfig(output_dir=str(tmp_path / "out"), bf16=False, use_cpu=True, report_to=[]),
            train_dataset=prompt_completion_dataset(),
            processing_class=word_tokenizer(),
        )


def test_tree_trainer_init_names_a_recurrent_mixer(tmp_path):
    """RWKV (no attention to switch) is refused at init for its mixer, not at the first batch for its attention."""
    with pytest.raises(ValueError, match="RwkvSelfAttention: RWKV time mixing"):
        TreeTrainer(
            model=tiny_model("rwkv", dtype=torch.float32, attn="eager", vocab_size=VOCAB),
            args=TreeTrainingArguments(**common_args(tmp_path, "rwkv", 2, 1)),
            train_dataset=tree_dataset(branch_groups(num_trees=2)),
        )


def test_tree_loss_on_own_attention_names_the_family_first():
    batch = TreeDataCollator(max_packed_tokens=16)([Tree.from_sequences([[1, 2, 3, 4], [1, 2, 5, 6]]).to_dict()])
    with pytest.raises(ValueError, match=BLOOM_REFUSAL):
        tree_causal_lm_loss(tiny_bloom("eager"), batch)
