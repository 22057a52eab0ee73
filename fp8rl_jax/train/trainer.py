"""The host loop: SFT warm start, then RL steps with FP8 rollouts, eval, checkpoints, logs, plots.

Each RL step is two compiled programs (``rl.build_programs``, which jits every program of the run
with the shardings ``train.placement`` returns): the rollout program (FP8 weight sync,
generation, BF16 scoring, rollout correction), then string rewards on the host, then the train
program. The loop reads step t-1's metrics and non-finite count (a ``Pending`` record) only after
step t's rollout is dispatched, so logging and the checks overlap the rollout; the host waits only
for the rollout's tokens, which its rewards need. Data of step t depends only on t, and the RNG
lives in the state, so a resumed run reproduces an uninterrupted one.

A run holds its directory's lock (``run_dir``) from start to end. SIGINT / SIGTERM during the
loop let the step finish, save it and stop with ``shutdown.Interrupted``; every exit path,
errors included, closes the checkpoint manager (no orbax thread outlives the run).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
import typing
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fp8rl_jax.generation import Prompts, bucket_length
from fp8rl_jax.models import ModelConfig, Tokenizer
from fp8rl_jax.rl import Programs, TrainState, init_train_state
from fp8rl_jax.tasks import (
    CharTokenizer,
    Example,
    Task,
    make_demonstration_batch,
    make_prompt_batch,
    score_completions,
)
from fp8rl_jax.train.checkpoint import CheckpointManager, NoCheckpointRestored
from fp8rl_jax.train.checks import check_devices, check_eval_size, resume_error
from fp8rl_jax.train.dynamic_sampling import Sampled, make_dynamic_sampler
from fp8rl_jax.train.experiment import Experiment
from fp8rl_jax.train.logging import (
    METRICS_FILE,
    LoggerGroup,
    MetricsLogger,
    jsonable,
    make_metrics_logger,
)
from fp8rl_jax.train.optim import make_optimizer
from fp8rl_jax.train.placement import SingleDevice, make_placement
from fp8rl_jax.train.run_dir import CHECKPOINTS_DIR, locked_run_dir, record_config
from fp8rl_jax.train.setup import (
    abstract_train_state,
    build_model,
    build_task,
    resolve_stop_tokens,
    run_programs,
)
from fp8rl_jax.train.sft import sft_warm_start
from fp8rl_jax.train.shutdown import Interrupted, StopSignals, signal_name

log = logging.getLogger(__name__)


# (task, examples, completion texts) -> (rewards_B float32, exact accuracy): ``score_completions``
RewardFn = Callable[[Task, Sequence[Example], Sequence[str]], tuple[np.ndarray, float]]


class NonFiniteError(RuntimeError):
    """Too many updates were skipped because the loss or gradient was NaN/Inf."""


def _prompts(batch) -> Prompts:
    return Prompts(jnp.asarray(batch.tokens_BP), jnp.asarray(batch.lens_B))


def prompt_length(task, tokenizer, generated_sample: int = 256) -> int:
    """Padded prompt length P: the longest prompt (+ BOS) of both splits, rounded up to a bucket.

    Finite datasets are scanned whole, so no later prompt can overflow P; generated tasks are
    sampled. One P per run means the rollout program compiles once.
    """
    longest = 0
    for split in ("train", "eval"):
        n = task.num_examples(split) or generated_sample
        for i in range(n):
            longest = max(longest, len(tokenizer.encode(task.sample(i, split).prompt)) + 1)
    return bucket_length(longest)


def _completions(tokenizer, tokens_BT: np.ndarray, prompt_len: int) -> list[str]:
    return [tokenizer.decode(row[prompt_len:]) for row in tokens_BT]


@dataclasses.dataclass
class _Run:
    """What the loop carries besides the device state."""

    exp: Experiment  # the validated experiment
    task: Task  # prompts and the verifier of its rewards
    tokenizer: CharTokenizer | Tokenizer  # the task's tokenizer (character or HF)
    model_cfg: ModelConfig  # the policy's architecture
    prompt_len: int  # P: every prompt batch is left-padded to it (one compiled program)
    placement: SingleDevice = dataclasses.field(default_factory=SingleDevice)  # or OnMesh
    reward_fn: RewardFn = score_completions  # host rewards of the rollouts (and their accuracy)
    stop: StopSignals = dataclasses.field(default_factory=StopSignals)  # SIGINT / SIGTERM


@dataclasses.dataclass(frozen=True)
class Pending:
    """A dispatched step, logged once the next step's rollout is dispatched (no host sync)."""

    step: int  # RL steps completed with it: its metrics.jsonl row
    rollout_metrics: dict  # device scalars of the rollout program
    train_metrics: dict  # device scalars of the train program (nonfinite_skips included)
    train_accuracy: float  # exact accuracy of the step's responses (host verifier)
    rollout_time_s: float  # previous train program done -> this rollout's tokens on the host
    eval_accuracy: float | None = None  # greedy held-out accuracy measured after the step
    eval_reward: float | None = None  # mean held-out reward (the task's, partial credit included)


def make_eval_fn(run: _Run, eval_generate: Callable):
    """Greedy held-out (accuracy, mean reward) of the policy as the rollout engine runs it (same
    precision); ``eval_generate``: the ``eval`` program (``rl.Programs``). The reward is the
    task's (``partial_credit`` and ``format_reward`` included): a finer curve than exact match
    when responses are long."""
    place, n = run.placement, run.exp.trainer.eval_size

    def evaluate(state: TrainState) -> tuple[float, float]:
        rows = place.rows(n)  # this process's problems only
        batch = make_prompt_batch(
            run.task, run.tokenizer, range(rows.start, rows.stop), 1, run.prompt_len, split="eval"
        )
        prompts = place.prompts(batch.tokens_BP, batch.lens_B, n)
        tokens = place.local_tokens(eval_generate(state.params, prompts, state.kv_scales))
        rewards_B, acc = score_completions(
            run.task, batch.examples, _completions(run.tokenizer, tokens, run.prompt_len)
        )
        n_local = len(batch.examples)
        reward = float(np.mean(rewards_B)) if n_local else 0.0
        acc = place.mean_over_rows(float(acc), n_local)
        return acc, place.mean_over_rows(reward, n_local, counts=False)

    return evaluate


def _initial_state(run: _Run, params, optimizer, rng, calibrate: Callable) -> TrainState:
    exp = run.exp

    def demo_batch(i):
        n = exp.sft.batch_size
        return make_demonstration_batch(
            run.task,
            run.tokenizer,
            range(i * n, (i + 1) * n),
            run.prompt_len,
            exp.rollout.max_new_tokens,
        )

    if exp.sft.steps:
        t0 = time.perf_counter()
        params, losses = sft_warm_start(params, run.model_cfg, exp.sft, demo_batch)
        print(
            f"SFT warm start: {exp.sft.steps} steps, loss {losses[0]:.3f} -> {losses[-1]:.3f} "
            f"({time.perf_counter() - t0:.1f} s)"
        )
    first = make_prompt_batch(
        run.task,
        run.tokenizer,
        range(exp.trainer.prompts_per_step),
        exp.rl.group_size,
        run.prompt_len,
    )
    kv_scales = calibrate(params, _prompts(first))
    return init_train_state(params, optimizer, rng, kv_scales, rl_cfg=run.exp.rl)


def train(
    exp: Experiment, *, progress: bool = True, reward_fn: RewardFn = score_completions
) -> dict:
    """Runs (or resumes) the experiment; returns the summary (also in run_dir/summary.json).

    With more than one device or process the state and both steps live on ``exp.mesh``
    (docs/SCALING.md §6); every process runs this same loop on its own rows of each batch.
    ``reward_fn(task, examples, completions) -> (rewards_B, accuracy)`` scores the rollouts on
    the host (default: the task's verifier); held-out accuracy always uses the verifier.

    The run directory is locked for the run (``run_dir.RunDirLocked`` if another run holds it).
    SIGINT / SIGTERM stop it after the current step with a checkpoint (``shutdown.Interrupted``);
    every exit path closes the checkpoint manager and the loggers.
    """
    check_devices(exp)
    with StopSignals() as stop, locked_run_dir(exp.trainer.run_dir):
        task, tokenizer = build_task(exp.task, exp.model.hf_checkpoint)
        check_eval_size(exp, task)
        if not exp.rollout.stop_token_ids:  # the checkpoint's, unless the config names them
            exp = resolve_stop_tokens(exp, tokenizer)
            if exp.rollout.stop_token_ids:
                print(f"stop tokens from the checkpoint: {exp.rollout.stop_token_ids}")
        model_cfg, params = build_model(exp.model, tokenizer, jax.random.key(exp.trainer.seed))
        run = _Run(exp, task, tokenizer, model_cfg, prompt_length(task, tokenizer),
                   reward_fn=reward_fn, stop=stop)  # fmt: skip
        ckpt = CheckpointManager(
            os.path.join(exp.trainer.run_dir, CHECKPOINTS_DIR),
            max_to_keep=exp.trainer.keep_checkpoints,
        )
        try:
            summary = _train(run, params, ckpt, progress)
        except BaseException:
            _close_after_error(ckpt)
            raise
        ckpt.close()
    return summary


def _close_after_error(ckpt: CheckpointManager) -> None:
    """Closes the manager on an error path; its own error is logged, the first one propagates."""
    try:
        ckpt.close()
    except Exception as e:  # noqa: BLE001
        log.warning("closing the checkpoint manager after an error: %s", e)


def _train(run: _Run, params, ckpt: CheckpointManager, progress: bool) -> dict:
    exp, tc = run.exp, run.exp.trainer
    optimizer = make_optimizer(exp.optim)
    rng = jax.random.key(tc.seed + 1)
    abstract = abstract_train_state(exp, run.model_cfg, params)
    place = run.placement = make_placement(exp, run.model_cfg, abstract, run.prompt_len)
    programs = run_programs(exp, run.model_cfg, place, optimizer)
    config = jsonable(exp)
    try:  # a signal here (Interrupted) is no resume error: it exits, every checkpoint in place
        restored = ckpt.restore_latest(place.restore_target(abstract))
    except NoCheckpointRestored as e:  # most likely another model or optimizer
        raise resume_error(tc.run_dir, config, e) from e
    if place.is_main:  # only now: a rerun that cannot resume leaves config.json as it was
        record_config(tc.run_dir, config)
    if restored is not None:
        state, meta = restored
        print(f"resumed from {ckpt.directory} at step {int(state.step)}")
    else:
        # SFT and the step-0 KV-scale calibration run on each process's first device (every
        # process computes the same values); the result is then placed on the mesh.
        state = place.place_state(_initial_state(run, params, optimizer, rng, programs.calibrate))
    start = int(state.step)
    # Row s holds the metrics of the step that completed s steps, so a run resumed from the
    # checkpoint of step s keeps rows <= s (from scratch, none: row 0 is logged again).
    logger = make_metrics_logger(
        tc.run_dir, tc.loggers, resume_step=start + 1 if start else 0, config=exp
    )
    with contextlib.closing(logger), place.activate():
        _run_steps(run, state, start, programs, ckpt, logger, progress)
    ckpt.wait_until_finished()
    if not place.is_main:  # only process 0 holds metrics.jsonl
        return {"run_dir": os.path.abspath(tc.run_dir), "steps": tc.steps,
                "eval_accuracy_first": None, "eval_accuracy_last": None}  # fmt: skip
    summary = _summary(tc.run_dir, os.path.join(tc.run_dir, METRICS_FILE))
    if tc.plots:
        from fp8rl_jax.train.plots import plot_run

        plot_run(tc.run_dir)
    return summary


def _step_prompts(run: _Run, step: int):
    """This process's rows of step ``step``'s prompt batch, and the global device prompts."""
    n, group = run.exp.trainer.prompts_per_step, run.exp.rl.group_size
    rows = run.placement.rows(n * group, group)  # whole GRPO groups only
    problems = range(step * n + rows.start // group, step * n + rows.stop // group)
    batch = make_prompt_batch(run.task, run.tokenizer, problems, group, run.prompt_len)
    return batch, run.placement.prompts(batch.tokens_BP, batch.lens_B, n * group)


def _score(run: _Run, batch, tokens_BT: np.ndarray) -> tuple[np.ndarray, float]:
    """Host rewards and exact accuracy of the responses in ``tokens_BT`` to ``batch``'s prompts."""
    texts = _completions(run.tokenizer, tokens_BT, run.prompt_len)
    return run.reward_fn(run.task, batch.examples, texts)


def _make_sampler(run: _Run, programs: Programs):
    """``sample(state, step, on_dispatch) -> Sampled``: step ``step``'s scored rollout batch.

    One rollout per step, or DAPO's dynamic sampling (``train.dynamic_sampling``).
    """
    place, rl_cfg = run.placement, run.exp.rl
    if rl_cfg.dapo.dynamic_sampling:
        G = rl_cfg.group_size

        def prompt_batch(problems):
            return make_prompt_batch(run.task, run.tokenizer, problems, G, run.prompt_len)

        return make_dynamic_sampler(
            rl_cfg.dapo, run.exp.trainer.prompts_per_step, G, programs, place, prompt_batch,
            lambda b, t: _score(run, b, t),
        )  # fmt: skip
    rollout_step = programs.rollout

    def sample(state, step: int, on_dispatch) -> Sampled:
        batch, prompts = _step_prompts(run, step)
        scored = rollout_step(state, prompts)  # queued behind step t-1's train program
        jax.block_until_ready(state.step)  # t-1's update is done: rollout t runs from here
        t0 = time.perf_counter()
        on_dispatch()
        tokens = place.local_tokens(scored.tokens_BT)
        rollout_time = time.perf_counter() - t0
        rewards, acc = _score(run, batch, tokens)
        acc = place.mean_over_rows(float(acc), len(batch.examples))
        return Sampled(scored, rewards, acc, rollout_time, {})

    return sample


class _Output:
    """Reads pending steps: logs each row, updates the progress bar, stops on non-finite skips."""

    def __init__(self, logger: MetricsLogger | LoggerGroup, bar, ckpt: CheckpointManager, tc):
        self.logger, self.bar, self.ckpt, self.tc = logger, bar, ckpt, tc
        self.eval_acc: float | None = None  # the latest held-out accuracy, for the bar

    def read(self, p: Pending) -> None:
        """Logs step ``p`` (waits for its programs); raises ``NonFiniteError`` past the limit."""
        metrics = dict(p.rollout_metrics)
        if p.eval_accuracy is not None:
            metrics["eval_accuracy"] = self.eval_acc = p.eval_accuracy
            metrics["eval_reward"] = p.eval_reward
        row = {k: float(v) for k, v in {**metrics, **p.train_metrics}.items()}
        row.update(train_accuracy=p.train_accuracy, rollout_time_s=p.rollout_time_s)
        self.logger.log(p.step, row)
        self.bar.set_postfix(
            reward=f"{row['reward_mean']:.2f}",
            acc=f"{p.train_accuracy:.2f}",
            eval=f"{self.eval_acc:.2f}" if self.eval_acc is not None else "-",
            kl=f"{row['kl']:.1e}",
        )
        if int(row["nonfinite_skips"]) > self.tc.max_nonfinite_skips:
            self.logger.close()
            self.ckpt.wait_until_finished()
            raise NonFiniteError(_nonfinite_message(p, row, self.tc, self.logger))


def _due(every: int, done: int, last: int) -> bool:
    return (every and done % every == 0) or done == last


def _run_steps(run: _Run, state, start, programs: Programs, ckpt, logger, progress: bool) -> None:
    """RL steps ``start .. steps-1``: step t's metrics are read after step t+1 is dispatched."""
    from tqdm.auto import tqdm

    tc, place = run.exp.trainer, run.placement
    evaluate = make_eval_fn(run, programs.eval)
    show = progress and place.is_main
    bar = tqdm(range(start, tc.steps), initial=start, total=tc.steps, disable=not show,
               desc="GRPO", unit="step")  # fmt: skip
    out = _Output(logger, bar, ckpt, tc)
    run.stop.arm()  # from here a signal lets the step finish, then saves it
    if start == 0:
        out.eval_acc, reward = evaluate(state)
        logger.log(0, {"eval_accuracy": out.eval_acc, "eval_reward": reward})
    pending: Pending | None = None
    sample = _make_sampler(run, programs)

    def read_pending() -> None:  # step t-1's metrics are ready now; read them as rollout t runs
        if pending is not None:
            out.read(pending)

    for step in bar:
        s = sample(state, step, read_pending)
        state, train_metrics = programs.train(state, s.batch, place.rewards(s.rewards_B))
        done = step + 1
        ro_metrics = {**s.batch.metrics, **s.metrics}
        pending = Pending(done, ro_metrics, train_metrics, s.accuracy, s.rollout_time_s)
        if _due(tc.eval_every, done, tc.steps):
            acc, reward = evaluate(state)
            pending = dataclasses.replace(pending, eval_accuracy=acc, eval_reward=reward)
        stop = done < tc.steps and run.stop.requested()  # a signal: save this step and stop
        if stop or _due(tc.checkpoint_every, done, tc.steps):
            # Row `done` is written before its checkpoint can commit: a run killed after the
            # commit resumes at `done` and never logs that row again.
            out.read(pending)
            pending = None
            ckpt.save(done, state, {"step": done})  # on every process: each writes its shards
        if stop:
            _stopped(run, ckpt, logger, done)
    if pending is not None:
        out.read(pending)


def _stopped(run: _Run, ckpt: CheckpointManager, logger, done: int) -> typing.NoReturn:
    """After a signal: the step's checkpoint committed and the metrics flushed, stop."""
    ckpt.wait_until_finished()
    logger.flush()
    signum = run.stop.signum or signal.SIGTERM  # another process may have got it
    raise Interrupted(
        f"stopped by {signal_name(signum)} after step {done} of {run.exp.trainer.steps}; "
        f"checkpoint of step {done} saved in {ckpt.directory}: rerun the same command to "
        "resume from there",
        signum,
    )


def _nonfinite_message(p: Pending, row: dict, tc, logger) -> str:
    last = {k: row[k] for k in ("reward_mean", "loss", "grad_norm", "quant_nonfinite")}
    return (
        f"{int(row['nonfinite_skips'])} updates skipped for a non-finite loss, gradient "
        f"or optimizer update (limit trainer.max_nonfinite_skips={tc.max_nonfinite_skips}). "
        f"Step {p.step}: " + ", ".join(f"{k}={v:.4g}" for k, v in last.items()) + ". A NaN "
        f"reward_mean points at the reward function, a finite loss and grad_norm at the optimizer "
        f"(optim.lr), quant_nonfinite > 0 at the params. "
        f"Metrics: {os.path.join(tc.run_dir, METRICS_FILE)}"
    )


def _summary(run_dir: str, metrics_path: str) -> dict:
    with open(metrics_path) as f:
        rows = [json.loads(line) for line in f]
    evals = [(r["step"], r["eval_accuracy"]) for r in rows if "eval_accuracy" in r]
    summary = {
        "run_dir": os.path.abspath(run_dir),
        "steps": max((r["step"] for r in rows), default=0),
        "eval_accuracy_first": evals[0][1] if evals else None,
        "eval_accuracy_last": evals[-1][1] if evals else None,
        "eval_accuracy": evals,
    }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary
