#!/usr/bin/env python3
"""Golden fixtures for Kimi K3: NVIDIA NeMo AutoModel's kimi_k3 model code + PEFT.

The reference is an implementation that is not ours and not transformers': NeMo AutoModel's native
`KimiK3ForCausalLM` (nemo_automodel/components/models/kimi_k3/model.py: gated NoPE MLA with q LoRA,
SiTU MLPs, the latent MoE with its sigmoid router, Block Attention Residuals) and its checkpoint
adapter (state_dict_adapter.py: the released names, `language_model.` prefix, block_sparse_moe,
experts w1/w3/w2, MXFP4 `weight_packed` / `weight_scale`). kimi_k3 and kimi_k3_mxfp4 are all MLA.
kimi_k3_hybrid (BF16 experts) and kimi_k3_hybrid_mxfp4 mix NeMo's KimiDeltaAttention (K3's flags:
q/k/v projections with one short conv each, full-rank output gate g_proj, bounded decay
lower_bound * sigmoid(exp(A_log) (f + dt_bias)), lower bound -5) with MLA. NeMo's KDA layer calls fla (ShortConvolution, FusedRMSNormGated, chunk_kda
/ fused_recurrent_kda), which is not installed where this runs; for those variants only, this script
puts torch stand-ins under those names in NeMo's module (KDA STAND-INS in scripts/fixtures/kimi_k3_nemo.py: fla's documented
semantics, the delta rule token by token) and reports the recurrence against transformers' own torch
chunked KDA when this transformers has one. Everything else in the layer (projections, LoRA, NeMo's
torch decay gate, reshapes, the output gate) is NeMo's code. kimi_k3_bf16 and kimi_k3_mxfp4_bf16
are hybrids conditioned for the GPU's bf16 check: every expert chosen, every frozen weight a bf16 value.

Per config it writes <out>/<name>/ like scripts/make_fixtures_kimi_linear.py:

    config.json, model.safetensors   a released-style kimi_k3 directory (text_config + vision_config;
                                     tensors under the checkpoint names NeMo's to_hf gives)
    adapter/                         PEFT LoRA adapter under the checkpoint names
                                     (base_model.model.language_model.model.layers...)
    golden.safetensors               batch, labels, logits, loss, one gradient per adapter tensor,
                                     per-layer activations and routing for debugging

The model is built from the written config.json by NeMo's KimiK3Config and loads the written
model.safetensors through NeMo's from_hf (which dequantizes MXFP4 experts with its
dequantize_mxfp4), so the reference runs on exactly what the files hold. It runs in eval mode:
NeMo's KimiK3MoE then takes its checkpoint-order path (_forward_reference_order); eval and train
differ in nothing else (no dropout, no router noise), and the train-mode path (GroupedExperts'
loop) is compared and reported.

NeMo's to_hf stores the KDA A_log zero-padded to a multiple of 128 heads (the released layout);
the fixture keeps its H entries (NeMo's from_hf reads both; moetrain's importer reads [H] only).

Checks. Fatal (nothing is written): the model has the requested structure; the written checkpoint
loads back through NeMo to the values it was written from, and its MXFP4 bytes decode (by this
script's own reading of the format) to the weights NeMo loaded; every adapter tensor gets a non-zero
gradient; routing has no near-ties (2e-4) and matches the documented algorithm; at least half the
experts of every MoE layer get tokens. Reported (WARN, the files are still written): a fresh NeMo
model + the saved adapter reproduce the logits; train-mode logits equal eval-mode ones; an
independent float64 numpy forward that reads only the saved files reproduces logits and loss;
central differences of that forward match a few gradient entries.

Needs torch, transformers 5.x, peft, safetensors, numpy and a NeMo AutoModel source tree (a
checkout, or the trimmed copy in .nemo_ref/ described in docs/FIXTURES.md); CPU is enough.

    python3 scripts/make_fixtures_kimi_k3.py --out tests/fixtures/golden [--nemo PATH]
"""

import collections
import json
import math
import os
import re
import sys
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded (transformers' kernel-hub wrappers)
import make_fixtures as mf  # noqa: E402  (shared helpers; it checks the imports and sets CUBLAS_WORKSPACE_CONFIG)
from fixtures import common  # noqa: E402
from fixtures.kimi_k3_nemo import (CausalShortConv, GatedRmsNorm, KDA_CROSSCHECK, import_nemo,  # noqa: E402
                                   install_kda_stand_ins)
from fixtures.kimi_k3_reference import TEXT_PREFIX, K3NumpyReference, mxfp4_decode, plain_name  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import peft  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file as torch_save_file  # noqa: E402
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict  # noqa: E402

fail, check = mf.fail, mf.check
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, SEQ = 2, 24
IGNORE = mf.IGNORE
EXTRA_MASKED = [(0, 2), (0, 9), (1, 0), (1, 5), (1, 20)]
LORA_RANK, LORA_ALPHA, B_STD, BIAS_MAX = mf.LORA_RANK, mf.LORA_ALPHA, mf.B_STD, mf.BIAS_MAX
ADAPTER_PREFIX = mf.ADAPTER_PREFIX
# LoRA on nn.Linear modules by name; the dense MLP and the shared experts (gate/up/down_proj) through
# target_parameters, as make_fixtures.py does and for its reason (PEFT rewrites those names in
# target_modules for transformers MoE model types, and K3's text config says kimi_linear).
LINEAR_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "g_proj",
                  "routed_expert_down_proj", "routed_expert_up_proj"]
MLP_PARAMS = mf.MLP_PARAMS
# KDA's nn.Linear modules besides g_proj and o_proj (which LINEAR_TARGETS already names).
KDA_TARGETS = ["q_proj", "k_proj", "v_proj", "f_a_proj", "f_b_proj", "b_proj"]
# K3's KDA settings at toy size (linear_attn_config; every config.json of this script carries them).
KDA = dict(head_dim=8, num_heads=2, short_conv_kernel_size=4, use_full_rank_gate=True, gate_lower_bound=-5.0)

# Shared by both configs. D, the latent width L and the expert width F all differ (a transposed
# weight cannot pass unnoticed); L and F are multiples of 32 (one MXFP4 scale per 32 inputs: the
# experts' gate/up rows hold one group, their down rows two).
COMMON = dict(
    vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=5,
    num_attention_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
    num_experts=8, num_experts_per_token=2, num_shared_experts=2, moe_intermediate_size=64,
    routed_expert_hidden_size=32, latent_moe_use_norm=True, rms_norm_eps=1e-5,
)
# One config: routed expert storage, attn_res_block_size, (activation_situ_beta,
# activation_situ_linear_beta), (num_expert_group, topk_group), routed_scaling_factor, experts per
# token, whether every frozen weight is a bf16 value (F32 still; for the GPU's bf16 check), and
# factors on the drawn embedding and on the drawn output projections (BF16_CONDITIONED says why).
Variant = collections.namedtuple("Variant", "experts block betas groups scaling top_k bf16_weights embed_scale out_scale",
                                 defaults=(COMMON["num_experts_per_token"], False, 1.0, 1.0))
# The bf16 fixtures' weights, conditioned so that bf16 activations keep the logits and gradients
# within bf16 tolerances of the fp32 reference. With attention residuals each layer's output is
# about as large as its input (the partial sum holds only the current block, the mixes are convex),
# so a rounding in layer 0 reaches the logits with a gain of about 1.3 per sublayer: drawn like
# kimi_k3_hybrid, a CPU emulation of the GPU's bf16 roundings (every activation op's output, the
# LoRA weights) leaves the logits 0.165 / 0.134 (scaled) from fp32, and the H200 measured 0.150 /
# 0.148. An embedding 4x larger (the first value of every depth mix) and halved attention outputs
# (o_proj) and latent-MoE projections (routed_expert_down_proj / up_proj) lower the gain: the same
# emulation then gives 0.018 / 0.020 (logits) and 0.12 / 0.10 (worst gradient). Powers of two, so
# the weights stay bf16 values and the draws stay those of the other configs.
BF16_CONDITIONED = dict(top_k=COMMON["num_experts"], bf16_weights=True, embed_scale=4.0, out_scale=0.5)
OUT_PROJECTIONS = re.compile(r"(\.self_attn\.o_proj|\.mlp\.routed_expert_down_proj|\.mlp\.routed_expert_up_proj)\.weight$")
VARIANTS = {
    # K3's released flags (SiTU 4 / 25, one expert group, scaling 1); blocks of 2: layers 0, 2, 4 file
    # a block summary, so the final mix sees three summaries and the partial sum of layer 4.
    "kimi_k3": Variant("bf16", 2, (4.0, 25.0), (1, 1), 1.0),
    # Packed experts; blocks of 3 (a block closes inside the model, the last one is partial); betas
    # small enough that both tanh caps bend; group-limited routing and a scaling factor.
    "kimi_k3_mxfp4": Variant("mxfp4", 3, (2.0, 1.5), (2, 1), 2.5),
    # KDA and MLA 4 : 2 (layers K K K M K M, as K3 interleaves them) with K3's released flags; blocks of 2
    # file summaries at layers 0, 2, 4 (each KDA), so the final mix sees three summaries and the
    # partial sum of layer 5.
    "kimi_k3_hybrid": Variant("bf16", 2, (4.0, 25.0), (1, 1), 1.0),
    # The released model at toy size: the hybrid layers with MXFP4 experts and K3's flags; blocks of
    # 3 file summaries at layers 0 (KDA) and 3 (MLA), and the last block (3-5) is full when the
    # final mix reads it.
    "kimi_k3_hybrid_mxfp4": Variant("mxfp4", 3, (4.0, 25.0), (1, 1), 1.0),
    # For the GPU's bf16 check (tests/cuda/test_cuda_golden_model.cpp), as kimi_linear_bf16 is for
    # Kimi-Linear: every expert is chosen (top 8 of 8), so routing has no top-k boundary a bf16
    # rounding could flip, and every frozen weight is a bf16 value, so what the GPU rounds is only
    # its activations; weights conditioned as BF16_CONDITIONED says. The other K3 fixtures are
    # ill-conditioned in bf16 (their top-2 choices flip).
    # BF16 experts; the hybrid layers, blocks of 2, a scaling factor.
    "kimi_k3_bf16": Variant("bf16", 2, (4.0, 25.0), (1, 1), 2.5, **BF16_CONDITIONED),
    # The same with MXFP4 experts (every E2M1 value times an E8M0 scale is a bf16 value), blocks of 3
    # and betas at which both tanh caps bend.
    "kimi_k3_mxfp4_bf16": Variant("mxfp4", 3, (2.0, 1.5), (1, 1), 2.5, **BF16_CONDITIONED),
}
# name -> 0-based KDA layers, number of layers, tokens per sequence, masked label positions; the
# others: all MLA, COMMON's layers, SEQ, EXTRA_MASKED. 70 tokens = one full 64-token chunk of fla's
# chunked kernel and a partial one (masked labels on both sides of the boundary).
HYBRID_PLAN = ([0, 1, 2, 4], 6, 70, [(0, 2), (0, 40), (1, 0), (1, 5), (1, 66)])
HYBRID = {name: HYBRID_PLAN for name in ("kimi_k3_hybrid", "kimi_k3_hybrid_mxfp4", "kimi_k3_bf16", "kimi_k3_mxfp4_bf16")}


def layer_plan(name):
    kda, n, seq, masked = HYBRID.get(name, ([], COMMON["num_hidden_layers"], SEQ, EXTRA_MASKED))
    return types.SimpleNamespace(kda=list(kda), n=n, seq=seq, masked=list(masked))


def linear_targets(plan):
    return LINEAR_TARGETS + (KDA_TARGETS if plan.kda else [])
MXFP4_SCALE_BYTES = (121, 124)  # E8M0 scales 2^-6 .. 2^-4: weights of about the size of 1/sqrt(fan_in)


# ----------------------------------------------------------------------------------------------
# config.json
# ----------------------------------------------------------------------------------------------


def k3_config_json(variant, plan):
    """A released-style kimi_k3 config.json (KimiK3Config's layout): the language model's settings
    in text_config (model_type kimi_linear), a vision_config, and for packed experts the
    compressed-tensors quantization_config."""
    experts, block, (beta, linear_beta), (groups, topk_groups), scaling = variant[:5]
    c = COMMON
    n = plan.n
    text = dict(
        model_type="kimi_linear", architectures=["KimiK3ForCausalLM"],
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=n, num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_attention_heads"], hidden_act="situ",
        activation_situ_beta=beta, activation_situ_linear_beta=linear_beta,
        rms_norm_eps=c["rms_norm_eps"], tie_word_embeddings=False, max_position_embeddings=1024, use_cache=False,
        pad_token_id=None, bos_token_id=1, eos_token_id=2,
        moe_intermediate_size=c["moe_intermediate_size"], moe_renormalize=True, moe_router_activation_func="sigmoid",
        num_experts=c["num_experts"], num_experts_per_token=variant.top_k,
        num_shared_experts=c["num_shared_experts"], routed_scaling_factor=scaling, first_k_dense_replace=1,
        moe_layer_freq=1, use_grouped_topk=True, num_expert_group=groups, topk_group=topk_groups,
        topk_method="noaux_tc", routed_expert_hidden_size=c["routed_expert_hidden_size"],
        latent_moe_use_norm=c["latent_moe_use_norm"],
        q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"], qk_nope_head_dim=c["qk_nope_head_dim"],
        qk_rope_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"], mla_use_nope=True,
        mla_use_output_gate=True,
        # 1-based as released; K3's KDA settings also where no layer is KDA (for the importer).
        linear_attn_config=dict(kda_layers=[L + 1 for L in plan.kda],
                                full_attn_layers=[L + 1 for L in range(n) if L not in plan.kda], **KDA),
        attn_res_block_size=block, num_nextn_predict_layers=0,
    )
    if experts == "mxfp4":
        text["quantization_config"] = dict(
            quant_method="compressed-tensors", format="mxfp4-pack-quantized", quantization_status="compressed",
            config_groups=dict(group_0=dict(
                format="mxfp4-pack-quantized", targets=[r"re:.*block_sparse_moe\.experts\.\d+\.w[123]$"],
                weights=dict(num_bits=4, type="float", strategy="group", group_size=32, symmetric=True,
                             dynamic=False, scale_dtype="torch.uint8"),
                input_activations=None, output_activations=None)),
            ignore=["lm_head"], kv_cache_scheme=None)
    vision = dict(model_type="kimi_k3_vision", patch_size=14, vt_num_attention_heads=2, vt_num_hidden_layers=2,
                  vt_hidden_size=32, vt_intermediate_size=64, merge_kernel_size=[2, 2], mm_hidden_size=32,
                  text_hidden_size=c["hidden_size"])
    top = dict(model_type="kimi_k3", architectures=["KimiK3ForConditionalGeneration"], text_config=text,
               vision_config=vision, ignore_index=-100, media_placeholder_token_id=c["vocab_size"] - 1,
               pad_token_id=0, tie_word_embeddings=False)
    if experts == "mxfp4":
        top["quantization_config"] = text["quantization_config"]  # KimiK3Config copies it to the top
    return top


def load_nemo_config(nemo, hf_dir, warn):
    """NeMo's KimiK3Config from the written config.json, as NeMo loads a released checkpoint."""
    try:
        return nemo.config.KimiK3Config.from_pretrained(hf_dir)
    except Exception as exc:  # noqa: BLE001 - a transformers-version mismatch; fall back and say so
        warn.append(f"KimiK3Config.from_pretrained failed ({type(exc).__name__}: {exc}); built from the dict")
        with open(os.path.join(hf_dir, "config.json")) as f:
            top = json.load(f)
        text = {k: v for k, v in top["text_config"].items() if k != "model_type"}
        vision = {k: v for k, v in top["vision_config"].items() if k != "model_type"}
        return nemo.config.KimiK3Config(text_config=text, vision_config=vision)


# ----------------------------------------------------------------------------------------------
# model and checkpoint
# ----------------------------------------------------------------------------------------------


def build_model(nemo, config, variant, device, plan):
    """NeMo's KimiK3ForCausalLM with the eager attention backend and the torch expert loop, in fp32."""
    experts, block, (beta, linear_beta), groups, scaling = variant[:5]
    backend = nemo.BackendConfig(attn="eager", linear="torch", rms_norm="torch", experts="torch",
                                 dispatcher="torch", enable_hf_state_dict_adapter=True, gate_precision=torch.float32)
    model = nemo.model.KimiK3ForCausalLM(config, backend=backend).to(device=device, dtype=torch.float32)
    # Merged experts are built in the adapter's dtype (the model's, bf16 by default): fp32 here.
    model.state_dict_adapter.dtype = torch.float32
    tc = model.config
    c = COMMON
    check(tc.attn_res_block_size == block and tc.activation_situ_beta == beta
          and tc.activation_situ_linear_beta == linear_beta and tc.routed_scaling_factor == scaling
          and tc.routed_expert_hidden_size == c["routed_expert_hidden_size"] and tc.latent_moe_use_norm,
          f"NeMo's config did not take config.json's K3 settings: {tc}")
    layers = model.model.layers
    check(list(layers) == [str(i) for i in range(plan.n)], f"layers {list(layers)}")
    for i, layer in layers.items():
        i = int(i)
        attn = layer.self_attn
        if i in plan.kda:
            check(type(attn).__name__ == "KimiDeltaAttention" and layer.is_linear_attn and attn.use_full_rank_gate
                  and attn.gate_lower_bound == KDA["gate_lower_bound"] and attn.num_heads == KDA["num_heads"]
                  and attn.head_dim == KDA["head_dim"] and attn.conv_size == KDA["short_conv_kernel_size"]
                  and hasattr(attn, "g_proj") and not hasattr(attn, "g_a_proj")
                  and all(isinstance(getattr(attn, f"{s}_conv1d")._fp32_params, CausalShortConv) for s in "qkv")
                  and isinstance(attn.o_norm._fp32_params, GatedRmsNorm),
                  f"layer {i}: {type(attn).__name__}, want K3's KDA (full-rank gate, lower bound, the stand-ins)")
            check(getattr(attn.config, "kda_use_qk_l2norm_in_kernel", True), f"layer {i}: q/k L2 norm outside the kernel")
        else:
            check(type(attn).__name__ == "KimiMLAAttention" and attn.use_output_gate
                  and attn.q_lora_rank == c["q_lora_rank"], f"layer {i}: {type(attn).__name__}, want gated MLA with q LoRA")
        check(layer.use_attn_residuals and layer.attn_res_block_size == block, f"layer {i}: no attention residuals")
        if i == 0:
            check(type(layer.mlp).__name__ == "KimiK3MLP", f"layer 0 is {type(layer.mlp).__name__}, want the dense MLP")
            check(layer.mlp.act_fn.beta == beta and layer.mlp.act_fn.linear_beta == linear_beta, "layer 0 SiTU betas")
        else:
            moe = layer.mlp
            check(type(moe).__name__ == "KimiK3MoE", f"layer {i} is {type(moe).__name__}, want KimiK3MoE")
            E, F_, Lw = c["num_experts"], c["moe_intermediate_size"], c["routed_expert_hidden_size"]
            check(tuple(moe.experts.gate_and_up_projs.shape) == (E, Lw, 2 * F_)
                  and tuple(moe.experts.down_projs.shape) == (E, F_, Lw), f"layer {i}: expert shapes")
            check(moe.routed_expert_norm is not None and moe.shared_experts is not None
                  and moe.shared_experts.intermediate_size == F_ * c["num_shared_experts"], f"layer {i}: latent MoE parts")
            check(moe.gate.e_score_correction_bias is not None and moe.gate.n_groups == groups[0]
                  and moe.gate.topk_groups == groups[1] and moe.gate.route_scale == scaling
                  and moe.gate.topk == variant.top_k, f"layer {i}: router")
    check(model.model.use_attn_residuals, "no output attention-residual mix")
    return model


@torch.no_grad()
def init_weights(model, seed, bf16_weights=False, embed_scale=1.0, out_scale=1.0):
    """Every parameter from one seeded generator (matrices N(0, 1/fan_in), norms 1 + 0.1 N(0, 1), the
    router's score bias U[0, 0.2); KDA's A_log and dt_bias as below, its convs [C, 1, W] N(0, 1/W));
    NeMo's own init (zero residual queries, ones) would leave the depth mixes uniform and hide their
    weights. The embedding is then multiplied by embed_scale and the output projections
    (OUT_PROJECTIONS) by out_scale; with bf16_weights each value is rounded to bf16 (the same draws)."""
    gen = torch.Generator().manual_seed(seed)

    def rounded(val):
        return val.to(torch.bfloat16).float() if bf16_weights else val

    scaled = 0
    for name, p in sorted(model.named_parameters()):
        if name.endswith("embed_tokens.weight"):
            val = torch.randn(p.shape, generator=gen)
        elif name.endswith(("experts.gate_and_up_projs", "experts.down_projs")):
            val = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1])  # [E, in, out]
        elif p.ndim >= 2:
            val = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
        elif "norm" in name:
            val = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        elif name.endswith(".A_log"):  # KDA: exp(A_log) in [0.5, 3)
            val = torch.log(0.5 + 2.5 * torch.rand(p.shape, generator=gen))
        elif name.endswith(".dt_bias"):  # KDA: decays from ~0 (long memory) to the lower bound
            val = -2.5 + torch.randn(p.shape, generator=gen)
        else:
            fail(f"init_weights: unexpected parameter {name} {tuple(p.shape)}")
        if name.endswith("embed_tokens.weight"):
            val = val * embed_scale
        elif OUT_PROJECTIONS.search(name):
            val = val * out_scale
            scaled += 1
        p.copy_(rounded(val).to(p.dtype))
    layers = len(model.model.layers)  # an o_proj in each, the two latent projections in each MoE layer
    check(scaled == 3 * layers - 2, f"init_weights: {scaled} output projections matched, want {3 * layers - 2}")
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.copy_(rounded(BIAS_MAX * torch.rand(b.shape, generator=gen)).to(b.dtype))


EXPERT_KEY = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight$")


def unpadded_a_log(key, value):
    """NeMo's to_hf writes a KDA layer's A_log [H] zero-padded to a multiple of 128 entries, as the
    released K3 stores it; the fixture keeps the H entries (the docstring says why)."""
    if not key.endswith(".self_attn.A_log"):
        return value
    heads = KDA["num_heads"]
    check(value.ndim == 1 and value.shape[0] >= heads and not value[heads:].any(),
          f"{key}: {tuple(value.shape)}, want [{heads}] zero-padded")
    return value[:heads].contiguous()


def checkpoint_tensors(model, experts, seed):
    """The model's weights under the checkpoint names (NeMo's to_hf), experts stored as requested:
    BF16 (the values rounded to BF16 first), or MXFP4 codes and scales drawn at random (the reference
    then runs on what NeMo decodes from them)."""
    sd = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    hf = model.state_dict_adapter.to_hf(sd)
    gen = torch.Generator().manual_seed(seed + 7)
    out = {}
    for key in sorted(hf):
        value = unpadded_a_log(key, hf[key].detach().cpu().contiguous())
        if EXPERT_KEY.search(key):
            if experts == "bf16":
                out[key] = value.to(torch.bfloat16)
            else:
                rows, cols = value.shape
                codes = torch.randint(0, 16, (rows, cols), generator=gen, dtype=torch.int64)
                out[key + "_packed"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8).contiguous()
                out[key + "_scale"] = torch.randint(*MXFP4_SCALE_BYTES, (rows, cols // 32), generator=gen,
                                                    dtype=torch.int64).to(torch.uint8).contiguous()
        else:
            out[key] = value.float()
    return out


def load_checkpoint(model, hf_dir):
    """model.safetensors through NeMo's from_hf (MXFP4 decoded by its dequantize_mxfp4) into `model`."""
    with safe_open(os.path.join(hf_dir, "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    native = model.state_dict_adapter.from_hf(sd)
    result = model.load_state_dict(native, strict=False)
    check(not result.missing_keys and not result.unexpected_keys,
          f"NeMo's from_hf of the written checkpoint: missing {result.missing_keys}, unexpected {result.unexpected_keys}")


def check_loaded(model, written):
    """The loaded model, mapped back to the checkpoint names, holds exactly what the file says (MXFP4
    decoded by this script's reading of the format)."""
    hf = model.state_dict_adapter.to_hf({k: v.detach().cpu() for k, v in model.state_dict().items()})
    want_keys = {k[:-len("_packed")] for k in written if k.endswith("_packed")} | {
        k for k in written if not k.endswith(("_packed", "_scale"))}
    check(set(hf) == want_keys, f"to_hf names differ from the file's: {sorted(set(hf) ^ want_keys)[:6]}")
    for key, value in hf.items():
        value = unpadded_a_log(key, value)
        if key + "_packed" in written:
            want = mxfp4_decode(written[key + "_packed"].numpy(), written[key + "_scale"].numpy())
        else:
            want = written[key].double().numpy()
        got = value.detach().double().numpy()
        check(got.shape == want.shape and np.array_equal(got, want),
              f"{key}: the model NeMo loaded differs from the file (max |d| "
              f"{np.abs(got - want).max() if got.shape == want.shape else 'shape ' + str(got.shape)})")


def check_bf16_values(written):
    """Every frozen weight of the checkpoint is a bf16 value (MXFP4 experts as decoded), so the GPU's
    bf16 copy of the model is exactly this one."""
    for key, value in written.items():
        if key.endswith("_scale"):
            continue
        if key.endswith("_packed"):
            base = key[:-len("_packed")]
            value = torch.from_numpy(mxfp4_decode(value.numpy(), written[base + "_scale"].numpy()))
        value = value.double()
        check(torch.equal(value.to(torch.bfloat16).double(), value), f"{key}: not every value is a bf16 value")


def checkpoint_summary(keys):
    layer0 = sorted(k.split(".layers.0.")[1] for k in keys if ".layers.0." in k)
    layer1 = sorted({re.sub(r"experts\.\d+\.", "experts.<e>.", k.split(".layers.1.")[1]) for k in keys if ".layers.1." in k})
    top = sorted(k for k in keys if ".layers." not in k)
    return layer0, layer1, top


# ----------------------------------------------------------------------------------------------
# LoRA
# ----------------------------------------------------------------------------------------------


def lora_config(targets):
    return LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0, use_rslora=False, bias="none",
                      init_lora_weights=True, target_modules=list(targets), target_parameters=list(MLP_PARAMS))


def expected_adapter_modules(plan):
    """Native module paths PEFT must wrap."""
    out = set()
    for L in range(plan.n):
        p = f"model.layers.{L}"
        if L in plan.kda:
            out.update(f"{p}.self_attn.{m}" for m in KDA_TARGETS + ["g_proj", "o_proj"])
        else:
            out.update(f"{p}.self_attn.{m}" for m in LINEAR_TARGETS[:6])
        if L == 0:
            out.update(f"{p}.mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj"))
        else:
            out.update(f"{p}.mlp.shared_experts.{m}" for m in ("gate_proj", "up_proj", "down_proj"))
            out.update(f"{p}.mlp.{m}" for m in LINEAR_TARGETS[6:])
    return out


def attach_lora(model, seed, plan):
    targets = linear_targets(plan)
    pm = get_peft_model(model, lora_config(targets))
    live = pm.peft_config["default"]
    check(set(live.target_modules) == set(targets) and set(live.target_parameters or []) == set(MLP_PARAMS)
          and not live.rank_pattern and not live.alpha_pattern,
          f"PEFT rewrote the LoRA config: target_modules={live.target_modules} target_parameters="
          f"{live.target_parameters} rank_pattern={live.rank_pattern} alpha_pattern={live.alpha_pattern}")
    gen = torch.Generator().manual_seed(seed)
    wrapped = set()
    with torch.no_grad():
        for name, p in sorted((n, p) for n, p in pm.named_parameters() if p.requires_grad):
            val = common.lora_value(name, p, gen, B_STD)
            wrapped.add(name[len(ADAPTER_PREFIX):].split(".lora_")[0])
            p.copy_(val.to(p.dtype))
    want = expected_adapter_modules(plan)
    check(wrapped == want, f"PEFT wrapped {sorted(wrapped ^ want)[:8]} unlike the plan (missing or extra)")
    return pm


def hf_adapter_key(model, native_key):
    """A PEFT key of the native model ('base_model.model.model.layers.L...') under the checkpoint's
    names, by NeMo's to_hf (block_sparse_moe, the language_model. prefix inside base_model.model.)."""
    converted = model.state_dict_adapter.convert_single_tensor_to_hf(native_key, torch.zeros(1))
    check(len(converted) == 1, f"to_hf maps {native_key} to {len(converted)} keys")
    return converted[0][0]


def native_adapter_key(hf_key):
    """The inverse, by NeMo's from_hf helpers."""
    sda = sys.modules["nemo_automodel.components.models.kimi_k3.state_dict_adapter"]
    return sda._hf_moe_key_to_native(sda.KimiK3StateDictAdapter._strip_hf_text_prefix(hf_key))


def save_adapter(pm, model, adapter_dir):
    os.makedirs(adapter_dir, exist_ok=True)
    native = get_peft_model_state_dict(pm)
    hf = {}
    for key, value in native.items():
        hf_key = hf_adapter_key(model, key)
        check(hf_key.startswith(ADAPTER_PREFIX + TEXT_PREFIX + "model.layers.")
              and native_adapter_key(hf_key) == key, f"adapter key {key} -> {hf_key} does not round-trip")
        hf[hf_key] = value.detach().cpu().float().contiguous()
    torch_save_file(hf, os.path.join(adapter_dir, "adapter_model.safetensors"))
    pm.peft_config["default"].save_pretrained(adapter_dir)
    # Short names need no renaming (NeMo's map_peft_target_module_to_hf leaves them as they are).
    acfg = common.sort_adapter_config(adapter_dir, model.state_dict_adapter.map_peft_target_module_to_hf)
    check(acfg.get("r") == LORA_RANK and acfg.get("lora_alpha") == LORA_ALPHA and not acfg.get("use_rslora")
          and not acfg.get("rank_pattern") and not acfg.get("alpha_pattern"), f"adapter_config.json: {acfg}")
    return hf, acfg


# ----------------------------------------------------------------------------------------------
# batch and forward
# ----------------------------------------------------------------------------------------------


def make_batch(vocab, seed, seq=SEQ, masked=EXTRA_MASKED):
    return common.make_batch(vocab, seed, BATCH, seq, masked)


def forward(model, ids, labels):
    """Logits, loss and debugging activations of NeMo's model (LoRA injected) on the batch."""
    store = {}
    m = model.model
    save_in = common.input_saver(store)

    # Pre-hooks on modules the common hooks do not touch: the order in which they fire is unchanged.
    def more_hooks(i, layer):
        handles = [layer.input_layernorm.register_forward_pre_hook(save_in(f"attn_in.layers.{i}")),
                   layer.post_attention_layernorm.register_forward_pre_hook(save_in(f"mlp_in.layers.{i}"))]
        if hasattr(layer.mlp, "gate"):
            def router_hook(_mod, inp, out, i=i):
                check(isinstance(out, tuple) and len(out) == 3, "KimiK3Gate no longer returns (weights, indices, aux)")
                store[f"router_in.layers.{i}"] = inp[0].detach().clone()
                store[f"router.layers.{i}.raw_weight"] = out[0].detach().clone()
                store[f"router.layers.{i}.raw_index"] = out[1].detach().clone()
            handles.append(layer.mlp.gate.register_forward_hook(router_hook))
        return handles
    handles = common.activation_hooks(m, m.layers.items(), store, more_hooks)
    handles.append(m.norm.register_forward_pre_hook(save_in("hidden.output_mix")))
    logits = common.run_hooked(handles, lambda: model(input_ids=ids).logits)
    check(tuple(logits.shape) == tuple(ids.shape) + (COMMON["vocab_size"],), f"logits shape {tuple(logits.shape)}")
    return logits, mf.masked_mean_ce(logits, labels), store


# ----------------------------------------------------------------------------------------------
# one config
# ----------------------------------------------------------------------------------------------


def make_one(nemo, name, out_root, device, seed, results):
    variant = VARIANTS[name]
    experts = variant.experts
    plan = layer_plan(name)
    if plan.kda:
        install_kda_stand_ins(nemo)
        KDA_CROSSCHECK.clear()
    out_dir, tmp_dir = common.fresh_tmp_dir(out_root, name)
    print(f"\n=== {name}: experts {experts}, attn_res_block_size {variant.block}, SiTU betas {variant.betas}, "
          f"groups {variant.groups}, routed_scaling_factor {variant.scaling}, top {variant.top_k}, "
          f"bf16 weights {variant.bf16_weights}"
          + (f", KDA layers {plan.kda} of {plan.n}, {plan.seq} tokens" if plan.kda else ""))
    warn = []

    with open(os.path.join(tmp_dir, "config.json"), "w") as f:
        json.dump(k3_config_json(variant, plan), f, indent=2, sort_keys=True)
        f.write("\n")
    config = load_nemo_config(nemo, tmp_dir, warn)
    torch.manual_seed(seed)
    model = build_model(nemo, config, variant, device, plan)
    init_weights(model, seed, variant.bf16_weights, variant.embed_scale, variant.out_scale)
    written = checkpoint_tensors(model, experts, seed)
    torch_save_file(written, os.path.join(tmp_dir, "model.safetensors"))
    load_checkpoint(model, tmp_dir)
    check_loaded(model, written)
    if variant.bf16_weights:
        check_bf16_values(written)
    layer0, layer1, top = checkpoint_summary(written)
    print(f"  model.safetensors ({len(written)} tensors): top {top}\n    layer 0 {layer0}\n    layer 1 {layer1}")
    dtypes = sorted({str(v.dtype) for v in written.values()})
    print(f"  dtypes {dtypes}; loaded back through NeMo's from_hf: identical")
    model.eval()

    pm = attach_lora(model, seed + 1, plan)
    adapter_dir = os.path.join(tmp_dir, "adapter")
    adapter, acfg = save_adapter(pm, model, adapter_dir)
    print(f"  adapter: {len(adapter)} tensors, target_modules={acfg.get('target_modules')} "
          f"target_parameters={acfg.get('target_parameters')}")

    # A batch whose routing has no near-ties (float32 C++ must pick the same experts).
    moe_layers = list(range(1, plan.n))
    groups = variant.groups
    ns = types.SimpleNamespace(n_routed_experts=COMMON["num_experts"], n_group=groups[0], topk_group=groups[1],
                               num_experts_per_tok=variant.top_k)
    for attempt in range(mf.MAX_DATA_TRIES):
        ids, labels = make_batch(COMMON["vocab_size"], seed + 100 + attempt, plan.seq, plan.masked)
        with torch.no_grad():
            _, _, store = forward(model, ids.to(device), labels.to(device))
        margin = common.smallest_routing_margin(store, moe_layers, lambda L: model.model.layers[str(L)].mlp.gate, ns,
                                                "NeMo's")
        if margin >= mf.MIN_ROUTING_MARGIN:
            break
    else:
        fail(f"no batch with routing margin >= {mf.MIN_ROUTING_MARGIN} in {mf.MAX_DATA_TRIES} tries")
    print(f"  batch seed {seed + 100 + attempt}, smallest routing margin {margin:.3e}")
    for L in moe_layers:
        used = len(set(store[f"router.layers.{L}.raw_index"].reshape(-1).tolist()))
        check(2 * used >= COMMON["num_experts"], f"layer {L}: only {used} experts get tokens")

    ids_d, logits, loss, store = common.forward_backward(pm, lambda i, lab: forward(model, i, lab), ids, labels,
                                                         device, COMMON["vocab_size"])

    grads = common.collect_grads(pm, adapter, key_of=lambda key: hf_adapter_key(model, key))

    # Reported checks. Train mode: NeMo's GroupedExperts loop instead of the checkpoint-order loop.
    try:
        model.train()
        with torch.no_grad():
            train_logits = model(input_ids=ids_d).logits
        diff = ((train_logits - logits.detach()).abs().max() / logits.detach().abs().max()).item()
        print(f"  train-mode (GroupedExperts) logits vs eval-mode: max |d| / max |logit| = {diff:.2e}")
        if diff > 1e-5:
            warn.append(f"train-mode logits differ by {diff:.2e}")
    except Exception as exc:  # noqa: BLE001 - reported, the C++ test is the judge
        warn.append(f"train-mode forward failed: {type(exc).__name__}: {exc}")
    finally:
        model.eval()

    # Reload: a fresh NeMo model from the files, the adapter through NeMo's from_hf names.
    try:
        model2 = build_model(nemo, load_nemo_config(nemo, tmp_dir, warn), variant, device, plan)
        load_checkpoint(model2, tmp_dir)
        model2.eval()
        pm2 = get_peft_model(model2, lora_config(linear_targets(plan)))
        with safe_open(os.path.join(adapter_dir, "adapter_model.safetensors"), "pt") as f:
            sd = {native_adapter_key(k): f.get_tensor(k) for k in f.keys()}
        res = set_peft_model_state_dict(pm2, sd)
        unexpected = list(getattr(res, "unexpected_keys", []) or [])
        with torch.no_grad():
            diff = (model2(input_ids=ids_d).logits - logits.detach()).abs().max().item()
        print(f"  reload (fresh NeMo model + from_hf + adapter): max |dlogits| = {diff:.2e}, unexpected keys {unexpected}")
        if diff > 1e-5 or unexpected:
            warn.append(f"reloaded logits differ by {diff:.2e} (unexpected adapter keys {unexpected[:3]})")
        del model2, pm2
    except Exception as exc:  # noqa: BLE001
        warn.append(f"reload failed: {type(exc).__name__}: {exc}")

    ids_np, labels_np = ids.numpy(), labels.numpy()
    try:
        ref = K3NumpyReference(tmp_dir, adapter_dir)
        ref_logits = ref.logits(ids_np)

        def probes():
            P = ADAPTER_PREFIX + TEXT_PREFIX + "model.layers."
            probes = [P + "0.self_attn.q_b_proj.lora_A.weight", P + "0.mlp.up_proj.lora_B.weight",
                      P + "1.block_sparse_moe.shared_experts.down_proj.lora_A.weight",
                      P + "2.block_sparse_moe.routed_expert_down_proj.lora_A.weight",
                      P + "3.self_attn.g_proj.lora_B.weight", P + "4.block_sparse_moe.routed_expert_up_proj.lora_B.weight"]
            if plan.kda:  # KDA's streams (conv + L2 norm, decay, beta, output gate, v) and an MLA layer
                probes = [P + "0.self_attn.q_proj.lora_A.weight", P + "1.self_attn.f_a_proj.lora_A.weight",
                          P + "2.self_attn.b_proj.lora_B.weight", P + "4.self_attn.g_proj.lora_B.weight",
                          P + "4.self_attn.v_proj.lora_A.weight", P + "3.self_attn.q_b_proj.lora_A.weight",
                          P + "0.mlp.up_proj.lora_B.weight",
                          P + "5.block_sparse_moe.routed_expert_up_proj.lora_B.weight"]
            return probes
        common.reference_checks(ref, ref_logits, mf.NumpyReference.loss, ref.ad, logits, loss, ids_np, labels_np,
                                grads, probes, seed, warn, ad_key=plain_name, unused_tail="")
    except Exception as exc:  # noqa: BLE001
        warn.append(f"numpy reference failed: {type(exc).__name__}: {exc}")

    golden = common.golden_tensors(ids, labels, logits, loss, grads, store,
                                   ("hidden.", "attn_in.", "mlp_in.", "attn_out.", "mlp_out."), moe_layers,
                                   per_token=True)
    meta = {
        "generator": "scripts/make_fixtures_kimi_k3.py", "reference": "NeMo AutoModel KimiK3ForCausalLM (eval mode)",
        "nemo_automodel_commit": nemo.commit, "nemo_kimi_k3_sha256_16": json.dumps(nemo.hashes, sort_keys=True),
        "stubbed_modules": json.dumps(nemo.stubbed), "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__, "numpy": np.__version__,
        "device": str(device), "seed": str(seed), "batch_seed": str(seed + 100 + attempt),
        "min_routing_margin": f"{margin:.6e}", "experts_checkpoint": experts, "warnings": json.dumps(warn),
        "loss": f"{loss.item():.9e}", "experts_per_token": str(variant.top_k),
        "bf16_weights": str(variant.bf16_weights), "embed_scale": str(variant.embed_scale),
        "out_scale": str(variant.out_scale),
    }
    if plan.kda:
        compared = [(d, o) for d, o in KDA_CROSSCHECK if o is not None]
        worst = max((d / max(o, 1e-30) for d, o in compared), default=None)
        failed = sorted({d for d, o in KDA_CROSSCHECK if o is None})
        if worst is None:
            note = "not run: " + (failed[0] if failed else "this transformers has no torch_chunk_kda")
        else:
            note = f"max |d| / max |o| {worst:.2e} over {len(compared)} calls"
            if worst > 1e-4:
                warn.append(f"the KDA recurrence differs from transformers' torch_chunk_kda by {worst:.2e}")
        print(f"  KDA recurrence vs transformers' torch_chunk_kda: {note}")
        meta.update({
            "kda_layers": json.dumps(plan.kda), "warnings": json.dumps(warn),
            "kda_kernels": "fla absent: ShortConvolution, FusedRMSNormGated, chunk_kda / fused_recurrent_kda replaced "
                           "by this script's torch stand-ins; NeMo's own _torch_kda_gate",
            "kda_vs_transformers_chunk_kda": note, "a_log_storage": f"[{KDA['num_heads']}] (to_hf's zero padding cut)",
        })
    common.save_golden(golden, meta, tmp_dir)
    common.publish(tmp_dir, adapter_dir, out_dir, adapter, prune_top=False)
    results[name] = (loss.item(), warn)


def main():
    args = common.parse_args(__doc__, VARIANTS, nemo_default=os.path.join(REPO, ".nemo_ref"))
    device, names, nemo = common.start(args, VARIANTS, cudnn_tf32=False, prepare=lambda: import_nemo(args.nemo))
    results = {}
    for n in names:
        make_one(nemo, n, args.out, device, args.seed, results)

    total = common.summary(args.out, names)
    common.report(results, "reload, train mode, numpy reference, central differences", total, 3)


if __name__ == "__main__":
    main()
