"""The tree SFT launcher: ``python launch/train.py [FLAGS]``, ``accelerate launch [--config_file X.json] launch/train.py
[FLAGS]``, or, from an installed hf_tree, ``hf-tree train [FLAGS]`` / ``accelerate launch -m hf_tree.launcher [FLAGS]``.

The code lives in ``hf_tree.launcher`` (so a pip-installed hf_tree has it); its docstring and ``--help`` describe the
default job and the flags.
"""

from hf_tree.launcher import cli

if __name__ == "__main__":
    cli()
