"""What the first-use check verified stays true, or the next tree pass refuses (hf_tree.models.check_guard).

A hybrid model's tree-aware mixers live in its modeling module: reloading that module (``importlib.reload``) ran its
code again and restored the plain mixers after the check, and the model then trained with siblings mixed (Bamba's
gradients 0.24 off per-branch, Qwen3.5's 0.12), with no error. Oracle: the per-branch run with the model's own
attention (tests/helpers.py), tiny float64 hybrids whose mixers compute in float32 inside (bound ``FLOAT32_FLOOR``).
The QLoRA half of the guard (4-bit layers repacked after the check) is tested in tests/test_quantized.py.
"""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.models.mixers.install import install_tree_mixers, is_tree_dispatch
from hf_tree.post_import import when_imported
from tests.helpers import (
    FLOAT32_FLOOR,
    REPO_ROOT,
    float32_floor_grad_error,
    grads_of,
    hybrid_model,
    per_branch_forest_loss,
)

# two trees: a fork inside the prompt, a prefix branch, a fork at position 1
GROUPS = [
    ([[5, 6, 7, 8, 9, 10], [5, 6, 7, 8, 20, 21, 22], [5, 6, 7, 8, 20]], None),
    ([[30, 31, 32, 33], [30, 40, 41]], None),
]


def gradient_error(model) -> float:
    """``float32_floor_grad_error`` of one tree batch of ``GROUPS`` against the same branches run alone."""
    model.zero_grad()
    batch = TreeDataCollator(max_packed_tokens=64)([Tree.from_sequences(s, m).to_dict() for s, m in GROUPS])
    tree_causal_lm_loss(model, batch).backward()
    tree_grads = grads_of(model)
    model.zero_grad()
    per_branch_forest_loss(model, GROUPS).backward()
    return float32_floor_grad_error(tree_grads, grads_of(model))


def test_a_module_imported_before_the_hook_is_patched_again_on_reload(tmp_path, monkeypatch):
    """``when_imported`` on a module already imported calls back now and after each reload (it used to call back
    only now: a reload undid the patch for good)."""
    (tmp_path / "hf_tree_reload_probe.py").write_text("value = 'plain'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("hf_tree_reload_probe")
    try:
        when_imported("hf_tree_reload_probe", lambda m: setattr(m, "value", "patched"))
        assert module.value == "patched"
        importlib.reload(module)
        assert module.value == "patched"
    finally:
        sys.modules.pop("hf_tree_reload_probe", None)


# run in a fresh interpreter, with this module's GROUPS and gradient_error
RELOAD_AFTER_CHECK = """
import importlib
import {modeling} as modeling  # imported before hf_tree: the post-import hook patches it at `import hf_tree`
from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from tests.helpers import float32_floor_grad_error, grads_of, hybrid_model, per_branch_forest_loss

GROUPS = {groups!r}
{gradient_error}
model = hybrid_model({family!r})
before = gradient_error(model)  # the first-use check runs here
importlib.reload(modeling)
print(before, gradient_error(model))
"""


@pytest.mark.parametrize(
    "family, modeling",
    [
        # a fresh interpreter each (~30 s): the fast tier keeps the reload unit test above
        pytest.param("bamba", "transformers.models.bamba.modeling_bamba", marks=pytest.mark.slow),
        pytest.param("qwen3_5_text", "transformers.models.qwen3_5.modeling_qwen3_5", marks=pytest.mark.slow),
    ],
)
def test_reloading_the_modeling_module_after_the_check_keeps_training_exact(family, modeling):
    """The finding as found: the modeling module imported before hf_tree, the model checked, the module reloaded;
    training stays per-branch exact (its mixers are patched again)."""
    source = inspect.getsource(gradient_error)
    script = RELOAD_AFTER_CHECK.format(modeling=modeling, family=family, groups=GROUPS, gradient_error=source)
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    before, after = map(float, result.stdout.split()[-2:])
    print(f"\n{family}: gradient error before the reload {before:.1e}, after {after:.1e}")
    assert before <= FLOAT32_FLOOR and after <= FLOAT32_FLOOR


def test_a_mixer_op_rebound_after_the_check_is_refused():
    """A mixer op rebound by other means than a reload (the plain function put back) is refused by name at the
    next tree pass, not trained with siblings mixed."""
    from transformers.models.bamba import modeling_bamba

    model = hybrid_model("bamba")
    assert gradient_error(model) <= FLOAT32_FLOOR  # checked
    patched = modeling_bamba.causal_conv1d_fn
    assert is_tree_dispatch(patched)
    modeling_bamba.causal_conv1d_fn = patched.__hf_tree_original__
    try:
        with pytest.raises(ValueError, match=r"modeling_bamba\.causal_conv1d_fn is no longer hf_tree's tree-aware"):
            gradient_error(model)
    finally:
        install_tree_mixers(("bamba",))
    assert gradient_error(model) <= FLOAT32_FLOOR
