"""Megatron's per-router replay hook, subclassed: one MoE layer's record / replay state.

Owns ``LayerReplay`` (a ``megatron.core.transformer.moe.router_replay.RouterReplay`` that
never enters the class-level instance list) and ``RouteCapture`` (what a context saw). The
stage switch and model binding live in ``moe_rl.replay.binding``.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from moe_rl.replay.layout import from_megatron_layout

__all__ = ["ReplayError", "RouteCapture", "in_backward"]


class ReplayError(RuntimeError):
    """Routes were not applied exactly as given (unconsumed, over-consumed, wrong shape)."""


@dataclass
class PassState:
    """Shared by the layers of one model: whether the current model forward will see a backward."""

    grad_at_entry: bool = False
    training: bool = False
    observe_natural: bool = True


def in_backward() -> bool:
    """Whether autograd is running a backward pass (where activation recompute re-runs a forward)."""
    # The autograd engine sets a graph task id while it runs backward; Megatron's activation
    # recompute re-runs the layer forward inside it, which is when REPLAY_BACKWARD applies.
    return torch._C._current_graph_task_id() != -1


class LayerReplay(RouterReplay):
    """Replay state of one MoE router, owned by a ``RoutingReplay`` (not in the global list).

    Forward calls consume ``forward_queue`` (one ``[S*B, K]`` int64 entry per microbatch) in
    order; a recomputed layer also pushes each consumed entry on Megatron's backward FIFO
    ``replay_backward_list``, popped when the recompute runs inside backward.
    """

    def __init__(self, pass_state: PassState, moe_index: int, recompute: str | None):
        super().__init__()
        RouterReplay.global_router_replay_instances.remove(self)
        self.pass_state = pass_state
        self.moe_index = moe_index
        self.recompute = recompute  # None | "full" (training only) | "selective" (always)
        self.forward_queue: deque[torch.Tensor] = deque()
        self.given = 0
        self.recorded: list[torch.Tensor] = []  # RECORD: natural top-k per forward
        self.natural: list[torch.Tensor] = []  # REPLAY: natural top-k the layer would have chosen
        self.applied: list[torch.Tensor] = []  # REPLAY: indices actually used
        self.shapes: list[tuple[int, int]] = []  # (S_local, B) of each forward, from the pre-hook
        self.pending_shape: tuple[int, int] | None = None
        self.released = False  # set by RoutingReplay.close(); a new binding may then adopt the router

    def reset(self) -> None:
        self.clear_indices()
        self.clear_router_replay_action()
        self.forward_queue.clear()
        self.given = 0
        self.recorded, self.natural, self.applied, self.shapes = [], [], [], []

    def _will_recompute(self) -> bool:
        st = self.pass_state
        if not st.grad_at_entry or self.recompute is None:
            return False
        return self.recompute == "selective" or st.training

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        """Megatron's hook: ``scores[S*B, E]`` -> ``(probs[S*B, K], indices[S*B, K])``."""
        action = self.router_replay_action
        if action is None:
            return default_compute_topk(scores, topk, num_groups, group_topk)
        backward = in_backward()
        if action == RouterReplayAction.RECORD:
            probs, idx = default_compute_topk(scores, topk, num_groups, group_topk)
            if not backward:  # a recompute re-derives the same routes; record each forward once
                self.recorded.append(idx.detach().clone())
                self.shapes.append(self.pending_shape)
            return probs, idx
        if backward or action == RouterReplayAction.REPLAY_BACKWARD:
            if not self.replay_backward_list:
                raise ReplayError(
                    f"MoE layer {self.moe_index}: activation recompute asked for replayed routes but the "
                    "backward FIFO is empty (backward run twice, or outside the replay context?)"
                )
            idx = self.replay_backward_list.pop(0)
        else:
            idx = self._next_forward(scores, topk, num_groups, group_topk, default_compute_topk)
        idx = idx.to(scores.device)
        # gather keeps the router differentiable: gradients reach the replayed experts' scores
        return scores.gather(1, idx), idx

    def _next_forward(self, scores, topk, num_groups, group_topk, default_compute_topk) -> torch.Tensor:
        used = len(self.applied)
        if not self.forward_queue:
            raise ReplayError(
                f"MoE layer {self.moe_index}: forward #{used + 1} needs routes but only {self.given} "
                "microbatch(es) were given to replay()"
            )
        idx = self.forward_queue.popleft()
        if idx.shape != (scores.shape[0], topk):
            raise ReplayError(
                f"MoE layer {self.moe_index}, microbatch {used}: routes have shape {tuple(idx.shape)}, the router "
                f"sees [S*B={scores.shape[0]}, top_k={topk}] (S, B = {self.pending_shape}); check padding / seq_len"
            )
        if self.pass_state.observe_natural:
            with torch.no_grad():
                self.natural.append(default_compute_topk(scores.detach(), topk, num_groups, group_topk)[1])
        self.applied.append(idx)
        self.shapes.append(self.pending_shape)
        self.target_topk_idx = idx
        if self._will_recompute():
            self.replay_backward_list.append(idx)
        return idx


@dataclass
class RouteCapture:
    """What one ``record()`` / ``replay()`` context saw, per forward (microbatch) in call order.

    All getters return ``routes[B, S_local, L_local, K]`` int64 for forward ``i``: local to this
    rank (its pipeline stage's MoE layers, its sequence shard).
    """

    layers: list[LayerReplay] = field(default_factory=list)
    _frozen: dict = field(default_factory=dict)

    def _get(self, kind: str, i: int) -> torch.Tensor:
        per_layer = self._frozen[kind]
        if not 0 <= i < min(len(x) for x in per_layer):
            raise IndexError(f"no {kind} routes for forward #{i}; this context saw {self.num_forwards} forward(s)")
        _S, B = self._frozen["shapes"][i]
        return from_megatron_layout([layer[i] for layer in per_layer], B)

    def _freeze(self) -> None:
        self._frozen = {
            "recorded": [list(layer.recorded) for layer in self.layers],
            "natural": [list(layer.natural) for layer in self.layers],
            "applied": [list(layer.applied) for layer in self.layers],
            "shapes": list(self.layers[0].shapes) if self.layers else [],
        }

    @property
    def num_forwards(self) -> int:
        return len(self._frozen.get("shapes", []))

    def recorded(self, i: int) -> torch.Tensor:
        """Natural routes chosen during ``record()``."""
        return self._get("recorded", i)

    def natural(self, i: int) -> torch.Tensor:
        """Routes the learner would have chosen during ``replay()`` (for flip-rate metrics)."""
        return self._get("natural", i)

    def applied(self, i: int) -> torch.Tensor:
        """Routes actually used during ``replay()``."""
        return self._get("applied", i)
