"""Build the CPU math example: a word-problem dataset, a tiny Qwen3-MoE HF directory with its own BPE
tokenizer and chat template, and a short supervised warm start on the dataset's solutions.

    python scripts/make_math_example.py data  [--out examples/math]      # the jsonl files (committed)
    python scripts/make_math_example.py model [--out examples/math/model] # tokenizer + model + SFT (~1 min)

The dataset: one-step addition / subtraction word problems with numbers 0-9 ("Ann has 7 apples. She
gets 5 more. How many apples does Ann have now?"), the answer in ``label`` and a worked solution
``"7 + 5 = 12. \\boxed{12}"`` in ``solution``; ``train.jsonl`` and a disjoint ``test.jsonl``.
The model: the tokenizer is a byte-level BPE trained here (``tokenizers``) on the dataset's text with
Qwen's special tokens and a Qwen-style chat template; the model is a random-init 2-layer, 8-expert
top-2 Qwen3-MoE whose vocabulary is padded past the tokenizer's; it is then trained for a few
hundred steps on ``chat_template(question) + solution + <|im_end|>`` with moe_rl's own Megatron-Core
learner (loss on the solution tokens) and exported as an HF directory (``model.safetensors``,
``config.json``, tokenizer files, chat template): the "pretrained model" ``configs/math_cpu.yaml``
starts RL from. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moe_rl.config import load_config
from moe_rl.learner.dist import init_distributed
from moe_rl.learner.hf_export import export_hf_checkpoint
from moe_rl.learner.hf_init import write_example_init
from moe_rl.learner.train_step import Learner
from moe_rl.train.warm_start import _nll_loss, teacher_forcing_batch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

NAMES = ["Ann", "Ben", "Cal", "Dee"]
THINGS = ["apples", "pens", "cards", "coins"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def problems() -> list[dict]:
    """Every problem of the family, in a fixed order (each question appears once)."""
    out = []
    for name in NAMES:
        pron = "She" if name in ("Ann", "Dee") else "He"
        for thing in THINGS:
            for a in range(10):
                for b in range(10):
                    q = f"{name} has {a} {thing}. {pron} gets {b} more. How many {thing} does {name} have now?"
                    out.append(
                        {"prompt": q, "label": str(a + b), "solution": f"{a} + {b} = {a + b}. \\boxed{{{a + b}}}"}
                    )
                    if b <= a:
                        q = f"{name} has {a} {thing}. {pron} gives away {b}. How many {thing} does {name} have now?"
                        out.append(
                            {"prompt": q, "label": str(a - b), "solution": f"{a} - {b} = {a - b}. \\boxed{{{a - b}}}"}
                        )
    return out


def write_data(out: Path, n_eval: int = 200, seed: int = 0) -> None:
    rows = problems()
    random.Random(seed).shuffle(rows)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("test.jsonl", rows[:n_eval]), ("train.jsonl", rows[n_eval:])):
        with open(out / name, "w") as fh:
            fh.writelines(json.dumps(row) + "\n" for row in part)
    print(f"wrote {len(rows) - n_eval} train and {n_eval} eval problems to {out}")


def build_tokenizer(texts: list[str], vocab_size: int = 384):
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(texts, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_model(data_dir: Path, out: Path, sft_steps: int, seed: int = 0) -> None:
    with open(data_dir / "train.jsonl") as rows:
        train = [json.loads(line) for line in rows]
    tok = build_tokenizer([r["prompt"] for r in train] + [r["solution"] for r in train] + ["system user assistant"])
    init = write_example_init(out, tok, seed=seed)

    if sft_steps == 0:  # the untrained directory (the tests validate configs/math_cpu.yaml against it)
        init.replace(out)
        return
    cfg = load_config(
        None, [f"model.hf_path={init}", "optim.lr=0.003", "optim.clip_grad=1.0", "train.output_dir=/tmp/x"]
    )
    init_distributed(cfg.parallel, environ={})
    learner = Learner(cfg, total_steps=sft_steps)
    device = next(learner.module.parameters()).device
    seqs = [
        (
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}], add_generation_prompt=True, tokenize=True, return_dict=False
            ),
            tok.encode(r["solution"], add_special_tokens=False) + [tok.eos_token_id],
        )
        for r in train
    ]
    rng = np.random.default_rng(seed)
    for step in range(sft_steps):
        batch = [seqs[i] for i in rng.choice(len(seqs), 64, replace=False)]
        stats = learner.train_step([teacher_forcing_batch(batch, tok.pad_token_id, device)], _nll_loss)
        if (step + 1) % 50 == 0 or step + 1 == sft_steps:
            print(
                f"[sft] step {step + 1}/{sft_steps}: nll {stats.metrics['nll']:.3f}, "
                f"mean p(solution token) {stats.metrics['p_target']:.3f}",
                flush=True,
            )
    export_hf_checkpoint(learner.module, cfg.model, out, template_dir=init)

    shutil.rmtree(init)
    print(f"wrote the SFT model to {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["data", "model"])
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--data", type=Path, default=ROOT / "examples/math", help="model: where train.jsonl is")
    ap.add_argument("--sft-steps", type=int, default=60)
    args = ap.parse_args()
    if args.what == "data":
        write_data(args.out or ROOT / "examples/math")
    else:
        write_model(args.data, args.out or ROOT / "examples/math/model", args.sft_steps)


if __name__ == "__main__":
    main()
