"""Base config: every field of an experiment at its dataclass default, plus the tiny CPU run.

Parent of every other config. The fields, their defaults and what each means come from the
frozen dataclasses (``fp8rl_jax.train.experiment.Experiment`` and the configs it holds, each
field with a trailing comment there): the one source of defaults (``defaults.py``). The defaults
are the paper's recipe where it has one (DESIGN.md §4.7: FP8 W8A8 rollouts with E4M3 128x128
weight blocks and 1x128 activation groups, BF16 KV cache, token TIS C=2, GRPO with clip-higher,
16 responses x 32 prompts, lr 1e-6, weight decay 0.1, one update per rollout).

``CHANGES`` is what this file changes, for a tiny CPU GRPO run: a 2-layer Qwen3-style model
(D=64) on 2-digit addition with an SFT warm start. On 2 CPU cores: ~20 s SFT, ~0.4 s per RL step.
"""

from experiments.configs.defaults import experiment_config, set_path

CHANGES = {
    "trainer.run_dir": "runs/base",  # all outputs of the run
    "sft.steps": 300,  # warm start: ~20% held-out accuracy before RL, so rewards are not all 0
    "rollout.max_new_tokens": 6,  # a 2-digit sum and EOS fit in a few characters
    "rollout.stop_token_ids": (2,),  # EOS of the character tokenizer
    "rl.num_minibatches": 4,  # updates per rollout (paper: 1; 4 learns faster at this size)
    "optim.lr": 3e-4,  # tiny models learn at a far larger lr than the paper's 1e-6 for 8B
    "optim.weight_decay": 0.0,  # no decay for a 2-layer model trained for minutes
    "optim.b2": 0.99,  # a shorter second-moment memory for a short run
}


def get_config():
    c = experiment_config()
    for path, value in CHANGES.items():
        set_path(c, path, value)
    return c
