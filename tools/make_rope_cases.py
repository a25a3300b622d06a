#!/usr/bin/env python3
"""Write fixtures/rope_cases.json: the RoPE inverse frequencies and attention
scaling transformers computes for each scaling variant bespoke supports, so
tests/engine.rs can check src/engine/mod.rs::Rope against them.

Uses the same pinned venv as tools/make_fixtures.py (transformers 5.23.0)."""
import json
import os
import sys

from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

CASES = [
    ("default", {"rope_theta": 10000.0}, 64, 2048),
    ("linear", {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0}, 64, 2048),
    ("llama3", {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}, 64, 131072),
    ("yarn", {"rope_theta": 1000000.0, "rope_type": "yarn", "factor": 4.0,
              "original_max_position_embeddings": 32768}, 128, 131072),
    ("yarn-mscale", {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 40.0, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 4096}, 64, 163840),
]


def main():
    out = []
    for name, params, head_dim, max_pos in CASES:
        cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                          max_position_embeddings=max_pos, rope_parameters=dict(params))
        kind = params.get("rope_type", "default")
        if kind == "default":
            inv, scale = ROPE_INIT_FUNCTIONS["default"](cfg, "cpu") if "default" in ROPE_INIT_FUNCTIONS else (None, 1.0)
            if inv is None:
                import torch
                inv = 1.0 / (params["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        else:
            inv, scale = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
        out.append({"name": name, "rope_parameters": params, "head_dim": head_dim,
                    "max_position_embeddings": max_pos, "inv_freq": [float(v) for v in inv.tolist()],
                    "attention_scaling": float(scale)})
    path = os.path.join(os.path.dirname(__file__), "..", "fixtures", "rope_cases.json")
    with open(path, "w") as f:
        json.dump({"generator": "tools/make_rope_cases.py", "transformers": __import__("transformers").__version__,
                   "cases": out}, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.normpath(path)}", file=sys.stderr)


if __name__ == "__main__":
    main()
