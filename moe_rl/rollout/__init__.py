"""Rollout side: the SGLang servers (launch, pool, health, auth) and the client that generates on them."""
