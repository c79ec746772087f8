"""True-on-policy mode (``rollout.true_on_policy``): one set of row-invariant CPU kernels shared by the
SGLang server and the Megatron-Core learner, so rollout log-probs and router top-k are recomputed bit
for bit. ``contract`` (which of the contract's items, named in ``moe_rl.config.kernels``, a config turns
on), ``kernels`` (the ops), ``sglang_hooks`` (server side, via patch 0013), ``preflight`` (settings that
cannot be exact), ``identity`` (the kernel identity each side reports, compared per batch). The learner side (spec modules + hooks) is ``moe_rl.learner.exact_spec``.
"""
