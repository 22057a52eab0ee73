"""Writes fp8_rollout_walkthrough.ipynb, outputs cleared (run this file with the project python).

Edit the cells here, not in the notebook, so the notebook in git stays generated and output-free.
"""

import os

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

CELLS = [
    (
        "md",
        """# FP8 rollouts, step by step

A tiny, CPU-only walkthrough of what `fp8rl_jax` does in one RL step (DESIGN.md §2, §4):

* **(a)** the quantization error of a weight: blockwise 128x128 vs per-tensor scales, E4M3 vs E5M2;
* **(b)** the rollout/trainer mismatch: generate with FP8 W8A8 and with BF16, score both with the
  BF16 policy, look at the per-token log-ratios and the mismatch metrics;
* **(c)** a few RL steps with and without token-level TIS;
* **(d)** plots of the runs.

Everything is local and random-initialized (no downloads); it runs in about a minute on a laptop.
For real runs use `experiments/train.py` with a config from `experiments/configs/`.""",
    ),
    (
        "code",
        """import dataclasses

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

from fp8rl_jax.generation import RolloutConfig, SamplingConfig, make_prompts
from fp8rl_jax.models import init_weights
from fp8rl_jax.quant import dequantize, quantize_blockwise
from fp8rl_jax.rl import (
    RLConfig,
    RolloutCorrectionConfig,
    init_train_state,
    jit_steps,
)
from fp8rl_jax.train.experiment import ModelSpec

print(jax.__version__, jax.devices())""",
    ),
    (
        "md",
        """## (a) Quantization error of one weight

A synthetic 512x512 weight with heavy tails (Student-t, 4 degrees of freedom, scale 0.02) and a
handful of outlier weights 2000x larger. One scale per 128x128 block (`s_b = amax_b / FP8_MAX`,
DeepSeek-V3 style) confines the outliers to their own block; one per-tensor scale sets the whole
grid by them. E4M3 (3 mantissa bits, max 448) has precision but little range: under a
per-tensor scale the small weights fall into its subnormals or flush to zero, which shows in the
tail of the error (p99), not in its median. E5M2 (2 mantissa bits, max 57344) has the range but
twice the relative step on every weight.""",
    ),
    (
        "code",
        """rng = np.random.default_rng(0)
W = (0.02 * rng.standard_t(df=4, size=(512, 512))).astype(np.float32)
W[37, :4] = 40.0  # a handful of outlier weights
W_j = jnp.asarray(W)

rel_err = {}
header = ["format", "scales", "rel. Frobenius", "median rel.", "p99 rel.", "flushed to 0"]
print("{:<7}{:<19}{:>15}{:>13}{:>10}{:>14}".format(*header))
for fmt in ("float8_e4m3fn", "float8_e5m2"):
    for scales, block in (("blockwise 128x128", (128, 128)), ("per-tensor", W.shape)):
        W_hat = np.asarray(dequantize(quantize_blockwise(W_j, block, fmt)))
        err = W_hat - W
        rel = np.abs(err[W != 0] / W[W != 0])
        name = fmt.removeprefix("float8_").removesuffix("fn").upper()
        rel_err[f"{name} {scales}"] = rel
        frob = np.linalg.norm(err) / np.linalg.norm(W)
        flushed = np.mean((W_hat == 0) & (W != 0))
        row = (name, scales, frob, np.median(rel), np.quantile(rel, 0.99), flushed)
        print("{:<7}{:<19}{:>15.4f}{:>13.4f}{:>10.4f}{:>14.3%}".format(*row))""",
    ),
    (
        "code",
        """fig, ax = plt.subplots(figsize=(7, 3.5))
bins = np.logspace(-6, 0.5, 80)
for label, e in rel_err.items():
    ax.hist(np.clip(e, 1e-6, None), bins=bins, histtype="step", label=label)
ax.set_xscale("log")
ax.set_yscale("log")  # the per-tensor damage is in the tail
ax.set_xlabel("per-element relative error |Ŵ - W| / |W|")
ax.set_ylabel("weights")
ax.set_title("Quantization error of one weight matrix")
ax.legend(fontsize=8)
plt.show()""",
    ),
    (
        "md",
        """## (b) FP8 vs BF16 rollout: the log-prob mismatch

A tiny random Qwen3-style model (D=128, 2 layers, vocab 128). `jit_steps` builds the rollout
and train programs; the rollout: quantize the params (the per-step weight sync), generate, score the
generated tokens with the BF16 policy in the same program (π_old). We run it once with the FP8 W8A8
recipe and once without quantization: the BF16 rollout is the baseline, where only prefill/decode
vs full-forward rounding separates rollout and scoring.""",
    ),
    (
        "code",
        """VOCAB, G, N_PROMPTS = 128, 8, 8
spec = ModelSpec(
    hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, intermediate_size=256
)
model_cfg = spec.tiny_config(VOCAB)
params = init_weights(model_cfg, jax.random.key(0), jnp.float32)
params["embed"] = params["embed"] / model_cfg.hidden_size**0.25  # moderately peaked logits

prompt_rng = np.random.default_rng(1)
prompts = make_prompts(
    [
        prompt_rng.integers(3, VOCAB, size=n).tolist()
        for n in prompt_rng.integers(4, 13, N_PROMPTS)
        for _ in range(G)
    ]
)
optimizer = optax.adam(3e-3)
rl_tis = RLConfig(group_size=G)  # token TIS, C = 2 (the paper's default)
fp8_rollout = RolloutConfig(max_new_tokens=24, sampling=SamplingConfig(temperature=1.0))
bf16_rollout = dataclasses.replace(fp8_rollout, quant=None)


def fresh_state():
    # init_train_state keeps FP32 params as they are (no copy) and the train step donates its
    # state, so every run starts from its own copy of the initial params.
    return init_train_state(jax.tree.map(jnp.copy, params), optimizer, jax.random.key(2))


rollout_fp8, train_step = jit_steps(model_cfg, fp8_rollout, rl_tis, optimizer)
state = fresh_state()
batches = {
    "FP8 W8A8": rollout_fp8(state, prompts),
    "BF16": jit_steps(model_cfg, bf16_rollout, rl_tis, optimizer).rollout(state, prompts),
}
names = ("kl", "k3_kl", "token_mult_prob_error", "probs_diff_max", "is_weight_max", "ess")
print(f"{'rollout':<10}" + "".join(f"{n:>24}" for n in names))
for arm, b in batches.items():
    print(f"{arm:<10}" + "".join(f"{float(b.metrics[n]):>24.3e}" for n in names))""",
    ),
    (
        "code",
        """fig, ax = plt.subplots(figsize=(7, 3.5))
for arm, b in batches.items():
    mask = np.asarray(b.response_mask_BT) > 0
    log_ratio = np.asarray(b.logp_rollout_BT - b.logp_old_BT)[mask]
    ax.hist(log_ratio, bins=80, histtype="step", label=f"{arm} rollout ({mask.sum()} tokens)")
ax.set_yscale("log")
ax.set_xlabel("per-token log π_rollout - log π_BF16")
ax.set_ylabel("tokens")
ax.set_title("Rollout vs trainer log-probs of the sampled tokens")
ax.legend(fontsize=8)
plt.show()""",
    ),
    (
        "md",
        """## (c) A few RL steps with and without TIS

A toy verifiable reward written in JAX: the fraction of response tokens with an even id. GRPO
(8 responses per prompt), one Adam update per rollout. Both arms roll out with FP8 W8A8; one
weights each token's loss by `min(π_old / π_rollout, 2)` (token TIS), the other does not correct.
The correction is computed in the rollout program (the train program only reads the weights), so
both arms share one compiled train step.""",
    ),
    (
        "code",
        """@jax.jit
def even_token_reward(tokens_BT, response_mask_BT):
    hits = (tokens_BT % 2 == 0) * response_mask_BT
    return hits.sum(axis=1) / jnp.maximum(response_mask_BT.sum(axis=1), 1.0)


rl_none = dataclasses.replace(rl_tis, correction=RolloutCorrectionConfig(is_level=None))
arms = {
    "TIS (C=2)": rollout_fp8,
    "no correction": jit_steps(model_cfg, fp8_rollout, rl_none, optimizer).rollout,
}
history = {}
for arm, rollout_step in arms.items():
    state = fresh_state()
    rows = []
    for _ in range(10):
        batch = rollout_step(state, prompts)
        rewards_B = even_token_reward(batch.tokens_BT, batch.response_mask_BT)
        state, train_metrics = train_step(state, batch, rewards_B)
        rows.append({k: float(v) for k, v in {**batch.metrics, **train_metrics}.items()})
    history[arm] = rows
    print(
        f"{arm:<14} reward {rows[0]['reward_mean']:.3f} -> {rows[-1]['reward_mean']:.3f}, "
        f"mean kl {np.mean([r['kl'] for r in rows]):.2e}, "
        f"skipped updates {int(state.nonfinite_skips)}"
    )""",
    ),
    (
        "md",
        """## (d) Plots

Reward, the k1 mismatch `kl` and `token_mult_prob_error` (mean exp|Δ log p|) per step. On a
10-step toy the two arms barely differ: TIS matters when the mismatch is large (harsher formats,
long responses, MoE routing flips); use the `experiments/configs/tiny.py` arms (`e5m2_none` vs
`e5m2_tis`) and `fp8rl_jax.train.plots` to compare real runs.""",
    ),
    (
        "code",
        """fig, axes = plt.subplots(1, 3, figsize=(12, 3.2))
for arm, rows in history.items():
    steps = np.arange(1, len(rows) + 1)
    for ax, key in zip(axes, ("reward_mean", "kl", "token_mult_prob_error")):
        ax.plot(steps, [r[key] for r in rows], marker="o", label=arm)
        ax.set_title(key)
        ax.set_xlabel("RL step")
axes[0].legend(fontsize=8)
fig.tight_layout()
plt.show()""",
    ),
]


def build() -> nbformat.NotebookNode:
    cells = [new_markdown_cell(src) if kind == "md" else new_code_cell(src) for kind, src in CELLS]
    for i, cell in enumerate(cells):
        cell.id = f"cell-{i:02d}"  # stable ids: regenerating gives no spurious diff
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    return nb


if __name__ == "__main__":
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fp8_rollout_walkthrough.ipynb")
    nbformat.write(build(), path)
    print(f"wrote {path}")
