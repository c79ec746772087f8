"""CPU stand-in for `sgl_kernel`: importable, no attributes; every lookup is logged and fails. See ../_moe_rl_standin.py."""

from _moe_rl_standin import make_getattr as _make_getattr

__getattr__ = _make_getattr("sgl_kernel")
