"""hf_tree inside other training frameworks, each in its own modules, imported only by that framework's own loader:

- ``hf_tree.integrations.axolotl``: the Axolotl plugin (``plugins: [hf_tree.integrations.axolotl.TreePlugin]``: YAML
  keys and refusals), ``axolotl_trainer`` (its collator and trainer class), ``axolotl_example`` (an offline tiny run);
  docs/axolotl.md.
"""
