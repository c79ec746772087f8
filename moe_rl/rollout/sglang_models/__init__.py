"""The model families moe_rl serves, as a package for SGLang's ``SGLANG_EXTERNAL_MODEL_PACKAGE``.

A CPU server started by the launcher names this package: SGLang then registers these classes and defers
importing its other ~150 model modules until an architecture not listed here is asked for (its registry falls
back to the full import), which saves ~3.5 s of every CPU server's start. The classes are SGLang's own.
"""
