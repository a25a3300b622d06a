#!/usr/bin/env python3
"""Generate the tiny reference-model fixtures under fixtures/<name>/.

Every fixture is a complete Hugging Face style model directory (config.json,
model.safetensors, tokenizer.json, tokenizer_config.json,
generation_config.json) plus ref.json: what transformers computes for it in
float32 (teacher-forcing argmax, 24 greedy tokens, the first prompt's final
logits). The Rust engine must agree with ref.json token for token.
fixtures/README.md documents each fixture and the ref.json schema.

Nothing is downloaded: the weights are random (fixed seeds) and the byte-level
BPE tokenizer is trained here on a small corpus embedded in this file.

Pinned versions (the reference numbers depend on them; a mismatch is an error
unless --allow-version-mismatch is given, which downgrades it to a warning):
    torch==2.15.0 transformers==5.23.0 tokenizers==0.23.3 safetensors==0.8.0
    numpy==2.4.6 ml-dtypes==0.6.0 jinja2==3.1.6 accelerate==1.15.0
(accelerate is only needed for the check that transformers loads the
quantized DeepSeek V4 directory by itself.)

Run from the repository root:
    python3 tools/make_fixtures.py                  # all fixtures into fixtures/
    python3 tools/make_fixtures.py --only tiny-dsv4 # one fixture
    python3 tools/make_fixtures.py --out /tmp/fx    # somewhere else
"""

import argparse
import copy
import importlib.metadata
import json
import math
import os
import sys
import time
import zlib

PINNED = {
    "torch": "2.15.0",
    "transformers": "5.23.0",
    "tokenizers": "0.23.3",
    "safetensors": "0.8.0",
    "numpy": "2.4.6",
    "ml-dtypes": "0.6.0",
    "jinja2": "3.1.6",
    "accelerate": "1.15.0",
}


def installed_version(dist):
    try:
        v = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    return v.split("+", 1)[0]  # torch reports e.g. 2.15.0+cu132


def check_versions(allow_mismatch):
    bad = []
    for dist, want in PINNED.items():
        got = installed_version(dist)
        if got != want:
            bad.append(f"{dist}: pinned {want}, installed {got}")
    if bad:
        msg = "make_fixtures: version mismatch:\n  " + "\n  ".join(bad)
        if not allow_mismatch:
            sys.exit(msg + "\n(the reference numbers depend on these versions; "
                     "pass --allow-version-mismatch to run anyway)")
        print(msg + "\n(continuing: --allow-version-mismatch)", file=sys.stderr)


# Third-party packages (a missing one fails here; main() checks the versions).
import numpy as np  # noqa: E402
import ml_dtypes  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402

GREEDY_NEW_TOKENS = 24
MIN_MARGIN = 1e-3
# Router and indexer top-k choices must not be near ties either: a flipped
# expert or compressed entry changes everything downstream (a candidate seed
# with an exact indexer tie made transformers' cached and uncached greedy
# decoding disagree).
MIN_SELECTION_MARGIN = 1e-4
COMPUTE_DTYPE = torch.float32

# ---------------------------------------------------------------------------
# JSON: dicts one key per line, lists of scalars on one line (token ids and
# logits stay readable and diffs stay small).
# ---------------------------------------------------------------------------


def _scalar(x):
    if isinstance(x, float):
        if not math.isfinite(x):
            raise ValueError(f"non-finite float {x} in JSON output")
        return repr(x)  # shortest text that reads back as the same double
    return json.dumps(x, ensure_ascii=False)


def to_json(obj, level=0):
    pad = "  " * level
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        rows = [f"{pad}  {json.dumps(str(k), ensure_ascii=False)}: {to_json(v, level + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(rows) + "\n" + pad + "}"
    if isinstance(obj, (list, tuple)):
        if all(not isinstance(x, (dict, list, tuple)) for x in obj):
            return "[" + ", ".join(_scalar(x) for x in obj) + "]"
        rows = [f"{pad}  {to_json(x, level + 1)}" for x in obj]
        return "[\n" + ",\n".join(rows) + "\n" + pad + "]"
    return _scalar(obj)


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        f.write(to_json(obj) + "\n")


# ---------------------------------------------------------------------------
# Tokenizer: byte-level BPE, 512 entries, trained on the corpus below.
# ---------------------------------------------------------------------------

VOCAB_SIZE = 512
# Fixed ids: the model configs refer to them (tiny-llama's bos 1 / eos 2 predate
# this script).
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>"]
UNK_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID = range(6)

# ChatML-style, written with '\n' escapes inside Jinja string literals the way
# real templates are.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

CORPUS = """\
The old lighthouse stood at the end of a narrow spit of land, where the river
met the sea. Every evening the keeper climbed its ninety-two steps, trimmed the
wick, and watched the beam sweep across the water. Ships that passed at night
saw the light turn once every twelve seconds; sailors called it the patient eye.

In the spring of 1987 the town council voted 7 to 2 to replace the lamp with an
electric one. The new bulb cost $1,250.00, used 400 watts, and could be seen
from 18.5 miles away. Not everyone was pleased: "A machine does not care who is
out there," said Mrs. Alder, who had lived on Harbour Street for 63 years.

Consider a simple recipe for bread. Mix 500 g of flour, 10 g of salt, 7 g of
yeast and 350 ml of warm water. Knead the dough for ten minutes, then let it
rise for about an hour (longer if the kitchen is cold). Shape it, bake it at
220 degrees for 30-35 minutes, and let it cool before you cut it!

Numbers have their own small grammar. We write 3.14159 for pi, 2^10 = 1024,
and 1/3 is about 0.333. A phone number might look like 555-0142; a date might be
2024-03-15 or 15/03/2024. Prices, times and scores: 9:45 am, 3-1, 100%, #7.

The students asked their teacher why the sky is blue. She explained that
sunlight is made of many colours, and that the air scatters the short blue waves
more than the long red ones. "So at sunset," one of them asked, "the light goes
through more air?" Yes, she said, and that is why the evening turns orange.

Questions help us think. What is a tree, if not a slow fountain of wood? Where
does a river begin, and where does it end? When the wind blows from the north,
the birds fly low; when it blows from the south, they rise and sing. Some
people keep notes in a small book, others in their heads, and a few, it seems,
keep nothing at all and remember everything anyway.

A good program reads its input, checks it, and says clearly what went wrong.
It should never guess. If a file is missing, it names the file; if a number is
out of range, it prints the number and the range. The user can then fix the
problem in one step instead of ten.

On Saturday morning the market opened at eight. There were apples and pears,
fresh eggs, cheese from the hills, honey in glass jars, and a man who sharpened
knives while he told stories about the war. Children ran between the stalls;
their parents counted coins and argued, politely, about the price of onions.
By noon the square was quiet again, and the pigeons came back for the crumbs.

Winter arrived early that year. The first snow fell in October, then again in
November, and by December the roads to the north were closed for weeks. People
stayed inside, read old books, mended their coats, and wrote long letters to
friends far away. In the spring, when the ice on the river finally broke, the
whole town went down to the water to listen to it crack and groan.
"""


def train_tokenizer():
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = [p.replace("\n", " ").strip() + "\n" for p in CORPUS.split("\n\n")]
    tok.train_from_iterator(lines, trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit(f"tokenizer: trained {tok.get_vocab_size()} entries, wanted {VOCAB_SIZE}")
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:
            raise SystemExit(f"tokenizer: {name} got id {tok.token_to_id(name)}, wanted {i}")
    return tok


def tokenizer_json(base, add_bos):
    """The trained tokenizer, with a post-processor that prepends <s> when the
    model family does (Llama, DeepSeek) and none when it does not (Qwen)."""
    tok = Tokenizer.from_str(base.to_str())
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)]
        )
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def write_tokenizer(dirname, base, add_bos):
    tok = tokenizer_json(base, add_bos)
    tok.save(os.path.join(dirname, "tokenizer.json"), pretty=False)  # pretty is 2.5x larger
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 4096,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "add_bos_token": add_bos,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "chat_template": CHAT_TEMPLATE,
    }
    write_json(os.path.join(dirname, "tokenizer_config.json"), cfg)


PROMPTS = [
    ("short", "The old river is"),
    ("medium", "The students asked why the evening light turns orange."),
    (
        "long",
        "A good program reads its input and says clearly what went wrong. If a file is missing, it names "
        "the file; if a number is out of range, it prints the number and the range. The old lighthouse "
        "stood at the end of the land.",
    ),
]

TOKENIZER_CASES = [
    "Hello, world!",
    "The old lighthouse stood at the end of a narrow spit of land.",
    "  two leading spaces, a tab\tand a newline\nhere",
    "Prices: $1,250.00 and 18.5 miles; 2^10 = 1024; 100%!",
    "ünïcödé, emoji 🙂 and 中文",
    "<|im_start|>user\nHi there<|im_end|>",
    "",
]

CHAT_CASE = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What does the lighthouse keeper do every evening?"},
]

# ---------------------------------------------------------------------------
# Number formats (exactly as the real DeepSeek V4 checkpoints store them).
# ---------------------------------------------------------------------------

FP8_BLOCK = 128
FP8_MAX = 448.0
FP4_GROUP = 32
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _pow2(e):
    return torch.pow(torch.tensor(2.0, dtype=torch.float64), e.to(torch.float64)).to(torch.float32)


def quantize_fp8(w):
    """w float32 [out, in] -> (e4m3fn codes [out, in], e8m0 scales
    [ceil(out/128), ceil(in/128)]). One power-of-two scale per 128x128 block,
    the smallest with max|w|/scale <= 448."""
    out_f, in_f = w.shape
    so, si = -(-out_f // FP8_BLOCK), -(-in_f // FP8_BLOCK)
    exps = torch.zeros(so, si, dtype=torch.int32)
    codes = torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn)
    for bo in range(so):
        for bi in range(si):
            rows = slice(bo * FP8_BLOCK, (bo + 1) * FP8_BLOCK)
            cols = slice(bi * FP8_BLOCK, (bi + 1) * FP8_BLOCK)
            block = w[rows, cols].double()
            amax = float(block.abs().max())
            e = math.ceil(math.log2(amax / FP8_MAX)) if amax > 0 else -127
            while amax / 2.0**e > FP8_MAX:
                e += 1
            exps[bo, bi] = e
            codes[rows, cols] = (block / 2.0**e).float().to(torch.float8_e4m3fn)
    scales = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return codes, scales


def dequantize_fp8(codes, scales):
    e = scales.view(torch.uint8).to(torch.int32) - 127
    s = _pow2(e).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return codes.float() * s[: codes.shape[0], : codes.shape[1]]


def quantize_fp4(w):
    """w float32 [out, in] (in % 32 == 0) -> (int8 [out, in/2] two E2M1 nibbles
    per byte, low nibble = even column; e8m0 scales [out, in/32])."""
    out_f, in_f = w.shape
    g = w.double().view(out_f, in_f // FP4_GROUP, FP4_GROUP)
    amax = g.abs().amax(-1)
    e = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    e = torch.where(amax > 0, e, torch.full_like(e, -127))
    e = e + (amax / torch.pow(2.0, e.double()) > 6.0).to(torch.int32)
    q = g / torch.pow(2.0, e.double()).unsqueeze(-1)
    mag = (q.abs().unsqueeze(-1) - E2M1_VALUES.double()).abs().argmin(-1)
    code = (mag | (torch.signbit(q).to(torch.int64) << 3)).view(out_f, in_f).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    scales = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return packed.view(torch.int8), scales


def dequantize_fp4(packed, scales):
    u = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack([u & 0xF, u >> 4], dim=-1).view(u.shape[0], -1)
    lut = torch.cat([E2M1_VALUES, -E2M1_VALUES])
    vals = lut[codes]
    e = scales.view(torch.uint8).to(torch.int32) - 127
    return vals * _pow2(e).repeat_interleave(FP4_GROUP, 1)


def ml_dtypes_dequantize(codes, scales, kind):
    """Independent decode of the stored bytes with ml_dtypes (cross-check)."""
    s = scales.view(torch.uint8).numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    if kind == "fp8":
        v = codes.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
        s = np.repeat(np.repeat(s, FP8_BLOCK, 0), FP8_BLOCK, 1)[: v.shape[0], : v.shape[1]]
    else:
        u = codes.view(torch.uint8).numpy()
        nib = np.stack([u & 0xF, u >> 4], axis=-1).reshape(u.shape[0], -1)
        v = nib.astype(np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
        s = np.repeat(s, FP4_GROUP, 1)
    return torch.from_numpy(v * s)


# ---------------------------------------------------------------------------
# Deterministic random tensors: one generator per tensor, seeded from the
# fixture seed and the tensor's name, so adding a tensor never shifts another.
# ---------------------------------------------------------------------------


class Rand:
    def __init__(self, seed):
        self.seed = seed

    def gen(self, name):
        return torch.Generator().manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    def normal(self, name, shape, std=1.0, mean=0.0):
        return torch.randn(*shape, generator=self.gen(name)) * std + mean

    def uniform(self, name, shape, lo, hi):
        return torch.rand(*shape, generator=self.gen(name)) * (hi - lo) + lo

    def linear(self, name, out_f, in_f, gain=1.0):
        return self.normal(name, (out_f, in_f), gain / math.sqrt(in_f))

    def norm(self, name, n, center=1.0):
        return self.normal(name, (n,), 0.1, center)

    def block_gains(self, name, w):
        """Multiply every 128x128 block by its own power of two (1/2, 1 or 2) so
        that the blocks of one FP8 weight get different scales."""
        so, si = -(-w.shape[0] // FP8_BLOCK), -(-w.shape[1] // FP8_BLOCK)
        k = torch.randint(-1, 2, (so, si), generator=self.gen(name + "#gain")).float()
        g = torch.pow(2.0, k).repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
        return w * g[: w.shape[0], : w.shape[1]]


def bf16(t):
    return t.to(torch.bfloat16)


# ---------------------------------------------------------------------------
# Reference computation.
# ---------------------------------------------------------------------------


def margins(logits):
    top = logits.float().topk(2, dim=-1).values
    return top[..., 0] - top[..., 1]


class Probe:
    """Forward hooks that measure how close the model's discrete choices come
    to a tie (router top-k, indexer top-k) and how often swiglu_limit clamps.
    Margins are taken on full forwards from position 0 (teacher forcing and
    the uncached greedy steps); clamp counts on the teacher-forcing forwards."""

    def __init__(self, model, kind):
        self.router_margin = math.inf
        self.indexer_margin = math.inf
        self.clamp = {}
        self.handles = []
        self.margins_on = False
        self.count_on = False
        getattr(self, kind)(model)

    def close(self):
        for h in self.handles:
            h.remove()

    def summary(self):
        out = {}
        if self.router_margin < math.inf:
            out["min_router_topk_margin"] = self.router_margin
        if self.indexer_margin < math.inf:
            out["min_indexer_topk_margin"] = self.indexer_margin
        if self.clamp:
            out["swiglu_limit_clamped"] = self.clamp
        return out

    def _kth_gap(self, values, k):
        if not self.margins_on or values.shape[-1] <= k:
            return
        v = values.double().sort(dim=-1, descending=True).values
        self.router_margin = min(self.router_margin, float((v[..., k - 1] - v[..., k]).min()))

    def _count(self, key, t, limit, lower):
        if not self.count_on:
            return
        c = self.clamp.setdefault(key, {"values": 0, "above_limit": 0, "below_minus_limit": 0})
        c["values"] += t.numel()
        c["above_limit"] += int((t > limit).sum())
        if lower:
            c["below_minus_limit"] += int((t < -limit).sum())
        else:
            c.pop("below_minus_limit", None)

    def qwen3_moe(self, model):
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

        for m in model.modules():
            if isinstance(m, Qwen3MoeTopKRouter):
                def hook(mod, args, out):
                    self._kth_gap(torch.softmax(out[0].float(), dim=-1), mod.top_k)
                self.handles.append(m.register_forward_hook(hook))

    def dsv4(self, model):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m4

        limit = model.config.swiglu_limit
        for m in model.modules():
            if isinstance(m, m4.DeepseekV4TopKRouter):
                def hook(mod, args, out):
                    flat = args[0].reshape(-1, mod.hidden_dim)
                    scores = mod.score_fn(F.linear(flat, mod.weight))
                    self._kth_gap(scores + mod.e_score_correction_bias, mod.top_k)
                self.handles.append(m.register_forward_hook(hook))
            elif isinstance(m, m4.DeepseekV4Indexer):
                def score_hook(mod, args, out, _idx=m):
                    # out: [B, S, T] index scores of a full forward from position 0
                    if not self.margins_on:
                        return
                    for s in range(out.shape[1]):
                        n_valid = min((s + 1) // _idx.compress_rate, out.shape[-1])
                        if n_valid > _idx.index_topk:
                            v = out[0, s, :n_valid].double().sort(descending=True).values
                            gap = float(v[_idx.index_topk - 1] - v[_idx.index_topk])
                            self.indexer_margin = min(self.indexer_margin, gap)
                self.handles.append(m.scorer.register_forward_hook(score_hook))
            elif isinstance(m, m4.DeepseekV4MLP):
                def g_hook(mod, args, out):
                    self._count("shared_gate", out, limit, False)

                def u_hook(mod, args, out):
                    self._count("shared_up", out, limit, True)
                self.handles.append(m.gate_proj.register_forward_hook(g_hook))
                self.handles.append(m.up_proj.register_forward_hook(u_hook))
            elif isinstance(m, m4.DeepseekV4Experts):
                def pre_hook(mod, args):
                    hidden, idx = args[0], args[1]
                    for e in idx.unique().tolist():
                        if e >= mod.num_experts:
                            continue
                        rows = (idx == e).any(-1)
                        gate, up = F.linear(hidden[rows], mod.gate_up_proj[e]).chunk(2, dim=-1)
                        self._count("routed_gate", gate, limit, False)
                        self._count("routed_up", up, limit, True)
                self.handles.append(m.register_forward_pre_hook(pre_hook))


@torch.no_grad()
def reference(model, prompts, probe=None):
    """Teacher forcing, cached and uncached greedy decoding, margins."""
    model.eval()
    gen_cfg = model.generation_config
    gen_cfg.eos_token_id = None  # always decode GREEDY_NEW_TOKENS tokens; never stop early
    gen_cfg.pad_token_id = PAD_ID

    def probing(margins_on, count_on):
        if probe:
            probe.margins_on, probe.count_on = margins_on, count_on

    results, max_cache_diff, worst, last = [], 0.0, None, None
    for name, text, ids in prompts:
        x = torch.tensor([ids])
        probing(True, True)
        logits = model(x, use_cache=False).logits[0]
        probing(True, False)
        tf_margins = margins(logits)
        argmax = logits.argmax(-1).tolist()
        if last is None:
            last = logits[-1].float().tolist()

        seq, greedy, un_logits = list(ids), [], []
        for _ in range(GREEDY_NEW_TOKENS):
            step = model(torch.tensor([seq]), use_cache=False).logits[0, -1]
            tok = int(step.argmax())
            greedy.append(tok)
            un_logits.append(step)
            seq.append(tok)
        un_logits = torch.stack(un_logits).float()

        probing(False, False)  # cached decoding does not start at position 0
        out = model.generate(
            x, max_new_tokens=GREEDY_NEW_TOKENS, do_sample=False, use_cache=True,
            return_dict_in_generate=True, output_logits=True, generation_config=gen_cfg,
        )
        cached = out.sequences[0, len(ids):].tolist()
        cached_logits = torch.stack([l[0] for l in out.logits]).float()
        if cached != greedy:
            raise SystemExit(f"{name}: cached greedy {cached} != uncached {greedy}")
        if argmax[-1] != greedy[0]:
            raise SystemExit(f"{name}: teacher-forcing argmax {argmax[-1]} != first greedy token {greedy[0]}")
        max_cache_diff = max(max_cache_diff, float((cached_logits - un_logits).abs().max()))
        g_margins = torch.minimum(margins(un_logits), margins(cached_logits))
        i_tf, i_g = int(tf_margins.argmin()), int(g_margins.argmin())
        m_tf, m_g = float(tf_margins[i_tf]), float(g_margins[i_g])
        m = min(m_tf, m_g)
        if worst is None or m < worst[0]:
            worst = (m, {"prompt": name, "kind": "teacher_forcing" if m_tf <= m_g else "greedy_step",
                         "index": i_tf if m_tf <= m_g else i_g})
        results.append({"name": name, "text": text, "ids": ids, "argmax": argmax, "greedy": greedy,
                        "min_margin": m})
    return {
        "prompts": results,
        "min_margin": worst[0],
        "min_margin_at": worst[1],
        "cached_vs_uncached_max_abs_logit_diff": max_cache_diff,
        "last_logits": last,
    }


def run_reference(model, prompts, probe_kind=None):
    probe = Probe(model, probe_kind) if probe_kind else None
    ref = reference(model, prompts, probe)
    if probe:
        probe.close()
        ref["selection"] = probe.summary()
    return ref


def versions():
    import safetensors
    import tokenizers
    import transformers

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "safetensors": safetensors.__version__,
    }


def finish_ref(name, ref, seed, add_bos, extra=None):
    if not ref["min_margin"] > MIN_MARGIN:
        raise SystemExit(f"{name}: min top-1/top-2 logit margin {ref['min_margin']:.3g} <= {MIN_MARGIN} "
                         f"at {ref['min_margin_at']}: change the seed or the scales")
    for key in ("min_router_topk_margin", "min_indexer_topk_margin"):
        got = ref.get("selection", {}).get(key)
        if got is not None and not got > MIN_SELECTION_MARGIN:
            raise SystemExit(f"{name}: {key} {got:.3g} <= {MIN_SELECTION_MARGIN}: change the seed or the scales")
    doc = {
        "schema": "bespoke-ref/1",
        "model": name,
        "generator": "tools/make_fixtures.py",
        "versions": versions(),
        "seed": seed,
        "compute_dtype": "float32",
        "attn_implementation": "eager",
        "experts_implementation": "eager",
        "bos_prepended": add_bos,
        "greedy_new_tokens": GREEDY_NEW_TOKENS,
        "greedy_stops_at_eos": False,
    }
    doc.update(ref)
    doc["last_logits_prompt"] = ref["prompts"][0]["name"]
    if extra:
        doc.update(extra)
    # keep the long list last
    doc["last_logits"] = doc.pop("last_logits")
    return doc


def model_prompts(tok_fast):
    return [(name, text, tok_fast(text)["input_ids"]) for name, text in PROMPTS]


def load_tokenizer(dirname):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(dirname)


def assert_same_logits(name, a, b, prompts):
    with torch.no_grad():
        for _, _, ids in prompts:
            x = torch.tensor([ids])
            la, lb = a(x, use_cache=False).logits, b(x, use_cache=False).logits
            if not torch.equal(la, lb):
                raise SystemExit(f"{name}: reloaded model differs, max |diff| {float((la - lb).abs().max()):.3g}")


def load_pretrained(cls, dirname, **kw):
    return cls.from_pretrained(dirname, dtype=COMPUTE_DTYPE, attn_implementation="eager",
                               experts_implementation="eager", **kw).eval()


def build_from_config(cls, dirname):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(dirname)
    return cls.from_config(config, dtype=COMPUTE_DTYPE, attn_implementation="eager",
                            experts_implementation="eager").eval()


def load_exact(model, state):
    """Load every persistent tensor of the model from `state` (strict)."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise SystemExit(f"{k}: shape {tuple(v.shape)} != model's {tuple(own[k].shape)}")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in state.items()}, strict=True)


def save_safetensors(path, tensors):
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata={"format": "pt"})
    os.chmod(path, 0o644)


def write_generation_config(dirname):
    write_json(os.path.join(dirname, "generation_config.json"),
               {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID, "do_sample": False})


# ---------------------------------------------------------------------------
# Dense and Qwen3-MoE fixtures (Hugging Face names, BF16).
# ---------------------------------------------------------------------------

LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 72,
    "intermediate_size": 136,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 18,
    "vocab_size": 512,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-05,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

QWEN3_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

# Qwen2 (Qwen2.5 style): q/k/v projections with biases, o_proj without, no
# q/k norm, head_dim = hidden / heads (Qwen2 configs carry no head_dim). RoPE
# scaling in the legacy `rope_scaling` form Qwen2.5 checkpoints ship
# ("type": "yarn", top-level rope_theta); transformers 5.23 turns it into
# rope_parameters {rope_type: yarn, factor 2, original_max_position_embeddings
# 128, rope_theta 1e6} (recorded in ref.json's transformers_config).
QWEN2_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128},
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}

# Qwen2 attention biases, in units of the typical projection output (a unit
# RMS input through a 1/sqrt(in) weight gives outputs of about 1): large enough
# that dropping any one of them changes most tokens. The v bias is smaller: it
# passes the softmax unchanged, so through o_proj (OUT_GAIN) it adds one
# constant vector to every position, and at std 1 that vector dominated the
# residual and greedy decoding collapsed onto one token.
QWEN2_BIAS_STD = {"q": 1.0, "k": 1.5, "v": 0.3}

QWEN3_MOE_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [1],
    "hidden_act": "silu",
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 2,
    "output_router_logits": False,
    "router_aux_loss_coef": 0.001,
    "tie_word_embeddings": False,
    "use_cache": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


# Attention and MLP outputs several times larger than an embedding row: with
# unit-scale outputs the residual stays dominated by the input embedding and a
# tied head just predicts the input token again (argmax[i] == ids[i]), which
# would let a broken attention or MLP pass unnoticed.
OUT_GAIN = 8.0


def dense_weights(cfg, rand):
    """HF-named float32 tensors (already rounded through BF16) for llama/qwen3/
    qwen3_moe; MoE experts per expert, the way the real checkpoints ship them."""
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim", D // H)
    qk_norm = cfg["model_type"] in ("qwen3", "qwen3_moe")
    qkv_bias = cfg["model_type"] == "qwen2"
    t = {"model.embed_tokens.weight": rand.normal("embed", (V, D))}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = rand.normal("head", (V, D))
    t["model.norm.weight"] = rand.norm("norm", D)
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = rand.norm(p + "ln1", D)
        t[p + "post_attention_layernorm.weight"] = rand.norm(p + "ln2", D)
        a = p + "self_attn."
        t[a + "q_proj.weight"] = rand.linear(a + "q", H * hd, D)
        t[a + "k_proj.weight"] = rand.linear(a + "k", KV * hd, D, 1.5)
        t[a + "v_proj.weight"] = rand.linear(a + "v", KV * hd, D)
        t[a + "o_proj.weight"] = rand.linear(a + "o", D, H * hd, OUT_GAIN)
        if qkv_bias:
            for x, n in (("q", H * hd), ("k", KV * hd), ("v", KV * hd)):
                t[a + f"{x}_proj.bias"] = rand.normal(a + x + "b", (n,), QWEN2_BIAS_STD[x])
        if qk_norm:
            t[a + "q_norm.weight"] = rand.norm(a + "qn", hd)
            t[a + "k_norm.weight"] = rand.norm(a + "kn", hd, 1.5)
        m = p + "mlp."
        moe = cfg["model_type"] == "qwen3_moe" and i not in cfg["mlp_only_layers"] and \
            (i + 1) % cfg["decoder_sparse_step"] == 0
        if moe:
            E, I = cfg["num_experts"], cfg["moe_intermediate_size"]
            t[m + "gate.weight"] = rand.linear(m + "router", E, D, 2.0)
            for e in range(E):
                x = f"{m}experts.{e}."
                t[x + "gate_proj.weight"] = rand.linear(x + "g", I, D)
                t[x + "up_proj.weight"] = rand.linear(x + "u", I, D)
                t[x + "down_proj.weight"] = rand.linear(x + "d", D, I, OUT_GAIN)
        else:
            I = cfg["intermediate_size"]
            t[m + "gate_proj.weight"] = rand.linear(m + "g", I, D)
            t[m + "up_proj.weight"] = rand.linear(m + "u", I, D)
            t[m + "down_proj.weight"] = rand.linear(m + "d", D, I, OUT_GAIN)
    return {k: bf16(v).float() for k, v in t.items()}


def fuse_experts(state):
    """Per-expert HF names -> the fused tensors transformers 5 keeps internally
    (experts.gate_up_proj [E, 2I, D] = all gate rows then all up rows;
    experts.down_proj [E, D, I])."""
    out, groups = {}, {}
    for k, v in state.items():
        if ".mlp.experts." in k:
            prefix, rest = k.split(".mlp.experts.")
            e, proj = rest.split(".")[0], rest.split(".")[1]
            groups.setdefault(prefix, {}).setdefault(int(e), {})[proj] = v
        else:
            out[k] = v
    for prefix, experts in groups.items():
        E = len(experts)
        out[prefix + ".mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]], 0) for e in range(E)])
        out[prefix + ".mlp.experts.down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(E)])
    return out


def make_dense(name, cfg, seed, add_bos, out_dir, base_tok):
    from transformers import AutoModelForCausalLM

    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    write_json(os.path.join(d, "config.json"), copy.deepcopy(cfg))
    write_tokenizer(d, base_tok, add_bos)
    write_generation_config(d)
    tok = load_tokenizer(d)
    prompts = model_prompts(tok)

    rand = Rand(seed)
    state = dense_weights(cfg, rand)
    model = build_from_config(AutoModelForCausalLM, d)
    internal = fuse_experts(state)
    if cfg["tie_word_embeddings"]:
        internal["lm_head.weight"] = internal["model.embed_tokens.weight"]
    load_exact(model, internal)
    if cfg["tie_word_embeddings"]:
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    save_safetensors(os.path.join(d, "model.safetensors"), {k: bf16(v) for k, v in state.items()})

    ref = run_reference(model, prompts, "qwen3_moe" if cfg["model_type"] == "qwen3_moe" else None)
    reloaded = load_pretrained(AutoModelForCausalLM, d)
    assert_same_logits(name, model, reloaded, prompts)
    extra = {"checks": {
        "from_pretrained_identical_logits": True,
        "weights": "random, BF16 on disk; the reference runs the BF16 values in float32",
    }}
    if cfg.get("rope_scaling"):
        # What transformers derived from the scaling entry, so an engine's RoPE
        # can be compared before the tokens are.
        rot = model.model.rotary_emb
        if rot.rope_type == "default":
            raise SystemExit(f"{name}: transformers ignored rope_scaling {cfg['rope_scaling']}")
        extra["transformers_config"] = {
            "rope_type": rot.rope_type,
            "rope_parameters": dict(model.config.rope_parameters),
            "head_dim": rot.inv_freq.shape[0] * 2,
            "rope_inv_freq": rot.inv_freq.tolist(),
            "rope_attention_scaling": float(rot.attention_scaling),
        }
    doc = finish_ref(name, ref, seed, add_bos, extra)
    write_json(os.path.join(d, "ref.json"), doc)
    return doc


# ---------------------------------------------------------------------------
# DeepSeek V4: one architecture, two fixtures. tiny-dsv4 is stored the way the
# released checkpoints are (release names, FP8 / FP4 / UE8M0); tiny-dsv4-hf is
# stored unquantized with the names transformers uses internally.
# ---------------------------------------------------------------------------

DSV4_LAYER_RATIOS = [0, 4, 8, 4, 8]  # sliding, CSA, HCA, CSA, HCA
DSV4_MTP_RATIO = 0
DSV4_CSA_RATE, DSV4_HCA_RATE = 4, 8
_RATIO_KIND = {0: "sliding_attention", DSV4_CSA_RATE: "compressed_sparse_attention",
               DSV4_HCA_RATE: "heavily_compressed_attention"}

DSV4_CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": len(DSV4_LAYER_RATIOS),
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 32,
    "o_lora_rank": 24,
    "o_groups": 2,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "num_hash_layers": 2,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 2.5,
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "sliding_window": 16,
    "index_n_heads": 8,
    "index_head_dim": 32,
    "index_topk": 4,
    "hc_mult": 4,
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
    # Release style: one entry per layer plus the MTP layer. transformers 5.23
    # maps only the ratios 0/4/128 to layer kinds, so the HF keys below say the
    # same thing in a form it accepts (HCA here compresses by 8, not 128).
    "compress_ratios": DSV4_LAYER_RATIOS + [DSV4_MTP_RATIO],
    "layer_types": [_RATIO_KIND[r] for r in DSV4_LAYER_RATIOS],
    "compress_rates": {"compressed_sparse_attention": DSV4_CSA_RATE,
                       "heavily_compressed_attention": DSV4_HCA_RATE},
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "expert_dtype": "fp4",
    "num_nextn_predict_layers": 1,
    "quantization_config": {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    },
    "torch_dtype": "bfloat16",
}


def dsv4_release_tensors(cfg, rand, quantize):
    """Release-named tensors as stored on disk. With `quantize` the dense
    projections are FP8 and the routed experts FP4 (each with its UE8M0
    `.scale`) and the multi-token-prediction block is included, like the real
    checkpoint; without, those projections are plain BF16 and there is no MTP
    block."""
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    H, hd = cfg["num_attention_heads"], cfg["head_dim"]
    qr, G, R = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    I, E, k = cfg["moe_intermediate_size"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]
    ih, idim = cfg["index_n_heads"], cfg["index_head_dim"]
    hc = cfg["hc_mult"]
    M = (2 + hc) * hc
    t = {}

    def plain(name, tensor):
        t[name] = tensor

    def fp8(name, w):
        w = rand.block_gains(name, w)
        if quantize:
            t[name + ".weight"], t[name + ".scale"] = quantize_fp8(w)
        else:
            t[name + ".weight"] = bf16(w)

    def fp4(name, w):
        if quantize:
            t[name + ".weight"], t[name + ".scale"] = quantize_fp4(w)
        else:
            t[name + ".weight"] = bf16(w)

    def hc_block(prefix, kind):
        plain(f"{prefix}hc_{kind}_fn", rand.normal(f"{prefix}hc_{kind}_fn", (M, hc * D), 0.05))
        plain(f"{prefix}hc_{kind}_base", rand.normal(f"{prefix}hc_{kind}_base", (M,), 0.5))
        plain(f"{prefix}hc_{kind}_scale", rand.uniform(f"{prefix}hc_{kind}_scale", (3,), 0.5, 1.5))

    def block(prefix, ratio, hash_routed):
        plain(prefix + "attn_norm.weight", bf16(rand.norm(prefix + "attn_norm", D)))
        plain(prefix + "ffn_norm.weight", bf16(rand.norm(prefix + "ffn_norm", D)))
        hc_block(prefix, "attn")
        hc_block(prefix, "ffn")
        a = prefix + "attn."
        fp8(a + "wq_a", rand.linear(a + "wq_a", qr, D))
        plain(a + "q_norm.weight", bf16(rand.norm(a + "q_norm", qr)))
        fp8(a + "wq_b", rand.linear(a + "wq_b", H * hd, qr))
        fp8(a + "wkv", rand.linear(a + "wkv", hd, D))
        plain(a + "kv_norm.weight", bf16(rand.norm(a + "kv_norm", hd, 2.0)))
        fp8(a + "wo_a", rand.linear(a + "wo_a", G * R, H * hd // G))
        fp8(a + "wo_b", rand.linear(a + "wo_b", D, G * R))
        plain(a + "attn_sink", rand.normal(a + "attn_sink", (H,)))
        if ratio:
            c = a + "compressor."
            width = (2 if ratio == DSV4_CSA_RATE else 1) * hd
            plain(c + "wkv.weight", bf16(rand.linear(c + "wkv", width, D)))
            plain(c + "wgate.weight", bf16(rand.linear(c + "wgate", width, D)))
            plain(c + "ape", rand.normal(c + "ape", (ratio, width)))
            plain(c + "norm.weight", bf16(rand.norm(c + "norm", hd, 2.0)))
            if ratio == DSV4_CSA_RATE:
                x = a + "indexer."
                fp8(x + "wq_b", rand.linear(x + "wq_b", ih * idim, qr))
                plain(x + "weights_proj.weight", bf16(rand.linear(x + "weights_proj", ih, D)))
                xc = x + "compressor."
                plain(xc + "wkv.weight", bf16(rand.linear(xc + "wkv", 2 * idim, D)))
                plain(xc + "wgate.weight", bf16(rand.linear(xc + "wgate", 2 * idim, D)))
                plain(xc + "ape", rand.normal(xc + "ape", (ratio, 2 * idim)))
                plain(xc + "norm.weight", bf16(rand.norm(xc + "norm", idim, 2.0)))
        f = prefix + "ffn."
        plain(f + "gate.weight", bf16(rand.linear(f + "gate", E, D)))
        if hash_routed:
            g = rand.gen(f + "tid2eid")
            plain(f + "gate.tid2eid", torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(V)]).long())
        else:
            plain(f + "gate.bias", rand.normal(f + "gate.bias", (E,), 0.2))
        s = f + "shared_experts."
        fp8(s + "w1", rand.linear(s + "w1", I, D, 1.3))
        fp8(s + "w2", rand.linear(s + "w2", D, I))
        fp8(s + "w3", rand.linear(s + "w3", I, D, 1.3))
        for e in range(E):
            x = f"{f}experts.{e}."
            fp4(x + "w1", rand.linear(x + "w1", I, D, 1.3))
            fp4(x + "w2", rand.linear(x + "w2", D, I))
            fp4(x + "w3", rand.linear(x + "w3", I, D, 1.3))

    plain("embed.weight", bf16(rand.normal("embed", (V, D))))
    plain("head.weight", bf16(rand.normal("head", (V, D))))
    plain("norm.weight", bf16(rand.norm("norm", D)))
    plain("hc_head_fn", rand.normal("hc_head_fn", (hc, hc * D), 0.05))
    plain("hc_head_base", rand.normal("hc_head_base", (hc,), 0.5))
    plain("hc_head_scale", rand.uniform("hc_head_scale", (1,), 0.5, 1.5))
    n_hash = cfg["num_hash_layers"]
    for i, ratio in enumerate(DSV4_LAYER_RATIOS):
        block(f"layers.{i}.", ratio, i < n_hash)
    if quantize:
        # The multi-token-prediction block (never run by transformers, which
        # skips `mtp.*`; present because the real checkpoints carry it).
        p = "mtp.0."
        block(p, DSV4_MTP_RATIO, False)
        for n in ("enorm", "hnorm", "norm"):
            plain(f"{p}{n}.weight", bf16(rand.norm(p + n, D)))
        fp8(p + "e_proj", rand.linear(p + "e_proj", D, D))
        fp8(p + "h_proj", rand.linear(p + "h_proj", D, D))
        plain(p + "hc_head_fn", rand.normal(p + "hc_head_fn", (hc, hc * D), 0.05))
        plain(p + "hc_head_base", rand.normal(p + "hc_head_base", (hc,), 0.5))
        plain(p + "hc_head_scale", rand.uniform(p + "hc_head_scale", (1,), 0.5, 1.5))
    return t


# Release name -> transformers-internal name. Per-layer entries are suffixes of
# `layers.N.` -> `model.layers.N.`; routed experts are handled separately (they
# fuse into experts.gate_up_proj / experts.down_proj).
DSV4_TOP_LEVEL_NAMES = {
    "embed.weight": "model.embed_tokens.weight",
    "head.weight": "lm_head.weight",
    "norm.weight": "model.norm.weight",
    "hc_head_fn": "model.hc_head.hc_fn",
    "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}
DSV4_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "hc_attn_fn": "attn_hc.fn",
    "hc_attn_base": "attn_hc.base",
    "hc_attn_scale": "attn_hc.scale",
    "hc_ffn_fn": "ffn_hc.fn",
    "hc_ffn_base": "ffn_hc.base",
    "hc_ffn_scale": "ffn_hc.scale",
    "attn.wq_a.weight": "self_attn.q_a_proj.weight",
    "attn.q_norm.weight": "self_attn.q_a_norm.weight",
    "attn.wq_b.weight": "self_attn.q_b_proj.weight",
    "attn.wkv.weight": "self_attn.kv_proj.weight",
    "attn.kv_norm.weight": "self_attn.kv_norm.weight",
    "attn.wo_a.weight": "self_attn.o_a_proj.weight",
    "attn.wo_b.weight": "self_attn.o_b_proj.weight",
    "attn.attn_sink": "self_attn.sinks",
    "attn.compressor.wkv.weight": "self_attn.compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "self_attn.compressor.gate_proj.weight",
    "attn.compressor.ape": "self_attn.compressor.position_bias",
    "attn.compressor.norm.weight": "self_attn.compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "self_attn.compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "self_attn.compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "self_attn.compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "self_attn.compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "self_attn.compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "self_attn.compressor.indexer.kv_norm.weight",
    "ffn.gate.weight": "mlp.gate.weight",
    "ffn.gate.bias": "mlp.gate.e_score_correction_bias",
    "ffn.gate.tid2eid": "mlp.gate.tid2eid",
    "ffn.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "ffn.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
DSV4_EXPERT_NAMES = {"w1": "gate", "w2": "down", "w3": "up"}


def dsv4_dequantized(release):
    """Release tensors -> float32 values keyed by release weight name (FP8 and
    FP4 decoded, `.scale` companions consumed). Each decode is cross-checked
    against ml_dtypes."""
    out = {}
    for name, v in release.items():
        if name.endswith(".scale"):
            continue
        scale = release.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if scale is not None:
            kind = "fp8" if v.dtype == torch.float8_e4m3fn else "fp4"
            w = dequantize_fp8(v, scale) if kind == "fp8" else dequantize_fp4(v, scale)
            if not torch.equal(w, ml_dtypes_dequantize(v, scale, kind)):
                raise SystemExit(f"{name}: torch and ml_dtypes decode the stored {kind} bytes differently")
            out[name] = w
        elif v.dtype in (torch.int64, torch.int32):
            out[name] = v
        else:
            out[name] = v.float()
    return out


def dsv4_release_to_hf(values, n_experts):
    """Float release-named tensors (no mtp.*) -> transformers state dict."""
    hf, experts = {}, {}
    for name, v in values.items():
        if name.startswith("mtp."):
            continue
        if name in DSV4_TOP_LEVEL_NAMES:
            hf[DSV4_TOP_LEVEL_NAMES[name]] = v
            continue
        _, i, rest = name.split(".", 2)
        if rest.startswith("ffn.experts."):
            _, _, e, proj, _ = rest.split(".")
            experts.setdefault(int(i), {})[(int(e), DSV4_EXPERT_NAMES[proj])] = v
            continue
        if rest not in DSV4_LAYER_NAMES:
            raise SystemExit(f"no transformers name for release tensor {name}")
        hf[f"model.layers.{i}.{DSV4_LAYER_NAMES[rest]}"] = v
    for i, ex in experts.items():
        p = f"model.layers.{i}.mlp.experts."
        hf[p + "gate_up_proj"] = torch.stack(
            [torch.cat([ex[(e, "gate")], ex[(e, "up")]], 0) for e in range(n_experts)])
        hf[p + "down_proj"] = torch.stack([ex[(e, "down")] for e in range(n_experts)])
    return hf


def check_conversion_mapping(release_names, model):
    """Cross-check the hand-written mapping above against transformers' own
    release->HF renames (conversion_mapping.py, 'deepseek_v4')."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    rules = get_checkpoint_conversion_mapping("deepseek_v4")
    renames = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    model_keys = set(model.state_dict())
    checked = 0
    for name in release_names:
        if name.startswith("mtp.") or name.endswith(".scale") or ".experts." in name.replace("shared_experts", ""):
            continue
        ours = DSV4_TOP_LEVEL_NAMES.get(name)
        if ours is None:
            _, i, rest = name.split(".", 2)
            ours = f"model.layers.{i}.{DSV4_LAYER_NAMES[rest]}"
        theirs = name
        for r in renames:
            theirs, _ = r.rename_source_key(theirs)
        if not theirs.startswith("model.") and theirs != "lm_head.weight":
            theirs = "model." + theirs
        if theirs != ours:
            raise SystemExit(f"conversion mapping: {name} -> {theirs} (transformers) vs {ours} (this script)")
        if ours not in model_keys:
            raise SystemExit(f"{ours} is not a key of the transformers model")
        checked += 1
    if not converters:
        raise SystemExit("transformers' deepseek_v4 conversion mapping has no expert converters")
    return checked


def make_dsv4(name, out_dir, base_tok, seed, quantized):
    from transformers import AutoModelForCausalLM, DeepseekV4Config, DeepseekV4ForCausalLM

    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    cfg = copy.deepcopy(DSV4_CONFIG)  # transformers edits nested dicts in place
    if quantized:
        write_json(os.path.join(d, "config.json"), cfg)
    else:
        for key in ("quantization_config", "expert_dtype", "compress_ratios", "torch_dtype"):
            cfg.pop(key)
        config = DeepseekV4Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
        config.architectures = ["DeepseekV4ForCausalLM"]
        config.dtype = torch.bfloat16
        config.to_json_file(os.path.join(d, "config.json"))
    write_tokenizer(d, base_tok, True)
    write_generation_config(d)
    tok = load_tokenizer(d)
    prompts = model_prompts(tok)

    model = build_from_config(AutoModelForCausalLM, d)
    c = model.config
    rand = Rand(seed)
    release = dsv4_release_tensors(DSV4_CONFIG, rand, quantize=quantized)
    values = dsv4_dequantized(release)
    state = dsv4_release_to_hf(values, c.n_routed_experts)
    load_exact(model, state)
    checks = {}
    if quantized:
        checks["conversion_mapping_renames_agree"] = check_conversion_mapping(release, model)
        save_safetensors(os.path.join(d, "model.safetensors"), release)
    else:
        # Store what transformers keeps: its state dict names, BF16 except the
        # modules it pins to float32 (_keep_in_fp32_modules_strict) and tid2eid.
        keep32 = DeepseekV4ForCausalLM._keep_in_fp32_modules_strict
        stored = {}
        for k, v in state.items():
            parts = k.split(".")
            if v.dtype == torch.int64:
                stored[k] = v
            elif any(p in keep32 for p in parts[:-1]) or parts[-2] in keep32 or parts[-1] in keep32:
                stored[k] = v.float()
            else:
                stored[k] = bf16(v)
        # The BF16 values are what the reference runs on.
        state = {k: v.float() if v.is_floating_point() else v for k, v in stored.items()}
        load_exact(model, state)
        save_safetensors(os.path.join(d, "model.safetensors"), stored)

    ref = run_reference(model, prompts, "dsv4")
    reloaded = load_pretrained(DeepseekV4ForCausalLM, d)
    if quantized:
        # transformers 5.23 dequantizes FP8/FP4 into float32 here but leaves the
        # BF16 tensors of a pre-quantized checkpoint in BF16, whatever `dtype`
        # says; the mixed model cannot run (F.linear dtype mismatch). Every
        # stored value is exact in float32, so casting changes nothing.
        left_bf16 = sorted(k for k, v in reloaded.state_dict().items() if v.dtype == torch.bfloat16)
        checks["from_pretrained_left_in_bfloat16"] = len(left_bf16)
        reloaded = reloaded.float()
    assert_same_logits(name, model, reloaded, prompts)
    checks["from_pretrained_identical_logits"] = True
    if not quantized:
        bf = DeepseekV4ForCausalLM.from_pretrained(d, dtype=torch.bfloat16)
        loaded = bf.state_dict()
        if set(loaded) != set(stored):
            raise SystemExit(f"{name}: stored names differ from the model's: {sorted(set(loaded) ^ set(stored))[:6]}")
        mism = [k for k, v in loaded.items() if v.dtype != stored[k].dtype]
        if mism:
            raise SystemExit(f"{name}: stored dtypes differ from a bfloat16 load for {mism[:6]}")
        checks["stored_dtypes_match_bfloat16_load"] = True
    rot = model.model.rotary_emb
    seen = {
        "layer_types": c.layer_types,
        "mlp_layer_types": c.mlp_layer_types,
        "compress_rates": c.compress_rates,
        "rope_parameters": c.rope_parameters,
        "rope_inv_freq": {k: getattr(rot, f"{k}_inv_freq").tolist() for k in ("main", "compress")},
        "rope_attention_scaling": {k: float(getattr(rot, f"{k}_attention_scaling")) for k in ("main", "compress")},
    }
    doc = finish_ref(name, ref, seed, True, {"checks": checks, "transformers_config": seen})
    write_json(os.path.join(d, "ref.json"), doc)
    return doc


# ---------------------------------------------------------------------------


def tokenizer_cases(out_dir, base_tok):
    """Strings with their ids (no special tokens added) and the chat-template
    rendering, computed through transformers from the tokenizer files exactly
    as the fixtures carry them."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        for sub, add_bos in (("bos", True), ("nobos", False)):
            os.makedirs(os.path.join(tmp, sub))
            write_tokenizer(os.path.join(tmp, sub), base_tok, add_bos)
        t_bos = AutoTokenizer.from_pretrained(os.path.join(tmp, "bos"))
        t_nobos = AutoTokenizer.from_pretrained(os.path.join(tmp, "nobos"))
    cases = []
    for text in TOKENIZER_CASES:
        ids = t_bos(text, add_special_tokens=False)["input_ids"]
        with_bos = t_bos(text)["input_ids"]
        assert with_bos == [BOS_ID] + ids, (text, with_bos, ids)
        assert t_nobos(text)["input_ids"] == ids
        cases.append({
            "text": text,
            "ids": ids,
            "tokens": t_bos.convert_ids_to_tokens(ids),
            "decoded": t_bos.decode(ids),
        })
    rendered = t_bos.apply_chat_template(CHAT_CASE, add_generation_prompt=True, tokenize=False)
    chat_ids = t_bos(rendered, add_special_tokens=False)["input_ids"]
    templ_ids = t_bos.apply_chat_template(CHAT_CASE, add_generation_prompt=True, tokenize=True)
    if hasattr(templ_ids, "keys"):
        templ_ids = templ_ids["input_ids"]
    if list(templ_ids) != chat_ids:
        raise SystemExit(f"apply_chat_template(tokenize=True) {templ_ids} != encode(rendered) {chat_ids}")
    doc = {
        "schema": "bespoke-tokenizer-cases/1",
        "generator": "tools/make_fixtures.py",
        "versions": versions(),
        "tokenizer": "the tokenizer.json shared by every fixture (only the post-processor differs: "
                     "tiny-llama/tiny-dsv4/tiny-dsv4-hf prepend <s> = 1, the Qwen fixtures add nothing)",
        "special_tokens": {t: i for i, t in enumerate(SPECIAL_TOKENS)},
        "cases": cases,
        "chat": {
            "messages": CHAT_CASE,
            "add_generation_prompt": True,
            "chat_template": CHAT_TEMPLATE,
            "rendered": rendered,
            "ids": chat_ids,
        },
    }
    write_json(os.path.join(out_dir, "tokenizer_cases.json"), doc)


FIXTURES = {
    "tiny-llama": lambda out, tok: make_dense("tiny-llama", LLAMA_CONFIG, 6, True, out, tok),
    "tiny-qwen3": lambda out, tok: make_dense("tiny-qwen3", QWEN3_CONFIG, 1, False, out, tok),
    "tiny-qwen2": lambda out, tok: make_dense("tiny-qwen2", QWEN2_CONFIG, 3, False, out, tok),
    "tiny-qwen3-moe": lambda out, tok: make_dense("tiny-qwen3-moe", QWEN3_MOE_CONFIG, 33, False, out, tok),
    "tiny-dsv4": lambda out, tok: make_dsv4("tiny-dsv4", out, tok, 52, True),
    "tiny-dsv4-hf": lambda out, tok: make_dsv4("tiny-dsv4-hf", out, tok, 71, False),
}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="fixtures", help="output directory (default: fixtures)")
    ap.add_argument("--only", action="append", choices=sorted(FIXTURES) + ["tokenizer-cases"],
                    help="generate just this fixture (repeatable)")
    ap.add_argument("--allow-version-mismatch", action="store_true")
    args = ap.parse_args()
    check_versions(args.allow_version_mismatch)

    torch.set_num_threads(1)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    os.makedirs(args.out, exist_ok=True)
    base_tok = train_tokenizer()
    names = args.only or list(FIXTURES) + ["tokenizer-cases"]
    for name in names:
        t0 = time.time()
        if name == "tokenizer-cases":
            tokenizer_cases(args.out, base_tok)
            print(f"tokenizer_cases.json  {time.time() - t0:.1f}s")
            continue
        doc = FIXTURES[name](args.out, base_tok)
        lens = [len(p["ids"]) for p in doc["prompts"]]
        copies = sum(a == b for p in doc["prompts"] for a, b in zip(p["argmax"], p["ids"]))
        distinct = len({t for p in doc["prompts"] for t in p["greedy"]})
        sel = {k: v for k, v in doc.get("selection", {}).items() if "margin" in k}
        print(f"{name:15s} prompt lengths {lens}  min_margin {doc['min_margin']:.4g}  {sel}  "
              f"argmax==input {copies}/{sum(lens)}  distinct greedy tokens {distinct}  {time.time() - t0:.1f}s")


if __name__ == "__main__":
    main()
