"""The built-in synthetic tasks: digit-string prompts with verifiable rewards (``synthetic``) and the small
word-level tokenizer they are written in (``tokenizer``); also the loader of a user's reward function
(``train.reward_fn``). Imports no other moe_rl package.
"""
