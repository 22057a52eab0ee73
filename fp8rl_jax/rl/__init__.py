"""fp8rl_jax.rl."""
