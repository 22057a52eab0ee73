"""One source of config defaults: the frozen dataclasses; config files derive from them.

No jax computation: only dataclasses and ConfigDicts.
"""

import dataclasses
from typing import Literal

import pytest

from experiments.configs import base
from experiments.configs.defaults import experiment_config
from fp8rl_jax.fields import check_choices, choices
from fp8rl_jax.generation import RolloutConfig
from fp8rl_jax.rl import LossConfig, RLConfig, RolloutCorrectionConfig
from fp8rl_jax.train.config import ConfigError
from fp8rl_jax.train.experiment import Experiment, ModelSpec, experiment_from_config


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def test_the_defaults_round_trip_through_a_config_dict():
    assert experiment_from_config(experiment_config()) == Experiment()


def test_a_non_default_experiment_round_trips():
    """None-able fields (a disabled recipe, no IS level, a kernel choice) survive the trip."""
    exp = Experiment(
        rollout=RolloutConfig(quant=None, decode_attention_impl="xla", stop_token_ids=(2, 5)),
        rl=RLConfig(
            group_size=4,
            loss=LossConfig(dual_clip=None, kl_kind="k1"),
            correction=RolloutCorrectionConfig(is_level=None, rs_level="token", rs_lower=0.25),
        ),
    )
    assert experiment_from_config(experiment_config(exp)) == exp


def test_base_is_the_defaults_plus_its_listed_changes():
    got, defaults = _flat(base.get_config().to_dict()), _flat(experiment_config().to_dict())
    assert got.keys() == defaults.keys()  # every field is there, so every field is overridable
    changed = {k for k in got if got[k] != defaults[k]}
    assert changed == set(base.CHANGES)
    assert all(got[k] == v for k, v in base.CHANGES.items())


def test_none_able_fields_keep_their_type_for_overrides():
    c = base.get_config()
    c.rl.correction.rs_level = "token"  # None -> a value
    c.rl.correction.is_level = None  # a value -> None
    with pytest.raises(TypeError):
        c.rl.correction.rs_lower = "half"  # a float field
    exp = experiment_from_config(c)
    assert exp.rl.correction.rs_level == "token" and exp.rl.correction.is_level is None


def test_literal_fields_list_their_choices_once():
    assert choices(Literal["a", "b"]) == ("a", "b")
    assert choices(Literal["a"] | None) == ("a", None)
    assert choices(str) is None and choices(int | None) is None
    with pytest.raises(ValueError, match=r"RolloutConfig.kv_scale_mode must be one of"):
        RolloutConfig(kv_scale_mode="per_token")
    with pytest.raises(ValueError, match=r"RLConfig.advantage must be one of .*'gae'"):
        RLConfig(advantage="ppo")
    with pytest.raises(ValueError, match="ModelSpec.architecture"):
        ModelSpec(architecture="GPT2LMHeadModel")
    c = base.get_config()
    c.rl.loss.agg = "sum"
    with pytest.raises(ConfigError, match=r"config.rl.loss.agg: 'sum' is not allowed"):
        experiment_from_config(c)


def test_check_choices_ignores_fields_without_a_literal():
    @dataclasses.dataclass(frozen=True)
    class Plain:
        name: str = "anything"
        mode: Literal["x", "y"] | None = None

        def __post_init__(self):
            check_choices(self)

    assert Plain(name="free text").mode is None
    with pytest.raises(ValueError, match=r"Plain.mode must be one of \('x', 'y', None\)"):
        Plain(mode="z")


def test_tiny_model_spec_copies_model_config_fields():
    cfg = ModelSpec(num_layers=3, hidden_size=48, head_dim=12, num_heads=4).tiny_config(97)
    assert (cfg.vocab_size, cfg.num_layers, cfg.hidden_size, cfg.head_dim) == (97, 3, 48, 12)
    assert cfg.qk_norm and not cfg.qkv_bias and cfg.architecture == "Qwen3ForCausalLM"
    assert cfg.num_experts == cfg.num_experts_per_tok == cfg.moe_intermediate_size == 0
    moe = ModelSpec(architecture="Qwen3MoeForCausalLM", num_experts=4).tiny_config(97)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_intermediate_size) == (4, 2, 64)
    assert ModelSpec(architecture="Qwen2ForCausalLM").tiny_config(97).qkv_bias
