"""Serve our block-FP8 export with vLLM: it loads, and its greedy tokens follow our FP8 policy.

    python experiments/serve_check.py export DIR   # our side (JAX, CPU is enough)
    python experiments/serve_check.py serve DIR --out RESULT.json   # vLLM's side (a GPU)

``export`` writes a small random Qwen3 model (every size a multiple of 128, so every rule of
``models/hf/serving.py`` holds) through the rollout's FP8 recipe and ``save_fp8_checkpoint``,
with the fixture tokenizer, plus ``reference.json``: a few prompts and our W8A8 forward's greedy
next tokens. ``serve`` loads DIR with ``vllm.LLM`` (its ``Fp8Config`` reads the
``quantization_config``), generates greedily, and writes how many first tokens agree with ours
(random weights: a near tie may flip between two FP8 GEMM implementations, so the stage records
the agreement and fails only if vLLM cannot load or generate). Run by ``scripts/gpu_check.sh``
when vLLM is installed on the GPU machine.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKENIZER = os.path.join(REPO, "tests", "fixtures", "hf", "tokenizer")
PROMPTS = [[1, 20, 31, 42, 53, 64], [1, 7, 7, 7, 8], [1, 90, 12, 33, 44, 55, 66, 77]]


def export(out: str) -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from fp8rl_jax.generation import RolloutConfig, rollout_weights
    from fp8rl_jax.models import ModelConfig, forward, init_weights, save_fp8_checkpoint
    from fp8rl_jax.quant import QuantRecipe

    cfg = ModelConfig(
        vocab_size=128, hidden_size=256, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=128,
        intermediate_size=512, qk_norm=True, architecture="Qwen3ForCausalLM",
        max_position_embeddings=512, eos_token_id=(2,), bos_token_id=1,
    )  # fmt: skip
    params = init_weights(cfg, jax.random.key(0), jnp.float32)
    weights, _ = rollout_weights(params, RolloutConfig(quant=QuantRecipe()))
    save_fp8_checkpoint(out, cfg, weights, extra_files_from=TOKENIZER, overwrite=True)
    greedy = []
    for p in PROMPTS:
        logits = forward(weights, jnp.asarray([p], jnp.int32), cfg).logits_BTV
        greedy.append(int(np.argmax(np.asarray(logits[0, -1], np.float32))))
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump({"prompts": PROMPTS, "greedy_next": greedy}, f)
    print(f"exported to {out}: greedy next tokens {greedy}")


def serve(path: str, out: str) -> None:
    from vllm import LLM, SamplingParams

    with open(os.path.join(path, "reference.json")) as f:
        ref = json.load(f)
    llm = LLM(model=path, max_model_len=256, gpu_memory_utilization=0.3, enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ref["prompts"]]
    outs = llm.generate(prompts, params)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    agree = sum(t[0] == g for t, g in zip(tokens, ref["greedy_next"], strict=True))
    result = {"loaded": True, "tokens": tokens, "ours_first": ref["greedy_next"], "agree": agree}
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"vLLM served the FP8 export: first tokens agree with ours on {agree}/{len(tokens)}")
    assert all(len(t) == 8 for t in tokens), tokens


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cmd", choices=["export", "serve"])
    parser.add_argument("dir")
    parser.add_argument("--out", default="serve_check.json")
    args = parser.parse_args()
    export(args.dir) if args.cmd == "export" else serve(args.dir, args.out)


if __name__ == "__main__":
    main()
