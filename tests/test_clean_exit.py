"""A launched tree training script that ends as users' scripts end (``train()``, ``save_model``, return) exits 0.

The file is also the launched worker (``__main__``): 2 gloo processes under ``accelerate launch`` train ``TreeTrainer``
for one step, save the model and return without destroying their process group. Without hf_tree's exit handler
(``hf_tree.distributed.end_process_group``) such a launch aborted after its work in 4 of 5 tries (SIGABRT, exit -6:
"terminate called without an active exception"); three launches in a row must all exit 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if __name__ == "__main__":  # launched as a script: make `hf_tree` and `tests` importable from the checkout
    sys.path.insert(0, str(REPO))

import pytest  # noqa: E402

from tests.helpers import launch_command  # noqa: E402

LAUNCHES = 3


@pytest.mark.distributed
@pytest.mark.slow
def test_launched_training_script_exits_zero(tmp_path):
    from tests.test_depth_first_distributed import DDP_CONFIG

    config = tmp_path / "ddp.json"
    config.write_text(json.dumps(DDP_CONFIG))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    for launch in range(LAUNCHES):
        output_dir = tmp_path / f"run{launch}"
        command = [*launch_command(config), __file__, str(output_dir)]
        result = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
        assert result.returncode == 0, f"launch {launch}: " + result.stderr[-4000:]
        assert (output_dir / "final" / "model.safetensors").exists()  # the run did its work before exiting


if __name__ == "__main__":
    import torch

    from hf_tree.trainer import TreeTrainer, TreeTrainingArguments
    from tests.helpers import VOCAB, exact_sgd_args, tiny_model
    from tests.workloads import branch_groups, tree_dataset

    output_dir = sys.argv[1]
    args = TreeTrainingArguments(**exact_sgd_args(output_dir, max_steps=1, per_device_train_batch_size=2))
    trainer = TreeTrainer(
        model=tiny_model(vocab_size=VOCAB, dtype=torch.float32),
        args=args,
        train_dataset=tree_dataset(branch_groups(seed=5, num_trees=4)),
    )
    trainer.train()
    trainer.save_model(str(Path(output_dir) / "final"))
