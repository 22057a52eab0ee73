"""fp8rl_jax: RL for LLMs with FP8 rollouts in JAX (see DESIGN.md)."""
