"""fp8rl_jax.tasks."""
