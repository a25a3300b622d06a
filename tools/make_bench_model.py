#!/usr/bin/env python3
"""Write a random Llama-architecture checkpoint for speed measurements
(`bespoke bench e2e`), sized to dwarf the last-level cache. Not a fixture:
the output is large and is written where you say (default /tmp/bespoke-bench-llama).

    python3 tools/make_bench_model.py [--out DIR] [--hidden 2048] [--layers 8] ...

With --experts E it writes a Qwen3-MoE checkpoint instead (E routed experts
a layer of --moe-intermediate columns, --top-k chosen per token, Qwen3's q/k
norms): the shape of model the VRAM tier splits between the GPU and the CPU.

Needs only numpy. The weights are random BF16 (values ~N(0, 0.02)), so the
text is gibberish; the speed is what counts."""
import argparse
import json
import os

import numpy as np


def bf16_bytes(rng, shape, std):
    x = (rng.standard_normal(size=shape, dtype=np.float32) * std).astype(np.float32)
    return (x.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/bespoke-bench-llama")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--experts", type=int, default=0, help="routed experts a layer (0: a dense Llama)")
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--moe-intermediate", type=int, default=768)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    d, i, hd = a.hidden, a.intermediate, a.hidden // a.heads
    cfg = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
        "intermediate_size": i, "num_hidden_layers": a.layers, "num_attention_heads": a.heads,
        "num_key_value_heads": a.kv_heads, "head_dim": hd, "vocab_size": a.vocab,
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
    }
    if a.experts > 0:
        cfg.update({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": a.experts,
            "num_experts_per_tok": a.top_k, "moe_intermediate_size": a.moe_intermediate,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        })
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    shapes = [("model.embed_tokens.weight", [a.vocab, d])]
    for l in range(a.layers):
        p = f"model.layers.{l}"
        shapes += [
            (f"{p}.input_layernorm.weight", [d]), (f"{p}.post_attention_layernorm.weight", [d]),
            (f"{p}.self_attn.q_proj.weight", [a.heads * hd, d]), (f"{p}.self_attn.k_proj.weight", [a.kv_heads * hd, d]),
            (f"{p}.self_attn.v_proj.weight", [a.kv_heads * hd, d]), (f"{p}.self_attn.o_proj.weight", [d, a.heads * hd]),
        ]
        if a.experts > 0:
            m = a.moe_intermediate
            shapes += [(f"{p}.self_attn.q_norm.weight", [hd]), (f"{p}.self_attn.k_norm.weight", [hd]),
                       (f"{p}.mlp.gate.weight", [a.experts, d])]
            for e in range(a.experts):
                x = f"{p}.mlp.experts.{e}"
                shapes += [(f"{x}.gate_proj.weight", [m, d]), (f"{x}.up_proj.weight", [m, d]),
                           (f"{x}.down_proj.weight", [d, m])]
        else:
            shapes += [(f"{p}.mlp.gate_proj.weight", [i, d]), (f"{p}.mlp.up_proj.weight", [i, d]),
                       (f"{p}.mlp.down_proj.weight", [d, i])]
    shapes += [("model.norm.weight", [d]), ("lm_head.weight", [a.vocab, d])]
    header, offset = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape)) * 2
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    rng = np.random.default_rng(0)
    path = os.path.join(a.out, "model.safetensors")
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, shape in shapes:
            if name.endswith("norm.weight"):
                f.write(np.full(shape, 0x3F80, dtype=np.uint16).tobytes())  # 1.0
            else:
                f.write(bf16_bytes(rng, shape, 0.02))
    print(f"wrote {a.out}: {offset / 2**30:.2f} GiB of BF16 weights")


if __name__ == "__main__":
    main()
