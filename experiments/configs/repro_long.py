"""Arms of the long-response miniature reproduction (issue 24, item 3): experiments/repro_long.py.

Parent: tiny.py (itself base.py). Pass the arm after a colon, e.g.
``--config=experiments/configs/repro_long.py:fp8_tis``. Changes from tiny.py: the task is
``chain`` (written repeated subtraction, 4 tokens per step; ``task.min_steps``..``max_steps`` set
the response length, here MIN_STEPS..MAX_STEPS steps = RESPONSE_TOKENS), the rollout budget fits
the longest chain + EOS, wrong chains earn PARTIAL_CREDIT x their share of right steps, the
rollout runs on ENGINE, a longer SFT warm start, a lower lr with one update per RL step (the
pilots in experiments/results/repro_long/PILOT.md), and the run length is set here once for the
sweep. The sweep varies only ``trainer.seed`` (model init, SFT, sampling). Arms:
  bf16_none      BF16 rollout, no correction                             [E1 baseline]
  fp8_none       FP8 W8A8 (E4M3, 128x128 / 1x128), no correction         [the paper's 4th claim]
  fp8_tis        FP8 W8A8 + token TIS, C=2                               [E1, the recipe]
  fp8_mis        FP8 W8A8 + token MIS (mask ratios outside [1/2, 2])     [limitations: MIS]
  fp8train_none  FP8 W8A8 with rl.train_precision="fp8_rollout" (scoring and loss forward in the
                 rollout's FP8 numerics), no correction                 [Jet-RL: one precision]
"""

from experiments.configs import tiny
from experiments.configs.repro import sweep_trainer

# arm -> (tiny.py arm, rl.train_precision)
ARMS = {
    "bf16_none": ("bf16_none", "bf16"),
    "fp8_none": ("fp8_none", "bf16"),
    "fp8_tis": ("fp8_tis", "bf16"),
    "fp8_mis": ("fp8_mis", "bf16"),
    "fp8train_none": ("fp8_none", "fp8_rollout"),
}

MIN_STEPS = 10  # shortest chain: 39 response tokens
MAX_STEPS = 40  # longest chain: 159 response tokens
MAX_STRIDE = 9  # stride k in [1, 9]
RESPONSE_TOKENS = 4 * MAX_STEPS  # 3-digit values + commas (4 * steps - 1) and EOS
ENGINE = "paged"  # the paged engine runs on CPU at these sizes (pilot in REPORT.md)
PAGE_SIZE = 32  # tokens per KV page
PARTIAL_CREDIT = 0.5  # a wrong chain earns 0.5 x its share of right steps
SFT_STEPS = 600  # warm start: greedy held-out exact match ~16%, far from 1 (PILOT.md, 4th)
SFT_BATCH = 32  # demonstrations per SFT step
RL_STEPS = 50  # per run: ~6 min on 2 loaded cores, ~3 min free (PILOT.md)
LR = 1e-4  # tiny.py's 3e-4 (and 2 of 4 minibatch updates) collapse this long-chain policy
NUM_MINIBATCHES = 1  # one update per RL step (PILOT.md, third and fourth pilots)
PROMPTS_PER_STEP = 8  # x GROUP_SIZE responses per RL step
GROUP_SIZE = 8
EVAL_EVERY = 10
EVAL_SIZE = 64


def get_config(arm: str = "fp8_tis"):
    if arm not in ARMS:
        raise ValueError(f"repro_long.py arm {arm!r}: expected one of {tuple(ARMS)}")
    tiny_arm, train_precision = ARMS[arm]
    c = tiny.get_config(tiny_arm)
    c.rl.train_precision = train_precision
    c.task.name = "chain"
    c.task.min_steps = MIN_STEPS
    c.task.max_steps = MAX_STEPS
    c.task.max_stride = MAX_STRIDE
    c.task.partial_credit = PARTIAL_CREDIT
    c.rollout.max_new_tokens = RESPONSE_TOKENS
    c.rollout.engine = ENGINE
    c.rollout.paged.page_size = PAGE_SIZE
    c.sft.steps = SFT_STEPS
    c.sft.batch_size = SFT_BATCH
    c.optim.lr = LR
    c.rl.num_minibatches = NUM_MINIBATCHES
    c.rl.group_size = GROUP_SIZE
    c.trainer.prompts_per_step = PROMPTS_PER_STEP
    return sweep_trainer(c, f"runs/repro_long_{arm}", RL_STEPS, EVAL_EVERY, EVAL_SIZE)
