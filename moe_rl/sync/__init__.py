"""The weight sync: learner weights -> SGLang servers, and the checks that the servers serve what was pushed.

Owns the ``WeightSync`` facade (``weight_sync``), the per-rank senders (``senders``), the ``distributed``
transport's rendezvous group (``group``), the HTTP calls to the servers (``transport``), the checks before a push
(``checks``), the FP8 fake quantisation of pushed weights (``quantize``), the served-weights fingerprint
(``served_weights``) and the weight-version rules every batch passes (``integrity``). The trainer's orchestration
of pushes stays in ``moe_rl.train.weight_push``.
"""
