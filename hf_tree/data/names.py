"""Names of the built-in datasets and the agent template, in a leaf module: ``hf-tree --help`` and other code that only
names them import them from here, not from ``hf_tree.data.sources`` (which pulls in ``datasets`` and the builders)."""

BUILTIN_PREFIX = "builtin:"
BUILTIN_SOURCES = ("champ", "bfcl", "synthetic-agent", "shapes")
BUILTIN_DATASETS = tuple(BUILTIN_PREFIX + name for name in BUILTIN_SOURCES)
# Built-in agent data needs a template that renders tool calls; SmolLM2's own ChatML template drops them.
AGENT_TEMPLATE = "qwen3"
