"""The planner's experiment and model: a config file planned without a checkpoint or data.

A real-model config names a local HF checkpoint (``model.hf_checkpoint``) and a data file; the
planner needs neither, only the model's widths: a preset (``PRESETS``, from the HF config.json
of the released models) chosen by name or from the config file's name. Tiny-model configs use
their own fields with the character tokenizer.
"""

from __future__ import annotations

import dataclasses
import os

from fp8rl_jax.models import ModelConfig
from fp8rl_jax.models.aot_cases import QWEN3_30B_A3B
from fp8rl_jax.train.topology import Topology

QWEN3_STOP_IDS = (151645, 151643)  # <|im_end|>, <|endoftext|>: Qwen3's generation_config.json


def _qwen3_8b() -> ModelConfig:
    from fp8rl_jax.generation.aot_cases import QWEN3_8B

    return QWEN3_8B


PRESETS = {
    "qwen3-8b": _qwen3_8b,
    "qwen3-30b-a3b": lambda: QWEN3_30B_A3B,
}


def preset_for(config_path: str, name: str = "") -> str:
    """The preset ``name``, else the one whose name the config file's name holds ("" if none)."""
    if name:
        if name not in PRESETS:
            raise ValueError(f"--model={name!r}: unknown preset; choose one of {sorted(PRESETS)}")
        return name
    stem = os.path.basename(config_path.split(":")[0]).lower()
    for key in sorted(PRESETS, key=len, reverse=True):  # qwen3_30b_a3b before qwen3_8b
        if key.replace("-", "_") in stem:
            return key
    return ""


NOT_READ = "<not read by the planner>"  # a data file / tokenizer placeholder


def experiment_and_model(config, config_path: str, model: str = ""):
    """``(Experiment, ModelConfig, preset name)`` of a config file, for planning only.

    The required placeholders are filled (a math task's data file and tokenizer with
    ``NOT_READ``, the checkpoint left empty); an HF config gets the
    preset's widths and Qwen3's stop tokens when it names none.
    """
    from fp8rl_jax.tasks import CharTokenizer
    from fp8rl_jax.train.experiment import REQUIRED_IF_NONE, experiment_from_config

    raw = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    needs_checkpoint = raw.get("model", {}).get("hf_checkpoint", "") is None
    for section, name, _ in REQUIRED_IF_NONE:
        if raw.get(section, {}).get(name, "") is None:
            raw[section][name] = ""
    # The checkpoint stays empty (the preset gives the widths); a math task's files are named
    # but never read (the planner builds no task), so the config's own checks pass.
    task = raw.get("task", {})
    if task.get("name") == "math":
        for name in ("jsonl_path", "tokenizer_path"):
            task[name] = task.get(name) or NOT_READ
    exp = experiment_from_config(raw)
    preset = preset_for(config_path, model)
    if needs_checkpoint and not preset:
        raise ValueError(
            f"{config_path} needs an HF checkpoint: name the model's widths with --model "
            f"(one of {sorted(PRESETS)})"
        )
    if not preset:
        return exp, exp.model.tiny_config(CharTokenizer().vocab_size), "tiny"
    if not exp.rollout.stop_token_ids:
        rollout = dataclasses.replace(exp.rollout, stop_token_ids=QWEN3_STOP_IDS)
        exp = dataclasses.replace(exp, rollout=rollout)
    return exp, PRESETS[preset](), preset


def with_layers(cfg: ModelConfig, layers: int | None) -> ModelConfig:
    """``cfg`` with ``layers`` layers (None: as it is)."""
    return cfg if layers is None else dataclasses.replace(cfg, num_layers=layers)


def mesh_text(exp, topo: Topology) -> str:
    """``data=1,fsdp=8,expert=1,tensor=1``: the config's mesh resolved for ``topo``."""
    from fp8rl_jax.train.sharding.mesh import MESH_AXES

    sizes = exp.mesh.axis_sizes(topo.chips)
    return ",".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes, strict=True))
