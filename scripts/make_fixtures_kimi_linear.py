#!/usr/bin/env python3
"""Golden fixtures for the KDA + MLA hybrid: transformers' KimiLinearForCausalLM + PEFT.

Builds tiny random Kimi-Linear models (KDA and NoPE MLA layers mixed, a dense first layer, routed +
shared experts with the sigmoid router), attaches a PEFT LoRA adapter with non-zero B to every
attention projection (KDA's and MLA's), the dense MLP, the shared and the routed experts, runs one
training-mode forward/backward on two sequences of 70 tokens (not a multiple of the KDA chunk of 64)
and writes, per config, <out>/<name>/ as scripts/make_fixtures.py does for DeepSeek-V3:

    config.json, model.safetensors   the HF model (save_pretrained, fp32)
    adapter/                         the PEFT adapter
    golden.safetensors               batch, labels, logits, loss, one gradient per adapter tensor,
                                     per-layer activations and routing for debugging

The two configs are saved in the two checkpoint layouts transformers 5 writes: "kimi_linear" with
the default save_pretrained (the released checkpoint's names: q_conv1d, f_a_proj, A_log [1,1,H,1],
block_sparse_moe.experts.<e>.w1/w2/w3, ...) and "kimi_linear_t5" with save_original_format=False
(transformers' in-memory names). Module names are read off the live model, never assumed; what was
found is printed and stored in golden.safetensors' metadata.

Checks (fatal ones stop before anything is written): the model has the requested structure; train
and eval logits are identical; every adapter tensor gets a non-zero gradient; routing has no near-ties
(2e-4) and matches the documented algorithm. Reported (a WARN line, not fatal): the saved files
reload to the same logits; an independent float64 numpy forward that reads only the saved files
(the recurrent form of KDA) reproduces logits and loss; central differences of that forward match a
few gradient entries. The summary at the end lists each check as PASS or WARN.

Needs torch, transformers 5.x (kimi_linear), peft, safetensors, numpy; CPU is enough (~10 s).

    python3 scripts/make_fixtures_kimi_linear.py --out tests/fixtures/golden
    python3 scripts/make_fixtures_kimi_linear.py --out $OUT/golden_kimi_linear   # then copy into the repo

See docs/FIXTURES.md for the contents and docs/HF_SEMANTICS.md (section 8) for the semantics.
"""

import collections
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (shared helpers; it checks the imports and sets CUBLAS_WORKSPACE_CONFIG)
from fixtures import common  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import peft  # noqa: E402
from safetensors import safe_open  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402

try:
    from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402
except ImportError as exc:  # pragma: no cover
    sys.exit(f"make_fixtures_kimi_linear.py: this transformers ({transformers.__version__}) has no kimi_linear: {exc}")

fail, check = mf.fail, mf.check
BATCH, SEQ = 2, 70  # 70 = one full KDA chunk of 64 and a partial one
IGNORE = mf.IGNORE
EXTRA_MASKED = [(0, 2), (0, 40), (1, 0), (1, 5), (1, 66)]
LORA_RANK, LORA_ALPHA, B_STD, BIAS_MAX = mf.LORA_RANK, mf.LORA_ALPHA, mf.B_STD, mf.BIAS_MAX
ADAPTER_PREFIX = mf.ADAPTER_PREFIX
MLP_PARAMS = mf.MLP_PARAMS  # dense and shared MLPs through target_parameters (make_fixtures.py says why)

# KDA's projections by role, with the names each writer gives them: Moonshot's released checkpoint
# (and moetrain) first, then transformers 5's in-memory names. The live model decides which it has.
KDA_LINEARS = {
    "q": ["q_proj"], "k": ["k_proj"], "v": ["v_proj"],
    "f_a": ["f_a_proj", "forget_gate_down"], "f_b": ["f_b_proj", "forget_gate_up"],
    "b": ["b_proj", "beta_proj"],
    "g_a": ["g_a_proj", "output_gate_down"], "g_b": ["g_b_proj", "output_gate_up"],
    "o": ["o_proj"],
}
# Role names are matched on the last component of a dotted module path: transformers 5.17 keeps
# f_a_proj / f_b_proj, A_log and dt_bias in a `forget_gate` submodule of the attention.


def kda_param(attn, leaf):
    """A_log or dt_bias of a KDA module, wherever it sits (directly, or in forget_gate)."""
    found = [p for n, p in attn.named_parameters() if n.split(".")[-1] == leaf]
    check(len(found) == 1, f"{type(attn).__name__}: {len(found)} parameters named {leaf}")
    return found[0]


def is_kda_module(attn):
    return any(n.split(".")[-1] == "A_log" for n, _ in attn.named_parameters())

# Shared by both configs. A KDA head: 2 heads of 8; MLA: 2 heads, NoPE, rope dims kept (4).
COMMON = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
    num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
    v_head_dim=8, num_experts=8, top_k=2, rms_norm_eps=1e-5, max_position_embeddings=128,
    kda_heads=2, kda_head_dim=8, conv=4,
)
# One fixture config: its layer mixers, q_lora_rank (None: no q LoRA), (n_group, topk_group), the
# routed scaling factor, shared experts, the save_original_format flag, experts per token, and
# whether the frozen weights are rounded to bf16 before anything is computed (F32 still).
Variant = collections.namedtuple("Variant", "mixers q_lora_rank groups scaling shared original_format top_k bf16_weights",
                                 defaults=(COMMON["top_k"], False))
VARIANTS = {
    "kimi_linear": Variant(["kda", "mla", "kda"], None, (2, 1), 2.446, 1, True),
    "kimi_linear_t5": Variant(["mla", "kda", "kda"], 12, (1, 1), 1.0, 2, False),
    # For the GPU's bf16 check (tests/cuda/test_cuda_golden_model.cpp): kimi_linear with no
    # decision a bf16 rounding can flip (every expert is chosen, so routing has no top-k
    # boundary) and frozen weights that bf16 holds exactly, so what the GPU rounds is only its
    # activations. The others are ill-conditioned in bf16 (their top-2 choices flip).
    "kimi_linear_bf16": Variant(["kda", "mla", "kda"], None, (1, 1), 2.446, 1, True,
                                top_k=COMMON["num_experts"], bf16_weights=True),
}


# ----------------------------------------------------------------------------------------------
# config and model
# ----------------------------------------------------------------------------------------------


def set_all(cfg, names, value):
    """Sets one setting under every name some transformers version reads it by."""
    for name in names:
        try:
            setattr(cfg, name, value)
        except (AttributeError, TypeError, ValueError):
            pass


def make_config(mixers, q_lora_rank, groups, scaling, shared, top_k):
    c = COMMON
    L = len(mixers)
    kda_layers = [i + 1 for i, m in enumerate(mixers) if m == "kda"]  # 1-based, as the released config
    full_layers = [i + 1 for i, m in enumerate(mixers) if m == "mla"]
    linear_attn_config = dict(kda_layers=kda_layers, full_attn_layers=full_layers, head_dim=c["kda_head_dim"],
                              num_heads=c["kda_heads"], short_conv_kernel_size=c["conv"])
    kwargs = dict(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        moe_intermediate_size=c["moe_intermediate_size"], num_hidden_layers=L,
        num_attention_heads=c["num_attention_heads"], num_key_value_heads=c["num_key_value_heads"],
        kv_lora_rank=c["kv_lora_rank"], q_lora_rank=q_lora_rank, qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], rms_norm_eps=c["rms_norm_eps"],
        routed_scaling_factor=scaling, topk_group=groups[1], tie_word_embeddings=False, hidden_act="silu",
        linear_attn_config=linear_attn_config, first_k_dense_replace=1, mla_use_nope=True,
        pad_token_id=None, bos_token_id=0, eos_token_id=1,
    )
    try:
        cfg = KimiLinearConfig(**kwargs)
    except TypeError as exc:
        fail(f"KimiLinearConfig rejected {sorted(kwargs)}: {exc}")
    # Every spelling of each setting across transformers versions (the model reads one of them).
    set_all(cfg, ["num_experts", "num_local_experts", "n_routed_experts"], c["num_experts"])
    set_all(cfg, ["num_experts_per_token", "num_experts_per_tok"], top_k)
    set_all(cfg, ["num_shared_experts", "n_shared_experts"], shared)
    set_all(cfg, ["num_expert_group", "n_group"], groups[0])
    set_all(cfg, ["moe_renormalize", "norm_topk_prob"], True)
    set_all(cfg, ["model_max_length", "max_position_embeddings"], c["max_position_embeddings"])
    set_all(cfg, ["layer_types"], ["linear_attention" if m == "kda" else "full_attention" for m in mixers])
    set_all(cfg, ["mlp_layer_types"], ["dense"] + ["sparse"] * (L - 1))
    set_all(cfg, ["first_k_dense_replace"], 1)
    set_all(cfg, ["use_cache"], False)  # training: no conv/recurrent state cache
    set_all(cfg, ["linear_attn_config"], linear_attn_config)
    set_all(cfg, ["linear_num_heads", "linear_num_key_heads", "linear_num_value_heads"], c["kda_heads"])
    set_all(cfg, ["linear_head_dim", "linear_key_head_dim", "linear_value_head_dim"], c["kda_head_dim"])
    set_all(cfg, ["linear_conv_kernel_dim"], c["conv"])
    set_all(cfg, ["qk_head_dim"], c["qk_nope_head_dim"] + c["qk_rope_head_dim"])
    return cfg


def kda_roles(attn):
    """{role: attribute name} of a KDA module's nn.Linear children, and its conv weights by stream."""
    linears = {n: m for n, m in attn.named_modules() if n and isinstance(m, torch.nn.Linear)}
    roles = {}
    for role, names in KDA_LINEARS.items():
        found = [n for n in linears if n.split(".")[-1] in names]
        check(len(found) == 1, f"{type(attn).__name__}: projection '{role}' not found as one of {names}; "
                               f"its linear layers are {sorted(linears)}")
        roles[role] = found[0]
    extra = sorted(set(linears) - set(roles.values()))
    check(not extra, f"{type(attn).__name__} has linear layers this script does not know: {extra} "
                     "(a full-rank output gate or fused qkv? transformers 5.17 should have neither)")
    return roles


def conv_weights(attn, c):
    """[C, W] conv weights of q, k, v, whichever way the module stores them (packed or apart)."""
    children = dict(attn.named_children())
    if all(f"{s}_conv1d" in children for s in "qkv"):
        return [children[f"{s}_conv1d"].weight.detach().reshape(c, -1) for s in "qkv"]
    packed = getattr(attn, "conv1d", None)
    check(packed is not None, f"{type(attn).__name__}: no q/k/v_conv1d nor a packed conv1d; children "
                              f"{sorted(children)}")
    w = packed.weight.detach()
    check(w.shape[0] == 3 * c, f"packed conv1d weight {tuple(w.shape)}, want [{3 * c}, 1, W]")
    return list(w.reshape(3 * c, -1).split(c, 0))


def build_model(cfg, mixers, device):
    model = KimiLinearForCausalLM._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32)
    c = COMMON
    H, d = c["kda_heads"], c["kda_head_dim"]
    layers = model.model.layers
    check(len(layers) == len(mixers), f"{len(layers)} layers, want {len(mixers)}")
    names = {}
    for i, (layer, kind) in enumerate(zip(layers, mixers)):
        attn = layer.self_attn
        is_kda = is_kda_module(attn)
        check(is_kda == (kind == "kda"), f"layer {i} is {type(attn).__name__}, want {kind} "
                                         f"(config.layer_types = {getattr(cfg, 'layer_types', None)})")
        if is_kda:
            roles = kda_roles(attn)
            names.setdefault("kda", roles)
            check(names["kda"] == roles, "KDA layers name their projections differently")
            q = attn.get_submodule(roles["q"])
            check(q.out_features == H * d, f"layer {i}: KDA q_proj out {q.out_features}, want {H * d}")
            check(attn.get_submodule(roles["b"]).out_features == H, f"layer {i}: beta projection is not [H, D]")
            check(attn.get_submodule(roles["f_a"]).out_features == d, f"layer {i}: forget-gate down is not [d, D]")
            check(all(w.shape[1] == c["conv"] for w in conv_weights(attn, H * d)), f"layer {i}: conv width")
            check(kda_param(attn, "A_log").numel() == H and kda_param(attn, "dt_bias").numel() == H * d,
                  f"layer {i}: A_log / dt_bias sizes")
            act = getattr(attn.o_norm, "activation", "sigmoid")
            check(act == "sigmoid", f"layer {i}: o_norm gates with {act!r}; Moonshot's model (and moetrain) use "
                                    "sigmoid, so golden files from this transformers would not be the reference")
        mlp = layer.mlp
        if i == 0:
            check(hasattr(mlp, "gate_proj") and not hasattr(mlp, "experts"), "layer 0 is not the dense MLP")
        else:
            ex = mlp.experts
            E, F_, D = c["num_experts"], c["moe_intermediate_size"], c["hidden_size"]
            check(tuple(ex.gate_up_proj.shape) == (E, 2 * F_, D), f"layer {i}: experts.gate_up_proj "
                                                                  f"{tuple(ex.gate_up_proj.shape)}, want {(E, 2 * F_, D)}")
            check(tuple(ex.down_proj.shape) == (E, D, F_), f"layer {i}: experts.down_proj shape")
            check(hasattr(mlp.gate, "e_score_correction_bias"), f"layer {i}: router without score bias")
    return model.to(device), names["kda"]


@torch.no_grad()
def init_weights(model, seed, bf16_weights=False):
    """Every parameter from one seeded generator. KDA's decay is kept mild (|g| <~ 0.6 per token) so
    the state carries information across the 64-token chunk boundary; see docs/FIXTURES.md."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("e_score_correction_bias"):
            continue  # a parameter in some versions, a buffer in others: set below
        if name.endswith("embed_tokens.weight"):
            val = torch.randn(p.shape, generator=gen)
        elif name.endswith(".A_log"):
            val = torch.empty(p.shape).uniform_(0.02, 0.2, generator=gen).log()
        elif name.endswith(".dt_bias"):
            val = 0.3 * torch.randn(p.shape, generator=gen)
        elif "conv1d" in name:
            val = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
        elif p.ndim >= 2:
            val = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
        elif "norm" in name:
            val = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            fail(f"init_weights: unexpected parameter {name} {tuple(p.shape)}")
        p.copy_((val.to(torch.bfloat16) if bf16_weights else val).to(p.dtype))
    for name, b in sorted(list(model.named_buffers()) + list(model.named_parameters())):
        if name.endswith("e_score_correction_bias"):
            b.copy_((BIAS_MAX * torch.rand(b.shape, generator=gen)).to(b.dtype))


def attach_lora(model, seed):
    """LoRA on every attention projection by its live module name, and on the MLPs and experts through
    target_parameters (as make_fixtures.py); non-zero B."""
    linear_names = set()
    for layer in model.model.layers:
        for n, m in layer.self_attn.named_modules():
            if n and isinstance(m, torch.nn.Linear):
                linear_names.add(n.split(".")[-1])  # PEFT matches target_modules on the name's end
    expert_params = sorted({f"mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")})
    cfg = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, use_rslora=False, bias="none",
                     init_lora_weights=True, target_modules=sorted(linear_names),
                     target_parameters=expert_params + MLP_PARAMS)
    pm = get_peft_model(model, cfg)
    live = pm.peft_config["default"]
    check(set(live.target_modules) == linear_names and not live.rank_pattern and not live.alpha_pattern,
          f"PEFT rewrote the LoRA config: target_modules={live.target_modules} rank_pattern={live.rank_pattern} "
          f"alpha_pattern={live.alpha_pattern}")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted((n, p) for n, p in pm.named_parameters() if p.requires_grad):
            p.copy_(common.lora_value(name, p, gen, B_STD).to(p.dtype))
    return pm, sorted(linear_names)


def expert_adapter_keys(pm):
    """{'gate_up_proj': key template with {L}, 'down_proj': ...} of the expert ParamWrappers."""
    from peft.tuners.lora.layer import ParamWrapper

    found = {}
    for name, mod in pm.named_modules():
        if isinstance(mod, ParamWrapper) and mod.num_experts > 1:
            short = name[len(ADAPTER_PREFIX):] if name.startswith(ADAPTER_PREFIX) else name
            parts = short.split(".")
            L = parts[parts.index("layers") + 1]
            found.setdefault(mod.parameter_name, short.replace(f".layers.{L}.", ".layers.{L}."))
            check(mod.num_experts == COMMON["num_experts"], f"{name}: {mod.num_experts} experts")
            check(mod._did_swap_in_out_features, f"{name}: in/out not swapped; layout differs from the docs")
    check(set(found) == {"gate_up_proj", "down_proj"}, f"expert ParamWrappers found: {found}")
    return found


# ----------------------------------------------------------------------------------------------
# batch and forward
# ----------------------------------------------------------------------------------------------


def make_batch(vocab, seed):
    return common.make_batch(vocab, seed, BATCH, SEQ, EXTRA_MASKED)


def forward(pm, ids, labels):
    store = {}
    m = pm.get_base_model().model

    def router_hooks(i, layer):
        if not hasattr(layer.mlp, "gate"):
            return []

        def router_hook(_mod, inp, out, i=i):
            check(isinstance(out, tuple) and len(out) == 3, "the router no longer returns (logits, weights, indices)")
            store[f"router_in.layers.{i}"] = inp[0].detach().reshape(-1, COMMON["hidden_size"]).clone()
            store[f"router.layers.{i}.raw_index"] = out[2].detach().clone()
            store[f"router.layers.{i}.raw_weight"] = out[1].detach().clone()
        return [layer.mlp.gate.register_forward_hook(router_hook)]
    handles = common.activation_hooks(m, enumerate(m.layers), store, router_hooks)
    out = common.run_hooked(handles, lambda: pm(input_ids=ids, use_cache=False))
    logits = out.logits
    check(tuple(logits.shape) == (BATCH, SEQ, COMMON["vocab_size"]), f"logits shape {tuple(logits.shape)}")
    return logits, mf.masked_mean_ce(logits, labels), store


# ----------------------------------------------------------------------------------------------
# independent float64 numpy forward from the saved files
# ----------------------------------------------------------------------------------------------


class KimiNumpyReference(mf.NumpyReference):
    """Kimi-Linear in float64 from config.json constants, model.safetensors (either layout) and the
    adapter: KDA in its recurrent form (docs/HF_SEMANTICS.md section 8), NoPE MLA, the Kimi MoE."""

    def __init__(self, hf_dir, adapter_dir, mixers, q_lora_rank, groups, scaling, shared, top_k, roles, expert_keys):
        super().__init__(hf_dir, adapter_dir)
        self.mixers, self.groups, self.scaling_factor, self.roles = mixers, groups, scaling, roles
        self.top_k = top_k
        self.expert_keys = expert_keys
        self.c.update(num_attention_heads=COMMON["num_attention_heads"], q_lora_rank=q_lora_rank,
                      kv_lora_rank=COMMON["kv_lora_rank"], qk_nope_head_dim=COMMON["qk_nope_head_dim"],
                      qk_rope_head_dim=COMMON["qk_rope_head_dim"], v_head_dim=COMMON["v_head_dim"],
                      rms_norm_eps=COMMON["rms_norm_eps"], n_shared=shared)
        # Released names for the weights of the in-memory modules the adapter keys use.
        for key in list(self.w):
            for role, names in KDA_LINEARS.items():
                for n in names:
                    alias = key.replace(f".self_attn.{n}.", f".self_attn.{roles[role]}.")
                    if alias != key:
                        self.w.setdefault(alias, self.w[key])
            self.w.setdefault(key.replace(".block_sparse_moe.", ".mlp."), self.w[key])
            # transformers 5.17's layout keeps A_log and dt_bias in the forget_gate submodule.
            self.w.setdefault(key.replace(".forget_gate.", "."), self.w[key])

    def rms(self, x, wkey):
        # q_a / kv_a layernorms are built without eps (1e-6 always); the others use rms_norm_eps.
        eps = 1e-6 if ("q_a_layernorm" in wkey or "kv_a_layernorm" in wkey) else self.c["rms_norm_eps"]
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * self.w[wkey]

    def rope_tables(self, T):  # NoPE: no rotation (the rope dims stay in q and k)
        half = self.c["qk_rope_head_dim"] // 2
        return np.ones((T, half)), np.zeros((T, half))

    def attention(self, h, L):
        saved = self.c.get("rope_parameters")
        self.c["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        try:
            return super().attention(h, L)
        finally:
            self.c["rope_parameters"] = saved

    def conv(self, p, stream, C):
        j = "qkv".index(stream)
        if f"{p}.{stream}_conv1d.weight" in self.w:
            return self.w[f"{p}.{stream}_conv1d.weight"].reshape(C, -1)
        return self.w[f"{p}.conv1d.weight"].reshape(3 * C, -1)[j * C:(j + 1) * C]

    def kda(self, h, L):
        H, d = COMMON["kda_heads"], COMMON["kda_head_dim"]
        C = H * d
        B, T, _ = h.shape
        p = f"model.layers.{L}.self_attn"
        r = self.roles

        def stream(s):
            x = self.linear(h, f"{p}.{r[s]}")
            w = self.conv(p, s, C)
            W = w.shape[1]
            xp = np.concatenate([np.zeros((B, W - 1, C)), x], 1)
            y = sum(w[:, i] * xp[:, i:i + T] for i in range(W))
            return (y / (1 + np.exp(-y))).reshape(B, T, H, d)

        q, k, v = stream("q"), stream("k"), stream("v")
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) * d ** -0.5
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
        f = self.linear(self.linear(h, f"{p}.{r['f_a']}"), f"{p}.{r['f_b']}").reshape(B, T, H, d)
        a = np.exp(self.w[f"{p}.A_log"].reshape(-1)[:H])[None, None, :, None]
        x = f + self.w[f"{p}.dt_bias"].reshape(H, d)
        g = -a * np.logaddexp(0.0, x)
        beta = 1 / (1 + np.exp(-self.linear(h, f"{p}.{r['b']}")))  # [B, T, H]
        S = np.zeros((B, H, d, d))
        o = np.zeros((B, T, H, d))
        for t in range(T):
            S = S * np.exp(g[:, t])[..., None]
            delta = (v[:, t] - np.einsum("bhkv,bhk->bhv", S, k[:, t])) * beta[:, t, :, None]
            S = S + k[:, t, :, :, None] * delta[:, :, None, :]
            o[:, t] = np.einsum("bhkv,bhk->bhv", S, q[:, t])
        gate = self.linear(self.linear(h, f"{p}.{r['g_a']}"), f"{p}.{r['g_b']}").reshape(B, T, H, d)
        o = o / np.sqrt((o * o).mean(-1, keepdims=True) + self.c["rms_norm_eps"]) * self.w[f"{p}.o_norm.weight"]
        o = o / (1 + np.exp(-gate))
        return self.linear(o.reshape(B, T, C), f"{p}.{r['o']}")

    def moe(self, x, L):
        E, K = COMMON["num_experts"], self.top_k
        G, TG = self.groups
        F_ = COMMON["moe_intermediate_size"]
        p = f"model.layers.{L}.mlp"
        B, T, D = x.shape
        xf = x.reshape(-1, D)
        s, sc, per, gs = self.router(xf, p, E, G)
        if f"{p}.experts.gate_up_proj" in self.w:
            gu, dn = self.w[f"{p}.experts.gate_up_proj"].copy(), self.w[f"{p}.experts.down_proj"].copy()
        else:
            gu = np.stack([np.concatenate([self.w[f"{p}.experts.{e}.w1.weight"], self.w[f"{p}.experts.{e}.w3.weight"]])
                           for e in range(E)])
            dn = np.stack([self.w[f"{p}.experts.{e}.w2.weight"] for e in range(E)])
        for which, Wt in (("gate_up_proj", gu), ("down_proj", dn)):
            key = self.expert_keys[which].format(L=L)
            ka, kb = ADAPTER_PREFIX + key + ".lora_A.weight", ADAPTER_PREFIX + key + ".lora_B.weight"
            self.used.update([ka, kb])
            A = self.ad[ka].reshape(E, self.r, -1)
            Bm = self.ad[kb].reshape(self.ad[kb].shape[0], self.r, E)
            for e in range(E):
                Wt[e] += self.scaling * Bm[:, :, e] @ A[e]
        out = np.zeros_like(xf)
        for n in range(xf.shape[0]):
            idx = self.top_experts(sc[n], E, per, np.argsort(-gs[n], kind="stable")[:TG], K)
            wts = s[n, idx] / (s[n, idx].sum() + 1e-20) * self.scaling_factor
            for e, wt in zip(idx, wts):
                hgu = gu[e] @ xf[n]
                out[n] += wt * (dn[e] @ (hgu[:F_] / (1 + np.exp(-hgu[:F_])) * hgu[F_:]))
        return out.reshape(B, T, D) + self.mlp(x, f"{p}.shared_experts")

    def logits(self, ids):
        x = self.w["model.embed_tokens.weight"][ids]
        for L, kind in enumerate(self.mixers):
            p = f"model.layers.{L}"
            h = self.rms(x, f"{p}.input_layernorm.weight")
            x = x + (self.kda(h, L) if kind == "kda" else self.attention(h, L))
            h = self.rms(x, f"{p}.post_attention_layernorm.weight")
            x = x + (self.moe(h, L) if L >= 1 else self.mlp(h, f"{p}.mlp"))
        return self.rms(x, "model.norm.weight") @ self.w["lm_head.weight"].T


# ----------------------------------------------------------------------------------------------
# one config
# ----------------------------------------------------------------------------------------------


def checkpoint_layout(path):
    with safe_open(path, "pt") as f:
        keys = sorted(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    check(dtypes == {"F32"}, f"{path}: dtypes {dtypes}, want F32 only")
    kda = sorted({k.split(".self_attn.")[1] for k in keys if ".self_attn." in k and "A_log" not in k})
    experts = "per-expert w1/w2/w3" if any(".experts.0.w1." in k for k in keys) else (
        "fused gate_up_proj" if any(k.endswith("experts.gate_up_proj") for k in keys) else "per-expert gate/up/down")
    return keys, kda, experts


def make_one(name, out_root, device, seed, results):
    mixers, q_lora_rank, groups, scaling, shared, original_format, top_k, bf16_weights = VARIANTS[name]
    out_dir, tmp_dir = common.fresh_tmp_dir(out_root, name)
    print(f"\n=== {name}: mixers {mixers}, q_lora_rank {q_lora_rank}, groups {groups}, scaling {scaling}, "
          f"shared experts {shared}, save_original_format={original_format}, top {top_k}, bf16 weights {bf16_weights}")
    warn = []

    cfg = make_config(mixers, q_lora_rank, groups, scaling, shared, top_k)
    torch.manual_seed(seed)
    model, roles = build_model(cfg, mixers, device)
    print(f"  KDA projections in memory: {roles}")
    init_weights(model, seed, bf16_weights)
    model.train()
    try:
        model.save_pretrained(tmp_dir, save_original_format=original_format)
        saved_with = f"save_original_format={original_format}"
    except TypeError:
        model.save_pretrained(tmp_dir)
        saved_with = "the default (no save_original_format keyword)"
    path = os.path.join(tmp_dir, "model.safetensors")
    check(os.path.exists(path), f"save_pretrained did not write {path} (sharded?)")
    keys, kda_saved, expert_saved = checkpoint_layout(path)
    print(f"  saved with {saved_with}: KDA tensors {kda_saved}; experts {expert_saved}")
    with open(os.path.join(tmp_dir, "config.json")) as f:
        saved_config = json.load(f)
    print(f"  config.json keys: {sorted(saved_config)}")

    pm, targets = attach_lora(model, seed + 1)
    pm.train()
    expert_keys = expert_adapter_keys(pm)
    adapter_dir = os.path.join(tmp_dir, "adapter")
    adapter, acfg = common.save_peft_adapter(pm, adapter_dir)
    check(acfg.get("r") == LORA_RANK and acfg.get("lora_alpha") == LORA_ALPHA and not acfg.get("use_rslora"),
          f"adapter_config.json: unexpected r/alpha/rslora: {acfg}")
    print(f"  adapter: target_modules={acfg.get('target_modules')} target_parameters={acfg.get('target_parameters')}")

    # A batch whose routing has no near-ties (float32 C++ must pick the same experts).
    moe_layers = [L for L in range(len(mixers)) if L >= 1]
    layers = pm.get_base_model().model.layers
    ns = type("RouterShape", (), dict(n_routed_experts=COMMON["num_experts"], n_group=groups[0],
                                      topk_group=groups[1], num_experts_per_tok=top_k))
    for attempt in range(mf.MAX_DATA_TRIES):
        ids, labels = make_batch(COMMON["vocab_size"], seed + 100 + attempt)
        with torch.no_grad():
            _, _, store = forward(pm, ids.to(device), labels.to(device))
        margin = common.smallest_routing_margin(store, moe_layers, lambda L: layers[L].mlp.gate, ns)
        if margin >= mf.MIN_ROUTING_MARGIN:
            break
    else:
        fail(f"no batch with routing margin >= {mf.MIN_ROUTING_MARGIN} in {mf.MAX_DATA_TRIES} tries")
    print(f"  batch seed {seed + 100 + attempt}, smallest routing margin {margin:.3e}")

    ids_d, logits, loss, store = common.forward_backward(pm, lambda i, lab: forward(pm, i, lab), ids, labels, device,
                                                         COMMON["vocab_size"])
    common.check_eval_equals_train(pm, ids_d, logits, use_cache=False)

    grads = common.collect_grads(pm, adapter)

    # Reported checks: reload, numpy reference, central differences.
    common.reload_check(KimiLinearForCausalLM, tmp_dir, adapter_dir, device, ids_d, logits, warn, use_cache=False)

    ids_np, labels_np = ids.numpy(), labels.numpy()
    try:
        ref = KimiNumpyReference(tmp_dir, adapter_dir, mixers, q_lora_rank, groups, scaling, shared, top_k, roles,
                                 expert_keys)
        ref_logits = ref.logits(ids_np)

        def probes():
            kda_keys = sorted(k for k in adapter if f".{roles['f_b']}." in k or f".{roles['b']}." in k)
            return kda_keys[:2] + sorted(k for k in adapter if "lora_A" in k)[:1] + [
                ADAPTER_PREFIX + expert_keys["gate_up_proj"].format(L=moe_layers[-1]) + ".lora_B.weight"]
        common.reference_checks(ref, ref_logits, mf.NumpyReference.loss, adapter, logits, loss, ids_np, labels_np,
                                grads, probes, seed, warn)
    except Exception as exc:  # noqa: BLE001
        warn.append(f"numpy reference failed: {type(exc).__name__}: {exc}")

    golden = common.golden_tensors(ids, labels, logits, loss, grads, store, ("hidden.", "attn_out.", "mlp_out."),
                                   moe_layers)
    meta = {
        "generator": "scripts/make_fixtures_kimi_linear.py", "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__, "device": str(device),
        "seed": str(seed), "batch_seed": str(seed + 100 + attempt), "min_routing_margin": f"{margin:.6e}",
        "saved_with": saved_with, "kda_modules": json.dumps(roles, sort_keys=True),
        "kda_checkpoint_tensors": json.dumps(kda_saved), "experts_checkpoint": expert_saved,
        "expert_adapter_keys": json.dumps(expert_keys, sort_keys=True), "warnings": json.dumps(warn),
        "loss": f"{loss.item():.9e}",
    }
    common.save_golden(golden, meta, tmp_dir)
    common.publish(tmp_dir, adapter_dir, out_dir, adapter)
    results[name] = (loss.item(), warn)


def main():
    args = common.parse_args(__doc__, VARIANTS)
    device, names, _ = common.start(args, VARIANTS, cudnn_tf32=False)
    results = {}
    for n in names:
        make_one(n, args.out, device, args.seed, results)

    total = common.summary(args.out, names)
    common.report(results, "reload, numpy reference, central differences", total, 2)


if __name__ == "__main__":
    main()
