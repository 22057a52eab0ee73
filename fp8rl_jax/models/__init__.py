"""fp8rl_jax.models."""
