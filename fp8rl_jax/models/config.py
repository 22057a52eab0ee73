"""``ModelConfig``: one frozen dataclass for Llama, Qwen2, Qwen3 and Qwen3-MoE decoders."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

# HF architecture name -> model_type; everything else is rejected with a ValueError.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    """RoPE frequencies and HF scaling variant (``rope_scaling`` / ``rope_parameters``)."""

    theta: float = 10000.0  # base wavelength
    type: str = "default"  # one of ROPE_TYPES
    factor: float = 1.0  # linear / llama3 / yarn context extension factor
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3 / yarn pretraining length
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    attention_factor: float | None = None  # yarn cos/sin scale; None: derived from factor/mscale
    mscale: float = 0.0  # yarn (DeepSeek style), 0 = unused
    mscale_all_dim: float = 0.0  # yarn (DeepSeek style), 0 = unused
    truncate: bool = True  # yarn: floor/ceil the correction range

    def __post_init__(self):
        if self.type not in ROPE_TYPES:
            raise ValueError(f"rope_scaling.rope_type {self.type!r} unsupported; use {ROPE_TYPES}")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Decoder-only transformer hyperparameters (names follow HF where one exists)."""

    vocab_size: int
    hidden_size: int  # D
    num_layers: int  # L
    num_heads: int  # H
    num_kv_heads: int  # K
    head_dim: int  # C
    intermediate_size: int  # F of dense MLP layers
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama/Qwen3 attention_bias
    o_bias: bool = False  # Llama/Qwen3 attention_bias (o_proj has a bias too)
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim of q and k before RoPE
    num_experts: int = 0  # E; 0 = dense model
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # F of each expert
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # layer i is MoE iff (i + 1) % step == 0 and i not mlp_only
    mlp_only_layers: tuple[int, ...] = ()  # layers that stay dense in an MoE model
    router_aux_loss_coef: float = 0.001  # weight of ForwardOut.aux_loss in the trainer's loss
    architecture: str = "LlamaForCausalLM"  # HF class name written by save_hf_checkpoint
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"architectures {self.architecture!r} unsupported; use one of {list(ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_heads} not divisible by "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.num_experts_per_tok} not in 1..E")
        if self.num_experts and self.decoder_sparse_step < 1:
            raise ValueError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")

    @property
    def model_type(self) -> str:
        return ARCHITECTURES[self.architecture]

    def is_moe_layer(self, i: int) -> bool:
        """HF Qwen3-MoE rule: sparse iff not in mlp_only_layers and (i + 1) % step == 0."""
        return (
            self.num_experts > 0
            and i not in self.mlp_only_layers
            and (i + 1) % self.decoder_sparse_step == 0
        )

    @classmethod
    def from_hf_config(cls, config: dict | str | os.PathLike) -> ModelConfig:
        """From an HF ``config.json`` dict, a path to it, or a checkpoint directory."""
        where = "config.json"
        if not isinstance(config, dict):
            where, config = _config_path(config), _read_config_json(config)
        try:
            return _from_hf_dict(config)
        except KeyError as e:  # a required key: name it and the file, not a bare KeyError
            raise ValueError(f"{where}: missing key {e.args[0]!r}") from None

    def to_hf_config(self, torch_dtype: str = "bfloat16") -> dict[str, Any]:
        """The HF ``config.json`` dict of this model (inverse of ``from_hf_config``)."""
        return _to_hf_dict(self, torch_dtype)


def _config_path(path) -> str:
    path = os.fspath(path)
    return os.path.join(path, "config.json") if os.path.isdir(path) else path


def _read_config_json(path) -> dict:
    path = _config_path(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config.json not found: {path}")
    with open(path) as f:
        return json.load(f)


def _rope_from_hf(c: dict) -> RopeConfig:
    """Reads ``rope_scaling`` (transformers v4) or ``rope_parameters`` (v5), "type"/"rope_type"."""
    params = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be a dict, got {params!r}")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError("rope_parameters: per-layer-type RoPE is unsupported")
    theta = params.get("rope_theta", c.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling.rope_type {kind!r} unsupported; use one of {ROPE_TYPES}")
    prf = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if prf != 1.0:
        raise ValueError(f"partial_rotary_factor {prf} unsupported (only 1.0)")
    omax = params.get("original_max_position_embeddings")
    omax = omax or c.get("original_max_position_embeddings") or c["max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        if kind == "yarn":  # DeepSeek-V3 style: the ratio of the two lengths
            factor = c["max_position_embeddings"] / omax
        elif kind in ("linear", "llama3"):
            raise ValueError(f"rope_scaling.factor is required for rope_type {kind!r}")
        else:
            factor = 1.0
    return RopeConfig(
        theta=float(theta),
        type=kind,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(omax),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        attention_factor=params.get("attention_factor"),
        mscale=float(params.get("mscale") or 0.0),
        mscale_all_dim=float(params.get("mscale_all_dim") or 0.0),
        truncate=bool(params.get("truncate", True)),
    )


def _check_unsupported(c: dict) -> None:
    if c.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {c['hidden_act']!r} unsupported (only 'silu')")
    if c.get("mlp_bias", False):
        raise ValueError("mlp_bias=True unsupported")
    if c.get("use_sliding_window", False):
        raise ValueError("use_sliding_window=True unsupported")
    if c.get("pretraining_tp", 1) not in (1, None):
        raise ValueError(f"pretraining_tp {c['pretraining_tp']} unsupported (only 1)")
    if c.get("attention_dropout", 0.0):
        raise ValueError("attention_dropout != 0 unsupported")


def _from_hf_dict(c: dict) -> ModelConfig:
    archs = c.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in ARCHITECTURES:
        raise ValueError(f"architectures {archs!r} unsupported; use one of {list(ARCHITECTURES)}")
    _check_unsupported(c)
    kind = ARCHITECTURES[arch]
    n_heads = c["num_attention_heads"]
    attn_bias = bool(c.get("attention_bias", False))
    eos = c.get("eos_token_id")
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    moe = {}
    if kind == "qwen3_moe":
        moe = dict(
            num_experts=c.get("num_experts", c.get("num_local_experts")),
            num_experts_per_tok=c["num_experts_per_tok"],
            moe_intermediate_size=c["moe_intermediate_size"],
            norm_topk_prob=bool(c.get("norm_topk_prob", False)),
            decoder_sparse_step=c.get("decoder_sparse_step", 1),
            mlp_only_layers=tuple(c.get("mlp_only_layers") or ()),
            router_aux_loss_coef=float(c.get("router_aux_loss_coef", 0.001)),
        )
    return ModelConfig(
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        num_layers=c["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=c.get("num_key_value_heads") or n_heads,
        head_dim=c.get("head_dim") or c["hidden_size"] // n_heads,
        intermediate_size=c["intermediate_size"],
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope=_rope_from_hf(c),
        max_position_embeddings=c.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        qkv_bias=True if kind == "qwen2" else attn_bias,
        o_bias=False if kind == "qwen2" else attn_bias,
        qk_norm=kind in ("qwen3", "qwen3_moe"),
        architecture=arch,
        bos_token_id=c.get("bos_token_id"),
        eos_token_id=eos,
        pad_token_id=c.get("pad_token_id"),
        **moe,
    )


def _rope_to_hf(r: RopeConfig) -> dict:
    out: dict[str, Any] = {"rope_type": r.type, "rope_theta": r.theta}
    if r.type in ("linear", "llama3", "yarn"):
        out["factor"] = r.factor
    if r.type == "llama3":
        out.update(low_freq_factor=r.low_freq_factor, high_freq_factor=r.high_freq_factor)
    if r.type in ("llama3", "yarn"):
        out["original_max_position_embeddings"] = r.original_max_position_embeddings
    if r.type == "yarn":
        out.update(beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
        out.update(attention_factor=r.attention_factor)
        out.update(mscale=r.mscale or None, mscale_all_dim=r.mscale_all_dim or None)
    return out


def _eos_to_hf(eos: tuple[int, ...]):
    return None if not eos else eos[0] if len(eos) == 1 else list(eos)


def _to_hf_dict(cfg: ModelConfig, torch_dtype: str) -> dict[str, Any]:
    rope = _rope_to_hf(cfg.rope)
    c: dict[str, Any] = {
        "architectures": [cfg.architecture],
        "model_type": cfg.model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "rope_theta": cfg.rope.theta,
        # v4 readers take rope_scaling (None for default RoPE); v5 readers take rope_parameters.
        "rope_scaling": (
            {k: v for k, v in rope.items() if k != "rope_theta"}
            if cfg.rope.type != "default"
            else None
        ),
        "rope_parameters": rope,
        "torch_dtype": torch_dtype,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": _eos_to_hf(cfg.eos_token_id),
        "pad_token_id": cfg.pad_token_id,
    }
    if cfg.model_type == "qwen2":
        if not cfg.qkv_bias or cfg.o_bias:
            raise ValueError("Qwen2ForCausalLM needs qkv_bias=True and o_bias=False")
    elif cfg.qkv_bias != cfg.o_bias:
        raise ValueError(f"{cfg.architecture} has one attention_bias for q/k/v/o; got differing")
    else:
        c["attention_bias"] = cfg.o_bias
    if cfg.model_type == "qwen3_moe":
        c.update(
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.num_experts_per_tok,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=cfg.norm_topk_prob,
            decoder_sparse_step=cfg.decoder_sparse_step,
            mlp_only_layers=list(cfg.mlp_only_layers),
            router_aux_loss_coef=cfg.router_aux_loss_coef,
        )
    return c
