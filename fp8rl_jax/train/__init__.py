"""fp8rl_jax.train."""
