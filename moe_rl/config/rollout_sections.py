"""Config sections of the rollout side: ``rollout`` (the SGLang servers, sampling, weight sync) and ``replay``.

Owns what the rollout client, the launcher and the weight sync read, the kernel items a true-on-policy
run may name (``ExactKernel``, from ``moe_rl.config.kernels``), and the rule that ties ``replay.routing``
to ``correction.mode`` (``replay_correction_problem``: the schema refuses a violation, the replay driver
asserts it). It must not import torch or Megatron.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from moe_rl.config.kernels import KERNELS
from moe_rl.config.section import Section

__all__ = ["ENV_NAME", "ExactKernel", "ReplayConfig", "RolloutConfig", "replay_correction_problem"]

ExactKernel = Literal[tuple(KERNELS)]  # the items of the true-on-policy kernel contract
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"  # an environment variable name
AGENT_SPEC = r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$"  # module:name (an agent loop class or function, a tool)


class RolloutConfig(Section):
    """SGLang rollout engine: where it is (or how to launch it) and how it samples."""

    addresses: list[str] = Field(
        default_factory=list, description="http://host:port of running servers; empty = launch"
    )
    host: str = "127.0.0.1"
    port: int | None = Field(None, ge=1, le=65535, description="None = pick a free port")
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["bfloat16", "float32"] = "float32"
    weight_quantization: Literal["none", "fp8_e4m3", "fp8_e5m2"] = "none"
    weight_sync: Literal["auto", "tensor", "disk", "distributed"] = Field(
        "auto",
        description="learner -> server weights: tensor = shared-memory tensors over /update_weights_from_tensor "
        "(servers on this host); disk = exported HF dir over /update_weights_from_disk; distributed = a broadcast "
        "from the learner's rank 0 into a process group with the servers (/update_weights_from_distributed); "
        "auto = tensor when every server is on this host, else disk",
    )
    weight_sync_bucket_mb: int = Field(256, ge=1, description="tensor and distributed sync: MiB of weights per request")
    weight_sync_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="distributed sync: the group's backend; auto = nccl for rollout.device cuda, else gloo"
    )
    weight_sync_master_address: str | None = Field(
        None,
        description="distributed sync: the address the servers reach the learner's rank 0 at (SGLang's "
        "master_address); None = loopback when every server is on this host, else this host's address on the route "
        "to the first server",
    )
    weight_sync_stage_addresses: list[str] | None = Field(
        None,
        min_length=1,
        description="distributed sync: the address the servers reach each pipeline stage's source rank at, one per "
        "stage in stage order (stage s's weight-update group rendezvous there; that source rank listens on "
        "weight_sync_master_port + s); instead of weight_sync_master_address, which serves every stage. None = "
        "weight_sync_master_address, or each source's own host (loopback when every server is on it, else its "
        "address on the route to the first server)",
    )
    weight_sync_master_port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="distributed sync: the rendezvous port rank 0 listens on (SGLang's "
        "master_port; must be free and reachable from the servers); None = a free port",
    )
    partial: bool = Field(
        False,
        description="partial rollouts (async mode): a weight update pauses in-flight requests "
        "(rollout.pause_mode) instead of waiting for them, so a response can span weight versions",
    )
    pause_mode: Literal["retract", "abort", "in_place"] = Field(
        "retract",
        description="rollout.partial: retract / abort re-prefill under the new weights (exact per-token "
        "versions); in_place keeps the old-weight prefix KV (approximate, counted as async/kv_stale_tokens)",
    )
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, description="-1 = no top-k")
    max_new_tokens: int = Field(16, ge=1)
    samples_per_prompt: int = Field(4, ge=1)
    deterministic: bool = True
    true_on_policy: bool = Field(
        False,
        description="exact-zero mismatch (miles' --true-on-policy-mode): the SGLang CPU server and the "
        "learner compute every forward with the shared row-invariant kernels of moe_rl.exact, so the learner "
        "recomputes each rollout log-prob and router top-k bit for bit (docs/true_on_policy.md); slow",
    )
    true_on_policy_kernels: list[ExactKernel] | None = Field(
        None,
        description="with true_on_policy: the items of the kernel contract to share (moe_rl.config.kernels; "
        "default all). A subset is not exact: `moe-rl diagnose --attribute` uses it to measure each item alone",
    )
    seed: int = 0
    sampling_mask_max_tokens: int = Field(4096, ge=1)
    request_timeout_s: float | None = Field(
        None,
        gt=0,
        description="bound on one /generate request: past it the client aborts the request on its server "
        "(/abort_request by rid) and continues it from the tokens generated (moe_rl.rollout.http_session); "
        "None = derived from rollout.max_new_tokens (moe_rl.sizing.defaults: 120 s + max_new_tokens at 10 tokens/s)",
    )
    startup_timeout_s: float | None = Field(
        None,
        gt=0,
        description="seconds a server may take to become healthy; None = derived from the bytes each server loads "
        "(moe_rl.sizing.defaults: 180 s + the bf16 HF weights at launch.fs_bandwidth_gb_s)",
    )
    max_concurrency: int | None = Field(
        None,
        ge=1,
        description="requests in flight from the rollout client, all servers and all steps in flight "
        "together (async: a freed slot goes to the oldest step's request); None = derived: "
        "rollout.server_concurrency x the number of servers (moe_rl.sizing.defaults.client_concurrency)",
    )
    server_concurrency: int | None = Field(
        None,
        ge=1,
        description="requests in flight per rollout server (slime's --sglang-server-concurrency) when "
        "rollout.max_concurrency is unset; None = 16 (the old client-wide default: one server sees what it did)",
    )
    sleep_on_idle: bool = Field(
        True,
        description="SGLang's --sleep-on-idle: an idle scheduler waits on its sockets instead of spinning a "
        "core (it took 65-95% of a core from a co-located learner on 2 cores)",
    )
    server_cpus: list[int] = Field(
        default_factory=list,
        description="CPU cores the servers this run launches are pinned to "
        "(sched_setaffinity; e.g. the rollout cores of a node shared with the learner); [] = not pinned",
    )
    process_cpus: list[int] = Field(
        default_factory=list,
        description="train.rollout_mode=async: CPU cores of the rollout process (prompts, "
        "reply decoding, rewards, records); [] = the trainer's cores and rollout.server_cpus together (the OS runs it "
        "wherever one is free; docs/training.md)",
    )
    load_balance: Literal["least_outstanding", "round_robin"] = Field(
        "least_outstanding",
        description="which server a group (one prompt's samples, sent to one server for its prefix cache) goes to: "
        "the one with the fewest outstanding tokens, then requests in flight (ties: round robin), or plain round "
        "robin (moe_rl/rollout/dispatch.py)",
    )
    max_retries: int = Field(3, ge=0)
    mem_fraction_static: float = Field(0.05, gt=0, le=1)
    max_total_tokens: int = Field(4096, ge=16)
    extra_server_args: list[str] = Field(default_factory=list)
    api_key_env: str | None = Field(
        None, pattern=ENV_NAME, description="name of the environment variable holding the API key (never the key)"
    )
    admin_api_key_env: str | None = Field(
        None, pattern=ENV_NAME, description="name of the variable holding SGLang's admin key (for weight updates)"
    )
    health_timeout_s: float = Field(30.0, gt=0, le=600, description="a server silent this long counts as hung")
    max_server_restarts: int = Field(2, ge=0, description="restarts of a dead server this run launched")
    max_process_restarts: int = Field(
        2,
        ge=0,
        description="restarts of a dead async rollout process (train.rollout_mode=async), each from the last "
        "handed-over step; one more death stops the run (exit code 2)",
    )
    max_foreign_syncs: int = Field(
        2,
        ge=0,
        description="re-syncs in a row after a batch made under weights the trainer did not push (label "
        "or digests); one more stops the run (exit code 2)",
    )
    check_served_weights: bool = Field(
        True,
        description="check every batch against the digests of every tensor the servers received (SGLang patch "
        "0014, admin key) and the trainer sent; false: labels only (correction.kl_alarm is the net behind)",
    )

    agent: str | None = Field(
        None,
        pattern=AGENT_SPEC,
        description="multi-turn rollouts (docs/agents.md; sync, async and partial rollout modes): "
        "'module:Class' (built once with the AgentContext, async "
        "run(sample, generate) -> Trajectory) or 'module:function'; e.g. moe_rl.rollout.tool_loop:ToolAgentLoop. "
        "None = one response per prompt",
    )
    tools: list[Annotated[str, Field(pattern=AGENT_SPEC)]] = Field(
        default_factory=list, description="tool functions for rollout.agent, each 'module:function' (docs/agents.md)"
    )
    agent_max_turns: int = Field(4, ge=1, description="rollout.agent: generated turns per trajectory at most")
    agent_max_total_tokens: int = Field(
        1024, ge=2, description="rollout.agent: tokens of a trajectory (prompt, tool and generated) at most"
    )
    tool_timeout_s: float = Field(10.0, gt=0, description="rollout.agent: a tool call longer than this is an error")
    agent_rerender: Literal["refuse", "retokenize"] = Field(
        "refuse",
        description="a turn's prompt that changes earlier tokens (a re-rendered chat template): refuse (an error "
        "naming the position) or retokenize (cut the trajectory back to the shared prefix, mark and count it)",
    )
    agent_check_prefix_routes: bool = Field(
        False,
        description="rollout.agent: each turn also asks for the prefix's route rows its prefill recomputed and "
        "counts those that differ from the recorded ones (replay/turn_prefix_route_conflicts); recorded rows win",
    )

    @model_validator(mode="after")
    def _one_concurrency(self):
        if self.max_concurrency is not None and self.server_concurrency is not None:
            raise ValueError(
                f"rollout.max_concurrency={self.max_concurrency} (all servers together) and rollout.server_concurrency="
                f"{self.server_concurrency} (per server) are both set; expected one of them (docs/launch.md)"
            )
        return self


class ReplayConfig(Section):
    routing: Literal["none", "r2", "r3"] = "none"
    keep_sampling_mask: bool = False


def replay_correction_problem(routing: str, correction_mode: str) -> str | None:
    """Why ``replay.routing`` cannot run with ``correction.mode`` (R2 records its routes in the old-log-prob
    pass, which only decoupled mode runs), or ``None``. The schema refuses it; the replay driver asserts it."""
    if routing == "r2" and correction_mode != "decoupled":
        return (
            "replay.routing='r2' records the learner's old-policy routes, which bypass mode never computes; "
            "use correction.mode='decoupled' or replay.routing in {'none', 'r3'}"
        )
    return None
