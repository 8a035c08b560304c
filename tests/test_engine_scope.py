"""The attention engine scope (a ContextVar, how tree context parallel takes over attention) and its public
suspension (what ``hf_tree.models.check``'s probe uses inside a context parallel block)."""

from __future__ import annotations

import contextvars
import threading

import pytest
import torch

from hf_tree import Tree, TreeDataCollator, tree_causal_lm_loss
from hf_tree.attention import attention_engine_scope, reference_tree_attention, scoped_attention_engine
from hf_tree.models.check import check_model_for_trees
from hf_tree.parallel import plan_context_parallel, tree_context_parallel
from hf_tree.parallel.context import active_context_parallel, suspend_context_parallel
from tests.helpers import float64_norms, grads_of, max_grad_relative_error, relative_error, tiny_model


def _batch() -> dict[str, torch.Tensor]:
    trees = [Tree.from_sequences([[1, 2, 3, 4, 5], [1, 2, 6, 7], [1, 8, 9]]), Tree.from_sequences([[3, 4], [3, 5, 6]])]
    return TreeDataCollator(max_packed_tokens=32)([t.to_dict() for t in trees])


class _CountingEngine:
    """The reference engine, counting its calls."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        self.calls += 1
        return reference_tree_attention(*args, **kwargs)


def test_a_scoped_engine_runs_every_tree_attention_call_also_in_checkpoint_recomputation():
    with float64_norms():
        model = tiny_model()
        batch = _batch()
        tree_causal_lm_loss(model, batch).backward()
        expected_loss, expected = tree_causal_lm_loss(model, batch).detach(), grads_of(model)
        model.zero_grad()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        engine = _CountingEngine()
        with attention_engine_scope(engine):
            loss = tree_causal_lm_loss(model, batch)
            forward_calls = engine.calls
            loss.backward()
    layers = model.config.num_hidden_layers
    assert forward_calls == layers and engine.calls == 2 * layers  # backward recomputes each layer once
    assert relative_error(loss, expected_loss) <= 1e-10
    assert max_grad_relative_error(grads_of(model), expected) <= 1e-8
    assert scoped_attention_engine() is None


def test_suspend_context_parallel_runs_the_whole_row_inside_a_context_parallel_block():
    model = tiny_model()
    batch = _batch()
    plan = plan_context_parallel(batch["kv_end"], 1)
    other = TreeDataCollator(max_packed_tokens=8)([Tree.from_sequences([[5, 6, 7], [5, 8]]).to_dict()])
    inputs = {k: other[k] for k in ("input_ids", "position_ids", "kv_end")}  # not the rank's shard
    expected = model(**inputs).logits
    with tree_context_parallel(batch, plan, 0) as context_parallel:
        assert active_context_parallel() is context_parallel
        with pytest.raises(ValueError, match="expects this rank's shard"):
            model(**inputs)
        with suspend_context_parallel():
            assert active_context_parallel() is None
            torch.testing.assert_close(model(**inputs).logits, expected, rtol=0, atol=0)
        assert active_context_parallel() is context_parallel
        check_model_for_trees(tiny_model(seed=1))  # its probe tree runs whole: suspended inside
    assert active_context_parallel() is None


def _in_thread(fn):
    result = []
    thread = threading.Thread(target=lambda: result.append(fn()))
    thread.start()
    thread.join()
    return result[0]


def test_the_scope_is_per_thread_and_reaches_autograd_worker_threads():
    """A thread of its own sees no scope; autograd's device threads (which run checkpoint recomputation on
    CUDA) see the scope of the thread that called ``backward()`` through the context torch stashes for them."""
    engine = _CountingEngine()

    def as_autograd_worker(context: contextvars.Context):
        torch._C._stash_obj_in_tls("context", context)  # what torch.autograd does before running backward
        try:
            return scoped_attention_engine()
        finally:
            torch._C._remove_obj_from_tls("context")

    with attention_engine_scope(engine):
        assert scoped_attention_engine() is engine
        assert _in_thread(scoped_attention_engine) is None
        launched = contextvars.copy_context()
        with attention_engine_scope(None):
            suspended = contextvars.copy_context()
    assert _in_thread(lambda: as_autograd_worker(launched)) is engine
    assert _in_thread(lambda: as_autograd_worker(suspended)) is None
