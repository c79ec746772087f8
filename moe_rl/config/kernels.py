"""The items of the true-on-policy kernel contract, by name: what each shares between server and learner.

Owns ``KERNELS``, the one list of the contract's items. The schema names them
(``rollout.true_on_policy_kernels``); ``moe_rl.exact.contract`` turns a config into the items it turns on
and tells the server which. Pure data: the config package imports no other moe_rl package.
"""

from __future__ import annotations

__all__ = ["KERNELS"]

KERNELS: dict[str, str] = {
    "linear": "every projection (QKV, attention out, expert and dense MLP weights): row-wise matmul, fp32 sum",
    "lm_head": "the LM head: row-wise matmul with fp32 logits",
    "rmsnorm": "RMSNorm with fp32 statistics; the residual added in the model dtype",
    "attention": "rotate-half RoPE in fp32 and causal attention over exactly the visible keys, one query at a time",
    "activation": "SiLU with every element on torch's vector path",
    "router": "fp32 row-wise router logits; top-k of the logits, softmax over the k (or softmax first; or sigmoid "
    "scores, expert bias, group-limited top-k, normalised and scaled weights: router_route)",
    "experts": "the routing weight scales the activation before w2; outputs summed in ascending expert id in fp32",
    "log_softmax": "the log-prob: log_softmax(logits / t) on the learner (SGLang's deterministic sampler); under "
    "Keep Sampling Mask, on both sides, log_softmax over the kept set (the other ids at -inf, the whole row)",
}
