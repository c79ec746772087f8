"""Prompt data: dataset files (``loaders``), chat templates and tokenizers (``chat``), the prompt
datasets (``dataset``) and the resumable prompt stream the training loop draws from (``stream``)."""

from moe_rl.data.loaders import DataError
from moe_rl.data.prompt import PromptItem, PromptStream
from moe_rl.data.stream import build_prompt_stream

__all__ = ["DataError", "PromptItem", "PromptStream", "build_prompt_stream"]
