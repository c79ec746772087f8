"""Build the CPU multi-turn example (``configs/agent_cpu.yaml``): a box-lookup dataset, a tiny Qwen3-MoE HF
directory with its own BPE tokenizer and a tool-capable (Hermes / Qwen3 ``<tool_call>``) chat template, and a
short SFT on tool-call traces.

    python scripts/make_agent_example.py data  [--out examples/agent]        # the jsonl files (committed)
    python scripts/make_agent_example.py model [--out examples/agent/model]  # tokenizer + model + SFT (~4 min)

The task: "What is the code in box 482?"; the code is two digits only the tool ``lookup(box)`` knows
(``moe_rl.tasks.lookup``: a hash of the box number), so without the tool the model can only guess (1 in 100).
``train.jsonl`` (800 boxes) and a disjoint ``test.jsonl`` (200 boxes). The model: a byte-level BPE trained here on
the task's text (digits split one by one, as Qwen's tokenizer does) with Qwen's special tokens plus
``<tool_call>``/``<tool_response>``, a Qwen3-style template (the tools' schemas in a system turn, tool results as
``<tool_response>`` blocks of a user turn), and a random-init 2-layer, 8-expert top-2 Qwen3-MoE trained with
moe_rl's own Megatron-Core learner on two kinds of traces: a **tool trace** (``<tool_call>{"name": "lookup",
"arguments": {"box": "482"}}</tool_call>``, the tool's reply rendered exactly as the built-in tool loop appends
it, ``env_tokens``, then the code) and a **guess** (a random code). The loss covers the model's turns only. With
``--tool-fraction`` of the traces calling the tool, the SFT policy calls it about that often: the start RL improves
on. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moe_rl.config import load_config
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.hf_export import export_hf_checkpoint
from moe_rl.learner.hf_init import write_example_init
from moe_rl.learner.train_step import Learner
from moe_rl.rollout.agents import AgentContext, load_tools
from moe_rl.rollout.tool_loop import env_tokens
from moe_rl.tasks.lookup import box_code
from moe_rl.train.warm_start import _nll_loss

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TOOLS = ["moe_rl.tasks.lookup:lookup"]
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
]
_NEXT_IS_NOT_TOOL = "loop.last or messages[loop.index0 + 1]['role'] != 'tool'"
CHAT_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query."
    "\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n{% endif %}'
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m['content'] }}\n</tool_response>"
    "{% if " + _NEXT_IS_NOT_TOOL + " %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def question(box: str) -> str:
    return f"What is the code in box {box}?"


def tool_call_text(box: str) -> str:
    return "<tool_call>\n" + json.dumps({"name": "lookup", "arguments": {"box": box}}) + "\n</tool_call>"


def write_data(out: Path, n_eval: int = 200, seed: int = 0) -> None:
    boxes = [f"{i:03d}" for i in range(1000)]
    random.Random(seed).shuffle(boxes)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("test.jsonl", boxes[:n_eval]), ("train.jsonl", boxes[n_eval:])):
        with open(out / name, "w") as fh:
            fh.writelines(json.dumps({"prompt": question(b), "label": box_code(b)}) + "\n" for b in part)
    print(f"wrote {len(boxes) - n_eval} train and {n_eval} eval boxes to {out}")


def build_tokenizer(vocab_size: int = 320) -> PreTrainedTokenizerFast:
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    texts = [question(f"{i:03d}") for i in range(1000)] + [tool_call_text(f"{i:03d}") for i in range(1000)]
    texts += ["<|im_start|>system\n", "<|im_start|>user\n", "<|im_start|>assistant\n"] * 1000 + [CHAT_TEMPLATE]
    core.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def traces(tok, boxes: list[str], tool_fraction: float, seed: int) -> list[tuple[list[int], list[int]]]:
    """(token ids, loss mask) of one SFT trace per box: a tool trace (``tool_fraction`` of them) or a guess.
    The SFT draws them afresh for every batch: a box's trace fixed once is memorised over the epochs (which boxes
    call the tool), and RL's gain on the training boxes then does not carry to the held-out ones."""
    context = AgentContext(tokenizer=tok, tools=load_tools(TOOLS))
    rng, eos, out = random.Random(seed), tok.eos_token_id, []
    for box in boxes:
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": question(box)}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        parts = [(list(prompt), 0)]
        if rng.random() < tool_fraction:
            code = box_code(box)
            call = tok.encode(tool_call_text(box), add_special_tokens=False) + [eos]
            reply = [{"role": "tool", "name": "lookup", "content": code}]
            parts += [(call, 1), (env_tokens(context, reply, ended_with_eos=True), 0)]
        else:
            code = f"{rng.randrange(100):02d}"
        parts.append((tok.encode(code, add_special_tokens=False) + [eos], 1))
        out.append(([t for ids, _ in parts for t in ids], [m for ids, m in parts for _ in ids]))
    return out


def sft_batch(seqs, pad_id: int, device: torch.device) -> dict[str, torch.Tensor]:
    """Teacher forcing on (ids, loss mask) traces, right-padded: the loss on the tokens whose mask is 1."""
    T = max(len(ids) for ids, _ in seqs) - 1
    input_ids = torch.full((len(seqs), T), pad_id, dtype=torch.long, device="cpu")
    targets = torch.full((len(seqs), T), -1, dtype=torch.long, device="cpu")
    mask = torch.zeros((len(seqs), T), dtype=torch.float32, device="cpu")
    for row, (ids, loss) in enumerate(seqs):
        n = len(ids) - 1
        input_ids[row, :n] = torch.tensor(ids[:-1], device="cpu")
        targets[row, :n] = torch.tensor(ids[1:], device="cpu")
        mask[row, :n] = torch.tensor(loss[1:], dtype=torch.float32, device="cpu")
    return {"input_ids": input_ids.to(device), "targets": targets.to(device), "mask": mask.to(device)}


def write_model(data_dir: Path, out: Path, sft_steps: int, tool_fraction: float, seed: int = 0) -> None:
    with open(data_dir / "train.jsonl") as rows:
        boxes = [json.loads(line)["prompt"].rsplit(" ", 1)[1].rstrip("?") for line in rows]
    tok = build_tokenizer()
    init = write_example_init(out, tok, seed=seed)

    if sft_steps == 0:  # the untrained directory (the tests validate configs/agent_cpu.yaml against it)
        if out.exists():
            shutil.rmtree(out)
        init.replace(out)
        return
    cfg = load_config(
        None, [f"model.hf_path={init}", "optim.lr=0.003", "optim.clip_grad=1.0", "train.output_dir=/tmp/x"]
    )
    init_distributed(cfg.parallel, environ={})
    learner = Learner(cfg, total_steps=sft_steps)
    device = next(learner.module.parameters()).device
    rng = np.random.default_rng(seed)
    for step in range(sft_steps):
        drawn = [boxes[i] for i in rng.choice(len(boxes), 64, replace=False)]
        batch = traces(tok, drawn, tool_fraction, seed=seed * 100_003 + step)  # tool or guess: drawn per batch
        stats = learner.train_step([sft_batch(batch, tok.pad_token_id, device)], _nll_loss)
        if (step + 1) % 50 == 0 or step + 1 == sft_steps:
            print(
                f"[sft] step {step + 1}/{sft_steps}: nll {stats.metrics['nll']:.3f}, "
                f"mean p(target token) {stats.metrics['p_target']:.3f}",
                flush=True,
            )
    if out.exists():
        shutil.rmtree(out)
    export_hf_checkpoint(learner.module, cfg.model, out, template_dir=init)
    shutil.rmtree(init)
    print(f"wrote the SFT model to {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["data", "model"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--data", type=Path, default=ROOT / "examples/agent", help="model: where train.jsonl is")
    ap.add_argument("--sft-steps", type=int, default=1000)
    ap.add_argument("--tool-fraction", type=float, default=0.5, help="share of SFT traces that call the tool")
    args = ap.parse_args()
    if args.what == "data":
        write_data(args.out or ROOT / "examples/agent")
    else:
        write_model(args.data, args.out or ROOT / "examples/agent/model", args.sft_steps, args.tool_fraction)


if __name__ == "__main__":
    main()
