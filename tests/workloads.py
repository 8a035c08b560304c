"""Shared data and tree workloads of the tests (no test module imports another: issue 17).

Branch sets (``sequences, masks`` forming one tree), rows of several trees, groups of branches for the trainer
comparisons, TRL-shaped GRPO batches and a conversational dataset. Every generator is seeded: each call returns the
same data. Token ids of the tiny-model workloads lie below ``VOCAB`` (the tiny models' vocabulary, tests/helpers.py).
"""

from __future__ import annotations

import random

import datasets
import torch

from hf_tree import Tree, TreeDataCollator
from hf_tree.collator import STATS_KEYS
from tests.helpers import VOCAB

BRANCHES_PER_TREE = 3
NUM_TREES = 12


# ----------------------------------------------------------------------------------------------- branch sets
def random_tree_branches(rng: random.Random, num_branches: int, max_len: int = 24, vocab: int = 5):
    """Branches over a tiny vocabulary so that they share prefixes, with duplicates and prefix branches."""
    sequences, masks = [], []
    for _ in range(num_branches):
        if sequences and rng.random() < 0.5:  # extend/cut a previous branch: deep sharing
            base = rng.choice(sequences)
            seq = base[: rng.randint(1, len(base))] + [rng.randrange(vocab) for _ in range(rng.randint(0, 6))]
        else:
            seq = [rng.randrange(vocab) for _ in range(rng.randint(1, max_len))]
        sequences.append(seq)
        masks.append([rng.choice((0, 1, 1)) for _ in seq])
    masks[0] = [0] + [1] * (len(sequences[0]) - 1)
    if len(sequences[0]) == 1:
        sequences[0], masks[0] = sequences[0] + [1], [0, 1]
    return sequences, masks


def deep_tree_branches(depth: int = 12):
    """Each branch extends the previous by one token and forks off: depth >= 10 nodes, single-token nodes."""
    sequences, spine = [], [2]
    for level in range(depth):
        spine = spine + [10 + level]
        sequences.append(spine + [50 + level])
    return sequences, None


# ----------------------------------------------------------------------------------------------- tree rows
def grpo_row() -> list[tuple[list[list[int]], list[list[int]]]]:
    """One prompt, six completions of different lengths (odd row length), completions trained."""
    rng = random.Random(11)
    prompt = [rng.randrange(1, VOCAB) for _ in range(17)]
    sequences, masks = [], []
    for length in (3, 9, 4, 7, 5, 8):
        completion = [rng.randrange(1, VOCAB) for _ in range(length)]
        sequences.append(prompt + completion)
        masks.append([0] * len(prompt) + [1] * length)
    return [(sequences, masks)]


def agent_row() -> list[tuple[list[list[int]], list[list[int]]]]:
    """One sample per turn; later turns keep the answers but not the reasoning, so the turns form a trunk
    (the stripped history) with a trained reasoning+answer fork per turn."""
    rng = random.Random(12)
    history = [rng.randrange(1, VOCAB) for _ in range(9)]
    sequences, masks = [], []
    for _ in range(5):
        reasoning = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 7))]
        answer = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 5))]
        sequences.append(history + reasoning + answer)
        masks.append([0] * len(history) + [1] * (len(reasoning) + len(answer)))
        history = history + answer + [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
    return [(sequences, masks)]


def deep_forest_rows() -> list[tuple[list[list[int]], list[list[int]] | None]]:
    """A random deep tree, the 12-level fork chain and another random tree: two rows with padding."""
    rng = random.Random(13)
    return [random_tree_branches(rng, 8), deep_tree_branches(), random_tree_branches(rng, 5)]


def make_batch(rows_fn, max_packed_tokens: int) -> dict[str, torch.Tensor]:
    """The collator's batch (rows padded to a multiple of 5 when there are several) without the stats keys; the trees
    are packed as given (not merged in the batch), so the rows keep the layouts the tests cut."""
    trees = rows_fn()
    pad = 5 if len(trees) > 1 else None
    collator = TreeDataCollator(max_packed_tokens=max_packed_tokens, pad_to_multiple_of=pad, merge_in_batch=False)
    batch = collator([Tree.from_sequences(s, m).to_dict() for s, m in trees])
    for key in STATS_KEYS:
        batch.pop(key)
    return batch


# ------------------------------------------------------------------------------------ trainer comparisons
def branch_groups(seed: int = 0, num_trees: int = NUM_TREES) -> list[tuple[list[list[int]], list[list[int]]]]:
    """Groups of 3 branches sharing a prompt: distinct answers, a duplicate or a prefix branch, masked prompts."""
    rng = random.Random(seed)
    groups = []
    for _ in range(num_trees):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(3, 12))]
        answers = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 9))] for _ in range(2)]
        answers.append(rng.choice([answers[0], answers[0][:1], [rng.randrange(3, VOCAB)]]))
        sequences = [prompt + a for a in answers]
        masks = [[0] * len(prompt) + [1] * len(a) for a in answers]
        if rng.random() < 0.3:  # a fully trained branch: its prompt tokens are trained too
            masks[1] = [0] + [1] * (len(sequences[1]) - 1)
        groups.append((sequences, masks))
    return groups


def tree_dataset(groups) -> datasets.Dataset:
    """One tree per group (``Tree.to_dict`` rows): what ``TreeTrainer`` trains on."""
    return datasets.Dataset.from_list([Tree.from_sequences(s, m).to_dict() for s, m in groups])


def branch_dataset(groups) -> datasets.Dataset:
    """One row of ``sequences``/``masks`` per group: the unrolled branches ``collate_branches`` pads."""
    return datasets.Dataset.from_list([{"sequences": s, "masks": m} for s, m in groups])


# --------------------------------------------------------------------------------------------- GRPO batches
def padded_batch(prompts: list[list[int]], completions: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """TRL's GRPO layout: ``[B, P + C]`` ids and mask, prompts left-padded, completions right-padded."""
    width_p, width_c = max(map(len, prompts)), max(map(len, completions))
    ids = torch.zeros(len(prompts), width_p + width_c, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, c) in enumerate(zip(prompts, completions)):
        ids[row, width_p - len(p) : width_p], mask[row, width_p - len(p) : width_p] = torch.tensor(p), 1
        ids[row, width_p : width_p + len(c)], mask[row, width_p : width_p + len(c)] = torch.tensor(c), 1
    return ids, mask, width_c


def scenario(name: str) -> tuple[list[list[int]], list[list[int]]]:
    """Rows (prompt, completion) of one micro-batch; completions of unequal length everywhere."""
    rng = random.Random(name)
    tokens = lambda n: [rng.randrange(3, VOCAB) for _ in range(n)]  # noqa: E731
    if name == "full_group":  # one prompt, 4 completions: a duplicate and one the prefix of another
        first = tokens(6)
        prompt, completions = tokens(9), [first, tokens(3), first, first[:2]]
        return [prompt] * 4, completions
    if name == "partial_groups":  # rows of two groups interleaved (as after TRL's shuffle), one group partial
        a, b = tokens(7), tokens(4)
        return [a, b, a, b, a], [tokens(5), tokens(2), tokens(8), tokens(1), tokens(3)]
    if name == "several_prompts":  # three prompts of different lengths sharing a first token, two rows each
        prompts = [[5, *tokens(n)] for n in (2, 10, 6)]
        return [p for p in prompts for _ in range(2)], [tokens(rng.randint(1, 8)) for _ in range(6)]
    raise ValueError(name)


# ------------------------------------------------------------------------------------------ conversations
def prompt_completion_dataset() -> datasets.Dataset:
    """Conversational prompt/completion rows; rows 0-1 and 2-3 share a prompt (a GRPO-like group)."""
    rows = []
    for question, answers in [
        ("What is the capital of France?", ["Paris.", "It is Paris, on the Seine."]),
        ("Name a prime number above 10.", ["11 is prime.", "13."]),
    ]:
        for answer in answers:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": question}],
                    "completion": [{"role": "assistant", "content": answer}],
                }
            )
    return datasets.Dataset.from_list(rows)


# --------------------------------------------------------------------- attention engine inputs
HEAD_DIM = 8


def packed_rows(seed: int, num_trees: int = 8, max_packed_tokens: int = 96, pad_to_multiple_of: int = 32):
    """``kv_end``/``position_ids`` ``[B, N]`` of random forests packed by the real collator."""
    rng = random.Random(seed)
    trees = [Tree.from_sequences(*random_tree_branches(rng, rng.randint(1, 6))) for _ in range(num_trees)]
    collator = TreeDataCollator(max_packed_tokens=max_packed_tokens, pad_to_multiple_of=pad_to_multiple_of)
    batch = collator([t.to_dict() for t in trees])
    return batch["kv_end"], batch["position_ids"]


def qkv(
    kv_end: torch.Tensor,
    heads: tuple[int, int],
    dtype: torch.dtype,
    seed: int = 0,
    device: str = "cpu",
    head_dim: int = HEAD_DIM,
):
    """Leaf query/key/value in transformers' layout (``[B, N, H, D]`` projections viewed as ``[B, H, N, D]``)."""
    generator = torch.Generator().manual_seed(seed)
    batch, n = kv_end.shape

    def leaf(h: int) -> torch.Tensor:
        x = torch.randn(batch, n, h, head_dim, generator=generator, dtype=torch.float64)
        return x.to(device=device, dtype=dtype).transpose(1, 2).requires_grad_()

    return leaf(heads[0]), leaf(heads[1]), leaf(heads[1])


def long_segment_trees(seed: int = 0) -> list[Tree]:
    """Trees of long segments: a GRPO group (prompt, answers sharing a first sentence), an agent-like chain whose
    later turns fork off after earlier siblings' subtrees (ancestors that are not one contiguous range), a short
    prompt with long answers; one-token leaves among them."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000) for _ in range(n)]

    prompt, opening = tokens(200), tokens(60)
    group = [prompt + tokens(150), prompt + opening + tokens(120), prompt + opening + tokens(90), prompt + tokens(1)]
    turns = [tokens(100)]
    for _ in range(3):
        turns.append(turns[-1] + tokens(rng.randint(60, 120)))
    agent = [t + tokens(60) for t in turns] + turns[-1:]
    short = tokens(30)  # low dedup: a short prompt, long answers
    answers = [short + tokens(200), short + tokens(180), short + tokens(150)]
    return [Tree.from_sequences(group), Tree.from_sequences(agent), Tree.from_sequences(answers)]


def long_segment_rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv_end``/``position_ids`` of ``long_segment_trees`` packed by the real collator, with padding."""
    trees = long_segment_trees(seed)
    batch = TreeDataCollator(max_packed_tokens=1024, pad_to_multiple_of=128)([t.to_dict() for t in trees])
    return batch["kv_end"], batch["position_ids"]


# Word-tokenizer rows (tests.helpers.word_tokenizer) for the preference trainers, in-process and launched. Two pairs
# share a prompt, one chosen/rejected pair starts alike; prompts and responses of unequal lengths.
PREFERENCE_PAIRS = {
    "prompt": ["w10 w11 w12 w13", "w14 w15", "w10 w11 w12 w13", "w16 w17 w18"],
    "chosen": [" w20 w21", " w22", " w23 w24 w25", " w26 w27"],
    "rejected": [" w20 w28 w29 w30", " w31 w32", " w33", " w26"],
}
REWARD_PAIRS = {**PREFERENCE_PAIRS, "margin": [0.5, 0.0, 1.0, -0.25]}
# KTO: each prompt's rows listed together (the order KTO's sequential sampling keeps), desirable and undesirable ones.
KTO_ROWS = {
    "prompt": ["w10 w11 w12 w13", "w10 w11 w12 w13", "w14 w15", "w14 w15", "w16 w17 w18", "w16 w17 w18"],
    "completion": [" w20 w21", " w22", " w23 w24 w25", " w26", " w27 w28", " w27"],
    "label": [True, False, True, False, False, True],
}


# Tiny DeepSeek V3 (multi-head latent attention: query/key heads of 8 nope + 8 rope = 16, value heads of 4; every KV
# head is a query head's own) with 4 routed experts, top-2, one dense layer first.
TINY_DEEPSEEK_V3 = dict(
    num_key_value_heads=4,
    q_lora_rank=16,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
)

# Tiny Llama 4 text: layer 0 chunked (chunks of 4 depths, RoPE), layer 1 full attention (NoPE), 2 eager experts.
TINY_LLAMA4 = dict(
    head_dim=8,
    attention_chunk_size=4,
    num_local_experts=2,
    intermediate_size_mlp=48,
    no_rope_layers=[1, 0],
    experts_implementation="eager",
)


def forest(seed: int, num_trees: int = 4, max_packed_tokens: int = 64, pad_to_multiple_of: int = 16):
    """(groups of (sequences, masks), collated batch): several trees per row, several rows, padding."""
    rng = random.Random(seed)
    groups = [random_tree_branches(rng, rng.randint(2, 5)) for _ in range(num_trees)]
    collator = TreeDataCollator(max_packed_tokens=max_packed_tokens, pad_to_multiple_of=pad_to_multiple_of)
    batch = collator([Tree.from_sequences(s, m).to_dict() for s, m in groups])
    return groups, batch


# ------------------------------------------------------------------------------------- tree mixer workloads
# A forest row with padding: a fork at position 1 (closer to the root than any conv width), a fork inside the
# "prompt" and nested forks (node depth 4), a prefix branch, a duplicate branch, an untrained branch, and a second
# tree with a single-token-longer sibling pair.
FOREST_SEQUENCES = [
    [5, 6, 7, 8, 9, 10, 11, 12],
    [5, 6, 7, 8, 20, 21, 22],
    [5, 6, 7, 8, 20, 21, 30, 31, 32],
    [5, 6, 7, 8, 20, 21, 30, 31, 40, 41, 42, 43],
    [5, 6, 7, 8, 20, 21],  # prefix of the two above
    [5, 6, 7, 8, 20, 21, 22],  # duplicate
    [5, 50, 51, 52],  # fork at position 1
    [5, 50, 60],
]
FOREST_MASKS = [[0] + [1] * (len(s) - 1) for s in FOREST_SEQUENCES]
FOREST_MASKS[7] = [0] * len(FOREST_SEQUENCES[7])  # untrained branch: its tokens still feed the shared states
FOREST_SECOND_TREE = [[70, 71, 72, 73, 74], [70, 71, 72, 80], [70, 90, 91]]


def packed_batch(max_packed_tokens: int = 64) -> tuple[dict[str, torch.Tensor], list[tuple[list, list]]]:
    """The collator's batch of that forest (one row of 64 with padding, or several rows) and its ``(sequences,
    masks)`` groups (tests/test_hybrid_mixers.py, tests/test_mamba1_mixers.py)."""
    groups = [(FOREST_SEQUENCES, FOREST_MASKS), (FOREST_SECOND_TREE, None)]
    collator = TreeDataCollator(max_packed_tokens=max_packed_tokens, pad_to_multiple_of=8)
    batch = collator([Tree.from_sequences(s, m).to_dict() for s, m in groups])
    return batch, groups
