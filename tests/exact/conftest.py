"""Fixtures of the true-on-policy tests: the learner tests' single-rank Megatron world."""

from tests.learner.conftest import megatron_world  # noqa: F401  (re-exported fixture)
