"""A tiny Hugging Face Qwen3-MoE directory of a user's kind, built locally for the own-data tests.

Its own byte-level BPE tokenizer (trained here with ``tokenizers`` on a few sentences), a
Qwen-style chat template, EOS ``<|im_end|>``, and a model vocabulary padded past the tokenizer's
(as Qwen pads its embeddings). Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from moe_rl.config import ModelConfig
from moe_rl.learner.hf_init import use_tokenizer, write_random_hf_checkpoint

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "What is 2 + 3? The answer is 5.",
    "Compute 7 * 6 and put it in \\boxed{42}.",
    "system user assistant",
    "You are a helpful math tutor. Think step by step.",
    "How many legs does a spider have? Eight, so 8.",
    "the quick brown fox jumps over the lazy dog 0 1 2 3 4 5 6 7 8 9 + - * / = ( ) { } \\frac",
]
MODEL_VOCAB = 384  # > the tokenizer's size: padded embedding rows, as in Qwen


def build_tokenizer(vocab_size: int = 320, chat_template: str | None = CHAT_TEMPLATE):
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    core.train_from_iterator(CORPUS * 4, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def tiny_model_config(**overrides):
    return ModelConfig(
        **{
            "num_layers": 2,
            "hidden_size": 64,
            "num_moe_experts": 8,
            "moe_router_topk": 2,
            "vocab_size": MODEL_VOCAB,
            "seq_length": 128,
        }
        | overrides
    )


def write_tiny_hf_dir(out: Path, chat_template: str | None = CHAT_TEMPLATE, seed: int = 0, **model) -> Path:
    """Weights (random init), config.json, generation_config.json and the BPE tokenizer in ``out``."""

    out = write_random_hf_checkpoint(tiny_model_config(**model), out, seed=seed)
    return use_tokenizer(out, build_tokenizer(chat_template=chat_template))
