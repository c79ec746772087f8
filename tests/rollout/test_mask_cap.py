"""Keep Sampling Mask requests on large vocabularies: top-p-only sampling is capped at
rollout.sampling_mask_max_tokens, and untruncated sampling asks for no masks at all."""

from __future__ import annotations

import pytest

from moe_rl.config import load_config
from moe_rl.records import RouteSpec
from moe_rl.rollout.client import RolloutClient, SamplingSettings

SPEC = RouteSpec(num_hidden_layers=2, moe_layer_ids=(0, 1), top_k=2, num_experts=8)


def test_top_p_only_on_a_large_vocabulary_sends_the_cap_as_top_k():
    client = RolloutClient(
        ["http://h:1"], SPEC, 151936, SamplingSettings(top_p=0.9, top_k=-1), sampling_mask_max_tokens=4096
    )
    params = client.request_body([5], seed=None)["sampling_params"]
    assert (params["top_p"], params["top_k"]) == (0.9, 4096)


def test_untruncated_sampling_on_a_large_vocabulary_is_refused_when_masks_are_forced():
    with pytest.raises(ValueError) as info:
        RolloutClient(["http://h:1"], SPEC, 151936, SamplingSettings(top_p=1.0, top_k=-1))
    assert str(info.value) == (
        "sampling masks with rollout.top_k=-1 and rollout.top_p=1 (untruncated) need "
        "rollout.sampling_mask_max_tokens >= vocab size (151936), got 4096; request no masks"
    )


@pytest.mark.parametrize(("top_p", "masks"), [(1.0, False), (0.95, True)])
def test_from_config_asks_for_masks_only_when_sampling_truncates(top_p, masks):
    cfg = load_config(
        overrides=[
            "replay.keep_sampling_mask=true",
            f"rollout.top_p={top_p}",
            "rollout.top_k=-1",
            "model.vocab_size=151936",
        ]
    )
    client = RolloutClient.from_config(cfg, ["http://h:1"])
    body = client.request_body([5], seed=None)
    assert client.return_sampling_mask is masks and body["return_sampling_mask"] is masks
    assert body["sampling_params"]["top_k"] == (4096 if masks else -1)
