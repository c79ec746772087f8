"""A small word-level tokenizer for the synthetic tasks, built locally (nothing from a hub).

Owns the task vocabulary: special tokens, digits, operators and task words, then
filler tokens up to the model's vocab size. Text is whitespace-separated tokens.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<pad>", "<bos>", "<eos>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = range(4)
TASK_WORDS = [str(d) for d in range(10)] + ["+", "-", "*", "=", ":", ",", ">", "copy", "reverse", "sort", "add", "max"]


def task_vocab(vocab_size: int) -> dict[str, int]:
    """Token -> id for a vocabulary of exactly ``vocab_size`` entries."""
    words = SPECIAL_TOKENS + TASK_WORDS
    if vocab_size < len(words):
        raise ValueError(f"model.vocab_size={vocab_size} is too small for the task vocabulary ({len(words)} tokens)")
    words += [f"<extra_{i}>" for i in range(vocab_size - len(words))]
    return {w: i for i, w in enumerate(words)}


def build_task_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """A fast WordLevel tokenizer over ``task_vocab(vocab_size)`` with whitespace splitting."""

    core = Tokenizer(models.WordLevel(vocab=task_vocab(vocab_size), unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins tokens with single spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )
