#!/usr/bin/env python3
"""Synthetic DeepSeek-V4-Flash-shaped checkpoint for whole-model benchmarks.

Writes a checkpoint in the RELEASE naming and storage formats of the real
DeepSeek-V4-Flash (the tensor list is `dsv4_release` in
src/model/layout.rs): real widths (hidden 4096, 64 heads x 512, q_lora 1024,
8 x 1024 o-groups, 256 experts x 2048 top-6, one shared expert, indexer
64 x 128, hc 4, vocab 129280), FP8 E4M3 dense matrices with UE8M0 128x128
block scales, FP4 E2M1 routed experts (I8, two nibbles per byte, low nibble =
even column) with UE8M0 per-32 scales, and BF16 / F32 / I64 tensors where the
release has them -- but only `--layers N` decoder layers and no MTP block.

The weights are random and chosen so that nothing overflows: FP8 codes of
moderate magnitude (never the NaN codes 0x7F / 0xFF), E8M0 scales 2^-7..2^-4
(bytes 120..123), uniform FP4 nibbles, BF16 ~ N(0, 0.02), norm weights 1.0,
small F32 hyper-connection tensors and valid expert ids in tid2eid. No
tokenizer is written (the vocabulary would not match; `bespoke bench e2e`
feeds token ids).

Usage:
    /work/pyenv/bin/python tools/make_dsv4_bench.py [--out DIR] [--layers N] [--seed S]

    ./target/release/bespoke inspect --model DIR --brief
    ./target/release/bespoke bench e2e --model DIR --prompt-len 16 --gen 8

Defaults: --out /tmp/bespoke-dsv4-flash-bench, --layers 3 (compress ratios
0, 4, 128: one sliding, one CSA and one HCA layer; num_hash_layers 1).
Three layers take about 13 GB (the 256 FP4 experts are ~3.4 GB per layer,
embed and head 1 GB each). Tensors are streamed one at a time, one shard
per layer plus one for the top-level tensors, with a
model.safetensors.index.json.
"""

import argparse
import json
import os
import sys
import time

import numpy as np

D = 4096
HEADS = 64
HEAD_DIM = 512
Q_LORA = 1024
O_GROUPS = 8
O_LORA = 1024
EXPERTS = 256
INTER = 2048
TOP_K = 6
SHARED = 1
IX_HEADS = 64
IX_DIM = 128
HC = 4
VOCAB = 129280
MIX = (2 + HC) * HC

CHUNK = 1 << 26  # elements generated at a time


def config(layers, ratios):
    return {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "vocab_size": VOCAB,
        "hidden_size": D,
        "num_hidden_layers": layers,
        "num_attention_heads": HEADS,
        "num_key_value_heads": 1,
        "head_dim": HEAD_DIM,
        "qk_rope_head_dim": 64,
        "q_lora_rank": Q_LORA,
        "o_lora_rank": O_LORA,
        "o_groups": O_GROUPS,
        "moe_intermediate_size": INTER,
        "n_routed_experts": EXPERTS,
        "n_shared_experts": SHARED,
        "num_experts_per_tok": TOP_K,
        "num_hash_layers": min(1, layers),
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "swiglu_limit": 10.0,
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",
        "sliding_window": 128,
        "index_n_heads": IX_HEADS,
        "index_head_dim": IX_DIM,
        "index_topk": 512,
        "hc_mult": HC,
        "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06,
        "rms_norm_eps": 1e-06,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "rope_scaling": {
            "type": "yarn",
            "factor": 16,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 1048576,
        # One entry per layer plus the (absent) MTP layer's, like the release.
        "compress_ratios": list(ratios) + [0],
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "expert_dtype": "fp4",
        # The real config says 1; this checkpoint has no MTP block.
        "num_nextn_predict_layers": 0,
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128],
            "activation_scheme": "dynamic",
        },
        "torch_dtype": "bfloat16",
    }


# ---- data generators: each yields bytes-like chunks totalling the tensor ----

ITEM = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1, "I64": 8}


def gen_bf16_normal(rng, n, std=0.02):
    done = 0
    while done < n:
        m = min(CHUNK, n - done)
        x = rng.standard_normal(m, dtype=np.float32) * np.float32(std)
        yield (x.view(np.uint32) >> 16).astype("<u2").tobytes()
        done += m


def gen_const_bf16(n, value=1.0):
    bits = np.array([value], dtype=np.float32).view(np.uint32)[0] >> 16
    yield np.full(n, bits, dtype="<u2").tobytes()


def gen_f32_normal(rng, n, std=0.01):
    yield (rng.standard_normal(n, dtype=np.float32) * np.float32(std)).astype("<f4").tobytes()


def gen_f32_zeros(n):
    yield np.zeros(n, dtype="<f4").tobytes()


def gen_fp8(rng, n):
    # sign | exponent 5..8 (values 2^-2 .. 2^1 x (1 + m/8)) | mantissa:
    # never 0x7F / 0xFF (exponent 15, mantissa 7).
    done = 0
    while done < n:
        m = min(CHUNK, n - done)
        r = np.frombuffer(rng.bytes(m), dtype=np.uint8)
        exp = (5 + ((r >> 3) & 3)).astype(np.uint8)
        yield ((r & 0x87) | (exp << 3)).tobytes()
        done += m


def gen_e8m0(rng, n):
    # 2^-7 .. 2^-4
    r = np.frombuffer(rng.bytes(n), dtype=np.uint8)
    yield (120 + (r & 3)).astype(np.uint8).tobytes()


def gen_random_bytes(rng, n):
    # FP4 packed nibbles: every E2M1 code is finite, so uniform bytes are fine.
    done = 0
    while done < n:
        m = min(CHUNK * 4, n - done)
        yield rng.bytes(m)
        done += m


def gen_tid2eid(rng, vocab, k):
    # Distinct expert ids per token: base + j * 43 (mod 256), j < k.
    base = rng.integers(0, EXPERTS, size=(vocab, 1), dtype=np.int64)
    ids = (base + np.arange(k, dtype=np.int64)[None, :] * 43) % EXPERTS
    yield ids.astype("<i8").tobytes()


# ---- tensor lists ----

def cdiv(a, b):
    return -(-a // b)


class Shard:
    def __init__(self):
        self.tensors = []  # (name, dtype, shape, make_gen)

    def add(self, name, dtype, shape, make_gen):
        self.tensors.append((name, dtype, list(shape), make_gen))

    def bf16(self, rng, name, shape, std=0.02):
        n = int(np.prod(shape))
        self.add(name, "BF16", shape, lambda: gen_bf16_normal(rng, n, std))

    def ones(self, name, shape):
        n = int(np.prod(shape))
        self.add(name, "BF16", shape, lambda: gen_const_bf16(n))

    def f32(self, rng, name, shape, std=0.01):
        n = int(np.prod(shape))
        self.add(name, "F32", shape, lambda: gen_f32_normal(rng, n, std))

    def f32_zeros(self, name, shape):
        n = int(np.prod(shape))
        self.add(name, "F32", shape, lambda: gen_f32_zeros(n))

    def fp8(self, rng, prefix, out, inp):
        self.add(f"{prefix}.weight", "F8_E4M3", [out, inp], lambda: gen_fp8(rng, out * inp))
        s = [cdiv(out, 128), cdiv(inp, 128)]
        self.add(f"{prefix}.scale", "F8_E8M0", s, lambda: gen_e8m0(rng, s[0] * s[1]))

    def fp4(self, rng, prefix, out, inp):
        self.add(f"{prefix}.weight", "I8", [out, inp // 2], lambda: gen_random_bytes(rng, out * inp // 2))
        self.add(f"{prefix}.scale", "F8_E8M0", [out, inp // 32], lambda: gen_e8m0(rng, out * inp // 32))

    def write(self, path):
        header = {}
        off = 0
        for name, dtype, shape, _ in self.tensors:
            size = ITEM[dtype] * int(np.prod(shape))
            header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + size]}
            off += size
        header["__metadata__"] = {"format": "pt"}
        h = json.dumps(header, separators=(",", ":")).encode()
        h += b" " * ((-len(h)) % 8)
        with open(path, "wb") as f:
            f.write(len(h).to_bytes(8, "little"))
            f.write(h)
            for name, dtype, shape, make_gen in self.tensors:
                want = ITEM[dtype] * int(np.prod(shape))
                got = 0
                for chunk in make_gen():
                    f.write(chunk)
                    got += len(chunk)
                if got != want:
                    raise RuntimeError(f"{name}: wrote {got} bytes, expected {want}")
        return [t[0] for t in self.tensors], 8 + len(h) + off


def top_shard(rng):
    s = Shard()
    s.bf16(rng, "embed.weight", [VOCAB, D])
    s.bf16(rng, "head.weight", [VOCAB, D])
    s.ones("norm.weight", [D])
    s.f32(rng, "hc_head_fn", [HC, HC * D])
    s.f32(rng, "hc_head_base", [HC])
    s.f32(rng, "hc_head_scale", [1])
    return s


def layer_shard(rng, l, ratio, hash_layer):
    s = Shard()
    p = f"layers.{l}"
    s.ones(f"{p}.attn_norm.weight", [D])
    s.ones(f"{p}.ffn_norm.weight", [D])
    for which in ("attn", "ffn"):
        s.f32(rng, f"{p}.hc_{which}_fn", [MIX, HC * D])
        s.f32(rng, f"{p}.hc_{which}_base", [MIX])
        s.f32(rng, f"{p}.hc_{which}_scale", [3])
    a = f"{p}.attn"
    s.fp8(rng, f"{a}.wq_a", Q_LORA, D)
    s.ones(f"{a}.q_norm.weight", [Q_LORA])
    s.fp8(rng, f"{a}.wq_b", HEADS * HEAD_DIM, Q_LORA)
    s.fp8(rng, f"{a}.wkv", HEAD_DIM, D)
    s.ones(f"{a}.kv_norm.weight", [HEAD_DIM])
    s.fp8(rng, f"{a}.wo_a", O_GROUPS * O_LORA, HEADS * HEAD_DIM // O_GROUPS)
    s.fp8(rng, f"{a}.wo_b", D, O_GROUPS * O_LORA)
    s.f32_zeros(f"{a}.attn_sink", [HEADS])
    if ratio != 0:
        c = 2 if ratio == 4 else 1
        cp = f"{a}.compressor"
        s.bf16(rng, f"{cp}.wkv.weight", [c * HEAD_DIM, D])
        s.bf16(rng, f"{cp}.wgate.weight", [c * HEAD_DIM, D])
        s.f32(rng, f"{cp}.ape", [ratio, c * HEAD_DIM])
        s.ones(f"{cp}.norm.weight", [HEAD_DIM])
        if ratio == 4:
            ip = f"{a}.indexer"
            s.fp8(rng, f"{ip}.wq_b", IX_HEADS * IX_DIM, Q_LORA)
            s.bf16(rng, f"{ip}.weights_proj.weight", [IX_HEADS, D])
            s.bf16(rng, f"{ip}.compressor.wkv.weight", [2 * IX_DIM, D])
            s.bf16(rng, f"{ip}.compressor.wgate.weight", [2 * IX_DIM, D])
            s.f32(rng, f"{ip}.compressor.ape", [ratio, 2 * IX_DIM])
            s.ones(f"{ip}.compressor.norm.weight", [IX_DIM])
    f = f"{p}.ffn"
    s.bf16(rng, f"{f}.gate.weight", [EXPERTS, D])
    if hash_layer:
        s.add(f"{f}.gate.tid2eid", "I64", [VOCAB, TOP_K], lambda: gen_tid2eid(rng, VOCAB, TOP_K))
    else:
        s.f32(rng, f"{f}.gate.bias", [EXPERTS])
    si = INTER * SHARED
    s.fp8(rng, f"{f}.shared_experts.w1", si, D)
    s.fp8(rng, f"{f}.shared_experts.w2", D, si)
    s.fp8(rng, f"{f}.shared_experts.w3", si, D)
    for x in range(EXPERTS):
        s.fp4(rng, f"{f}.experts.{x}.w1", INTER, D)
        s.fp4(rng, f"{f}.experts.{x}.w2", D, INTER)
        s.fp4(rng, f"{f}.experts.{x}.w3", INTER, D)
    return s


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="/tmp/bespoke-dsv4-flash-bench")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.layers < 1:
        sys.exit("--layers must be at least 1")
    cycle = [0, 4, 128]
    ratios = [cycle[l] if l < 3 else (4 if l % 2 == 0 else 128) for l in range(args.layers)]
    os.makedirs(args.out, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    t0 = time.time()
    n_shards = args.layers + 1
    weight_map = {}
    total = 0
    shards = [("top", lambda: top_shard(rng))] + [
        (f"layer {l}", (lambda l=l: layer_shard(rng, l, ratios[l], l < min(1, args.layers))))
        for l in range(args.layers)
    ]
    for i, (what, make) in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{n_shards:05d}.safetensors"
        names, size = make().write(os.path.join(args.out, fname))
        for n in names:
            weight_map[n] = fname
        total += size
        print(f"  {fname} ({what}): {size / 1e9:.2f} GB, {time.time() - t0:.0f} s", flush=True)
    with open(os.path.join(args.out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config(args.layers, ratios), f, indent=1)
    print(f"wrote {args.out}: {args.layers} layers (compress_ratios {ratios}), "
          f"{total / 1e9:.2f} GB in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
