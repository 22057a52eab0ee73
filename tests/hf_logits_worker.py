"""Run by the .hfvenv Python (torch + transformers): logits of HF checkpoint directories.

    .hfvenv/bin/python tests/hf_logits_worker.py OUT.npz TOKENS_JSON DIR [DIR ...]

Each DIR is loaded with ``AutoModelForCausalLM.from_pretrained`` (float32; a block-FP8
``quantization_config`` is handled by transformers itself) and run on the token rows; the
logits go to OUT.npz under ``logits_<i>``, with ``fp8_<i>``: how many of its linear layers
transformers built as FP8 layers.
"""

import json
import sys

import numpy as np
import torch
from transformers import AutoModelForCausalLM


def main(out, tokens_json, *dirs):
    tokens = torch.tensor(json.loads(tokens_json), dtype=torch.long)
    result = {}
    for i, d in enumerate(dirs):
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=tokens).logits.float().numpy()
        result[f"logits_{i}"] = logits
        result[f"fp8_{i}"] = np.int64(
            sum("fp8" in type(m).__name__.lower() for m in model.modules())
        )
    np.savez(out, **result)


if __name__ == "__main__":
    main(*sys.argv[1:])
