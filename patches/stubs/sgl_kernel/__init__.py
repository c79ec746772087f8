"""CPU stand-in for `sgl_kernel` (SGLang server process only): imports succeed, any call fails loudly.

See ../_moe_rl_standin.py for why and how.
"""

import _moe_rl_standin

__version__ = "0.0.0+moe_rl.standin"
_moe_rl_standin.install(globals())
