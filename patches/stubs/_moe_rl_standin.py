"""Shared body of moe_rl's CPU stand-ins for import-only GPU packages (see sgl_kernel/, torchvision/).

SGLang's CPU engine imports `sgl_kernel` and `torchvision` but never calls them (measured:
shared/notes/sglang-on-cpu.md). The stand-ins are put on the SGLang server process's path only
(moe_rl.rollout.launcher), never on the learner's. Any attribute lookup is reported on stderr and
fails, so a CPU code path that really needs the package is loud instead of silently wrong.
"""

import sys


def make_getattr(package: str):
    def __getattr__(name: str):
        if name.startswith("__"):  # import machinery / introspection probes, not uses
            raise AttributeError(name)
        msg = (
            f"moe_rl stand-in: {package}.{name} was requested, but '{package}' is an empty CPU "
            f"stand-in (patches/stubs/{package}); the real package is GPU-only here"
        )
        print(msg, file=sys.stderr, flush=True)
        raise AttributeError(msg)

    return __getattr__
