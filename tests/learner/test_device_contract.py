"""Device contract: what the library builds and hands to Megatron sits on the parameters' device.

Two checks that can fail on a CPU-only machine too:
- a lint over ``moe_rl/learner``, ``moe_rl/replay``, ``moe_rl/source`` and ``moe_rl/train``: every tensor factory
  names its ``device=`` (host-side bookkeeping names ``"cpu"`` explicitly; host builds that are moved right after
  are listed in ``ALLOWED`` with why), so a device-less ``torch.zeros`` cannot creep in;
- a run of the entry points (``response_logprobs``, ``RoutingReplay``, ``keep_mask_logprobs``,
  ``Learner.train_step``) under a torch function mode that records every tensor factory called from
  library code without a device, while forward pre-hooks on every Megatron submodule check that each
  tensor argument is on that module's parameter device (the check that matters on a GPU).
Inputs are built on the host on purpose: the contract is that callers never move tensors.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode

from moe_rl.learner.device import model_device, to_device
from moe_rl.learner.logprobs import response_logprobs
from moe_rl.learner.model import build_model, forward_logits
from moe_rl.learner.train_step import Learner
from moe_rl.replay import layout
from moe_rl.replay.binding import RoutingReplay
from moe_rl.replay.keep_mask import KeptSets, keep_mask_logprobs
from moe_rl.replay.layout import pack_microbatch_routes
from tests.learner.conftest import make_cfg

ROOT = Path(__file__).resolve().parents[2]
LINTED = ("moe_rl/learner", "moe_rl/replay", "moe_rl/source", "moe_rl/train")
FACTORIES = {
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "tensor",
    "as_tensor",
    "rand",
    "randn",
    "randint",
    "randperm",
    "linspace",
    "logspace",
    "eye",
}
# (file, enclosing function) -> why a device-less factory there is correct.
ALLOWED = {
    # moe_rl/train builds each microbatch on the host from the records, then moves it once (``device=``)
    ("moe_rl/train/batching.py", "build_microbatch"): "host build from numpy records; every field .to(device)",
    ("moe_rl/train/batching.py", "response_rows"): "host rows from numpy records; callers .to(dev)",
    ("moe_rl/train/batching.py", "response_row_mask"): "host mask from numpy lengths; callers .to(dev)",
    ("moe_rl/train/loop.py", "step"): "per-sample rewards -> advantages on the host; StepInputs moves slices",
    ("moe_rl/replay/layout.py", "pack_microbatch_routes"): "records are packed on the host; RoutingReplay moves "
    "each microbatch to the routers' device once",
    ("moe_rl/learner/train_step.py", "_clip_and_step"): "host scalar from a python float, never given to Megatron",
    ("moe_rl/learner/exact_spec.py", "__init__"): "ExactRMSNorm's weight Parameter, made where torch.nn.RMSNorm makes "
    "its own; build_model moves the model (linted since it left exact/)",
}
KNOWN_BUGS: dict = {}  # lead-owned files with a known device bug and its fix: none left (docs/gpu.md)


def _device_less_factories(path: Path, root: Path = ROOT) -> list[tuple[str, str, int, str]]:
    """``(file, function, line, factory)`` of each ``torch.<factory>(...)`` call without ``device=``
    and each ``torch.from_numpy(...)`` not directly followed by ``.to(...)``."""
    rel = path.relative_to(root).as_posix()
    tree = ast.parse(path.read_text())
    found = []
    moved = {
        id(n.func.value)
        for n in ast.walk(tree)  # X in X.to(...)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "to"
    }

    def visit(node, func_name):
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func_name
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and isinstance(child.func.value, ast.Name)
                and child.func.value.id == "torch"
            ):
                attr = child.func.attr
                if (attr in FACTORIES and not any(kw.arg == "device" for kw in child.keywords)) or (
                    attr == "from_numpy" and id(child) not in moved
                ):
                    found.append((rel, func_name, child.lineno, attr))
            visit(child, name)

    visit(tree, "<module>")
    return found


def _lint(root: Path = ROOT) -> list[tuple[str, str, int, str]]:
    out = []
    for folder in LINTED:
        for path in sorted((root / folder).glob("*.py")):
            out += _device_less_factories(path, root)
    return out


def test_lint_no_device_less_tensor_factories_in_learner_replay_and_train():
    bad = [hit for hit in _lint() if hit[:2] not in ALLOWED and hit[:2] not in KNOWN_BUGS]
    assert not bad, "tensor factories without device= (pass the model's / input's device, or 'cpu'):\n" + "\n".join(
        f"  {f}:{line} in {fn}(): torch.{name}(...)" for f, fn, line, name in bad
    )


def test_lint_catches_a_device_less_factory(tmp_path):
    """The lint itself can fail: planted ``torch.zeros(n)`` / bare ``torch.from_numpy`` are reported,
    ``device=`` and ``.to(...)`` silence them."""
    (tmp_path / "moe_rl" / "replay").mkdir(parents=True)
    (tmp_path / "moe_rl" / "replay" / "planted.py").write_text(
        "import torch\n\ndef f(n, d, a):\n    z = torch.zeros(n)\n    o = torch.ones(n, device=d)\n"
        "    return torch.from_numpy(a), torch.from_numpy(a).to(d)\n"
    )
    hits = _lint(tmp_path)
    assert [(fn, line, name) for _, fn, line, name in hits] == [("f", 4, "zeros"), ("f", 6, "from_numpy")]


def test_lint_known_device_bugs_list_is_empty():
    assert not KNOWN_BUGS, "every listed device bug is fixed; keep it that way"


class _FactoryWatch(TorchFunctionMode):
    """Records tensor factories called directly from the ``LINTED`` packages without a device."""

    def __init__(self):
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in FACTORIES and "device" not in kwargs:
            caller = sys._getframe(1).f_code
            rel = Path(caller.co_filename).resolve()
            if any(str(rel).startswith(str(ROOT / d)) for d in LINTED):
                key = (rel.relative_to(ROOT).as_posix(), caller.co_name)
                if key not in ALLOWED:
                    self.calls.append(f"{key[0]}:{caller.co_name}() torch.{name}")
        return func(*args, **kwargs)


class _BoundaryCheck:
    """Forward pre-hooks on every submodule: each tensor argument must be on the module's parameter device."""

    def __init__(self, model):
        self.errors: list[str] = []
        self.checked = 0
        self.hooks = []
        for name, module in model.named_modules():
            params = list(module.parameters(recurse=False))
            if params:
                self.hooks.append(
                    module.register_forward_pre_hook(self._hook(name, params[0].device), with_kwargs=True)
                )

    def _hook(self, name, device):
        def hook(module, args, kwargs):
            for i, t in enumerate(list(args) + list(kwargs.values())):
                if torch.is_tensor(t):
                    self.checked += 1
                    if t.device != device:
                        self.errors.append(f"{name or 'model'} got a tensor on {t.device}, params on {device}")

        return hook

    def remove(self):
        for h in self.hooks:
            h.remove()


def _host_batch(vocab, b=2, t=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, t + 1), generator=g)
    return {"input_ids": tokens[:, :-1], "targets": tokens[:, 1:], "mask": torch.ones(b, t, dtype=torch.bool)}


def test_entry_points_build_on_the_parameters_device(megatron_world, device):
    cfg = make_cfg()
    model = build_model(cfg, seed=3)
    param_device = next(model.parameters()).device
    assert param_device.type == device.type, f"model built on {param_device}, session device is {device}"
    mb = _host_batch(cfg.model.vocab_size)
    boundary, watch = _BoundaryCheck(model), _FactoryWatch()
    replay = RoutingReplay(model)
    sample = np.tile(np.array([0, 1], dtype=np.uint8), (6, 2, 1))  # [rows, L_moe, K] as records hold it
    routes = pack_microbatch_routes([sample, sample], seq_len=8, num_experts=8)
    try:
        with watch:
            logp, _ = response_logprobs(model, mb["input_ids"], mb["targets"])
            with replay.replay([routes]) as cap:
                forward_logits(model, mb["input_ids"]).float().pow(2).mean().backward()
            with replay.record() as rec, torch.no_grad():
                logits = forward_logits(model, mb["input_ids"], segment_ids=torch.zeros(2, 8, dtype=torch.long))
            kept = KeptSets.from_lists([[0, 1, 2]] * 16)  # host-built kept sets
            km = keep_mask_logprobs(logits.reshape(16, -1), mb["targets"].reshape(16), kept)
    finally:
        boundary.remove()
        replay.close()
    assert not watch.calls, "device-less tensor factories in library code:\n" + "\n".join(watch.calls)
    assert boundary.checked > 20 and not boundary.errors, boundary.errors[:5]
    for t in (logp, cap.applied(0), rec.recorded(0), km.logp, km.outside_mask):
        assert t.device == param_device


def test_factory_watch_can_fail(megatron_world):
    """A planted device-less factory in library code is caught by the runtime watch."""

    original = layout.to_megatron_layout
    code = compile(
        "def to_megatron_layout(routes):\n    torch.zeros(1)\n    return _orig(routes)\n",
        str(ROOT / "moe_rl/replay/layout.py"),
        "exec",
    )
    ns = {"torch": torch, "_orig": original}
    exec(code, ns)  # noqa: S102 - a function whose frames claim layout.py as their file
    watch = _FactoryWatch()
    with watch:
        ns["to_megatron_layout"](torch.zeros(1, 2, 1, 1, dtype=torch.long, device="cpu"))
    assert watch.calls == ["moe_rl/replay/layout.py:to_megatron_layout() torch.zeros"]


def test_learner_takes_host_microbatches(megatron_world, device):
    cfg = make_cfg()
    learner = Learner(cfg, total_steps=1)

    def loss(logp, entropy, mb):  # reads a microbatch field the way compute_policy_loss does
        mask = mb["mask"].float()
        return -(logp * mask).sum() / mask.sum(), {}

    watch = _FactoryWatch()
    with watch:
        stats = learner.train_step([_host_batch(cfg.model.vocab_size)], loss)
    assert not watch.calls, watch.calls
    assert stats.grad_norm > 0


def test_to_device_moves_every_tensor_in_a_microbatch_and_leaves_the_rest(device):
    mb = {
        "input_ids": torch.zeros(2, 3, dtype=torch.long, device="cpu"),
        "sample_ids": [4, 5],
        "nested": ({"w": torch.ones(1, device="cpu")}, "tag"),
        "none": None,
        "arr": np.zeros(2),
    }
    out = to_device(mb, device)
    assert out["input_ids"].device.type == device.type and out["nested"][0]["w"].device.type == device.type
    assert out["sample_ids"] == [4, 5] and out["nested"][1] == "tag" and out["none"] is None
    assert out["arr"] is mb["arr"]
    with pytest.raises(ValueError, match="has no parameters"):
        model_device(torch.nn.ReLU())
