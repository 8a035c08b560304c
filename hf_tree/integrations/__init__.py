"""hf_tree inside other training frameworks, each in its own module, imported only by that framework's own loader:

- ``hf_tree.integrations.axolotl``: the Axolotl plugin (``plugins: [hf_tree.integrations.axolotl.TreePlugin]``),
  docs/axolotl.md.
"""
