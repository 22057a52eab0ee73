"""DAPO in the trainer: dynamic sampling fills a fixed-size batch without recompiling.

In-process ``train()`` on the tiny addition task (D=32, 2 prompts x 2 responses, 6-token
budget), with a reward hook that scripts which groups are informative, so the counts of kept
and filtered groups and of generation batches are known by hand.
"""

import json

import numpy as np
import pytest
from jax import monitoring

from experiments.configs import tiny
from experiments.configs.defaults import set_path
from fp8rl_jax.train import trainer
from fp8rl_jax.train.experiment import experiment_from_config

TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"  # one per jit cache miss (a compile)
Q, G, Q_GEN, M = 2, 2, 3, 3  # prompts per step, group size, per generation batch, max batches
SMALL = {
    "model.hidden_size": 32,
    "model.num_heads": 2,
    "model.num_kv_heads": 1,
    "model.intermediate_size": 64,
    "sft.steps": 0,
    "rl.group_size": G,
    "rl.num_minibatches": 1,
    "rl.dapo.dynamic_sampling": True,
    "rl.dapo.max_num_gen_batches": M,
    "rl.dapo.gen_prompts": Q_GEN,  # oversampling, as the paper's recipe (3x)
    "rl.dapo.overlong_buffer": 2,
    "rl.dapo.mask_truncated": True,
    "trainer.prompts_per_step": Q,
    "trainer.steps": 3,
    "trainer.eval_size": 2,
    "trainer.eval_every": 0,
    "trainer.checkpoint_every": 0,
    "trainer.plots": False,
    "trainer.loggers": ("jsonl",),
}
# Rewards of each generation batch (Q_GEN groups of G), in call order:
#   step 0: [1,0 | 1,1 | 0,0] keeps group 0 (2 filtered); [0,0 | 0,1 | 1,0] keeps group 1 and
#           fills the batch (1 more filtered; group 2 is not needed). 5 of 12 responses correct.
#   step 1: the same.
#   step 2: three batches of all-equal groups: the cap is reached with both slots empty.
SCRIPT = [[1, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0]] * 2 + [[0, 0, 1, 1, 0, 0]] * 3


def test_dynamic_sampling_fills_the_batch_and_compiles_once(tmp_path):
    config = tiny.get_config("fp8_tis")
    for path, value in {**SMALL, "trainer.run_dir": str(tmp_path)}.items():
        set_path(config, path, value)
    traces, at_call = [0], []

    def count(event, duration, **kwargs):
        traces[0] += event == TRACE_EVENT

    def scripted(task, examples, completions):
        at_call.append(traces[0])
        rewards = np.asarray(SCRIPT[len(at_call) - 1], np.float32)
        return rewards, float(np.mean(rewards))

    monitoring.register_event_duration_secs_listener(count)
    try:
        trainer.train(experiment_from_config(config), progress=False, reward_fn=scripted)
    finally:
        monitoring.unregister_event_duration_listener(count)
    assert len(at_call) == len(SCRIPT)
    # From step 1's first generation batch to step 2's last, no program was traced again: the
    # rollout, the row selection and the train program each compiled once, in step 0.
    assert at_call[2] == at_call[-1], at_call

    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    by_step = {r["step"]: r for r in rows if "dapo_gen_batches" in r}
    for step in (1, 2):
        r = by_step[step]
        got = (r["dapo_gen_batches"], r["dapo_groups_filtered"], r["dapo_groups_kept"])
        assert got == (2, 3, 2)
        assert r["dapo_unfilled_frac"] == 0.0
        assert r["reward_mean"] == 0.5  # the kept groups [1, 0] and [0, 1]
        assert 0.0 <= r["truncated_frac"] <= 1.0 and r["overlong_penalty_mean"] <= 0.0
        assert r["train_accuracy"] == pytest.approx(5 / 12)  # over all responses generated
    r = by_step[3]
    assert (r["dapo_gen_batches"], r["dapo_groups_filtered"], r["dapo_groups_kept"]) == (3, 9, 0)
    assert r["dapo_unfilled_frac"] == 1.0
    # every slot masked: the policy loss has no tokens, so the update is zero but finite
    assert r["nonfinite_skips"] == 0 and np.isfinite(r["loss"])
