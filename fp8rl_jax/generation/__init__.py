"""fp8rl_jax.generation."""
