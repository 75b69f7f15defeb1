#!/usr/bin/env python3
"""Golden fixtures for the whole-model test (issue 3, "Verification").

Builds two tiny random DeepseekV3ForCausalLM models with transformers, attaches a PEFT LoRA adapter
with non-zero B to every supported target (routed experts included), runs one training-mode
forward/backward on a fixed batch and writes, per config, tests/fixtures/golden/<name>/:
(the *_fused_gate_up configs are the same two models with PEFT's fused expert adapter: gate_up_proj
at rank 2r and alpha 2 alpha through rank_pattern / alpha_pattern, its B random everywhere, i.e. a
full matrix mixing gate and up, as after any PEFT training)

    config.json, model.safetensors   the HF model (save_pretrained, fp32)
    adapter/                         the PEFT adapter (adapter_config.json, adapter_model.safetensors)
    golden.safetensors               batch, labels, logits, loss, one gradient per adapter tensor,
                                     routing and per-layer activations for debugging

Before writing anything it checks its own output: the saved files reload in transformers/PEFT to
the same logits, an independent float64 numpy forward that reads only the saved files reproduces
the logits and the loss (this is the executable form of docs/HF_SEMANTICS.md), a few gradient
entries match central differences, every adapter gradient is non-zero, and routing has no
near-ties that a float32 reimplementation could resolve differently.

Needs torch, transformers 5.x, peft, safetensors, numpy. Usage:

    python3 scripts/make_fixtures.py --out tests/fixtures/golden [--device cpu|cuda] [--seed 1234]

See docs/FIXTURES.md for the contents and docs/HF_SEMANTICS.md for the reference semantics.
"""

import json
import math
import os
import sys

# Must be set before CUDA initialises, for torch.use_deterministic_algorithms with cuBLAS.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import numpy as np  # noqa: E402

try:
    import torch  # noqa: E402
    import torch.nn.functional as F  # noqa: E402
    import transformers  # noqa: E402
    import peft  # noqa: E402
    import safetensors  # noqa: E402,F401  (checked here, used by fixtures.common)
    from safetensors import safe_open  # noqa: E402
    from safetensors.torch import save_file as torch_save_file  # noqa: E402
except ImportError as exc:  # pragma: no cover - depends on the machine
    sys.exit(f"make_fixtures.py needs torch, transformers, peft, safetensors and numpy: {exc}")

from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402

from fixtures import common  # noqa: E402
from fixtures.common import ADAPTER_PREFIX, IGNORE, check, fail, human  # noqa: E402,F401  (the other scripts use mf.*)
from fixtures.deepseek_v3_reference import EXPERT_ADAPTER_KEYS, NumpyReference, pattern_value  # noqa: E402

BATCH, SEQ = 2, 16
# (batch, position) pairs whose label is masked on top of the last position, to exercise the loss mask.
EXTRA_MASKED = [(0, 2), (0, 9), (1, 0), (1, 5), (1, 6)]
LORA_RANK, LORA_ALPHA = 4, 8
B_STD = 0.1  # std of the random lora_B values (PEFT would start at zero, which makes A's gradient vanish)
BIAS_MAX = 0.2  # e_score_correction_bias ~ U[0, BIAS_MAX)
MIN_ROUTING_MARGIN = 2e-4  # smallest allowed gap at any top-k boundary of the router
MAX_DATA_TRIES = 50
EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# The dense MLP (layer 0) and the shared experts are targeted through target_parameters on their 2-D
# weights, not through target_modules: PEFT >= 0.19 on transformers 5 rewrites target_modules entries
# named gate_proj/up_proj/down_proj for MoE models (v4 -> v5 compatibility, _convert_peft_config_moe):
# it drops them from target_modules, targets the fused routed experts instead with rank_pattern/
# alpha_pattern doubled for gate_up_proj, and leaves the dense and shared MLPs without LoRA. A 2-D
# ParamWrapper computes (W + s*B@A) x = W x + s*B(A x), i.e. plain LoRA, and saves the same key
# names as lora.Linear ("...mlp.gate_proj.lora_A.weight").
MLP_PARAMS = ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]

COMMON = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    moe_intermediate_size=16,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    n_group=2,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=32,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    attention_bias=False,
    attention_dropout=0.0,
    rope_interleave=True,
    initializer_range=0.02,  # unused: every weight is set explicitly by init_weights()
    pad_token_id=None,
    bos_token_id=0,
    eos_token_id=1,
)

# Name -> (config overrides, expert layout written to model.safetensors, LoRA Linear targets).
# mscale_all_dim differs from mscale on purpose: then HF's YaRN attention_factor (applied to cos/sin)
# is not 1 and the softmax mscale^2 uses mscale_all_dim, so a reimplementation that mixes the two up
# (or drops either) fails the test. Real DeepSeek-V3 uses 1.0/1.0 where attention_factor is exactly 1.
VARIANTS = {
    "qlora": (
        dict(
            q_lora_rank=24,
            routed_scaling_factor=2.5,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=10000.0,
                factor=4.0,
                original_max_position_embeddings=8,
                beta_fast=32.0,
                beta_slow=1.0,
                mscale=1.0,
                mscale_all_dim=0.8,
            ),
        ),
        "fused",
        ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    ),
    "noqlora": (
        dict(
            q_lora_rank=None,
            routed_scaling_factor=1.0,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0),
        ),
        "per_expert",
        ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
    ),
}


# PEFT's fused expert adapter (what PEFT writes when it converts gate_proj/up_proj targets on
# transformers 5, _convert_peft_config_moe): gate_up_proj at twice the rank and alpha. The same models as
# qlora / noqlora (fused and per-expert model files); only the routed experts' gate_up adapter differs.
GATE_UP_PATTERN = r".*\.gate_up_proj"
for _base in ("qlora", "noqlora"):
    VARIANTS[f"{_base}_fused_gate_up"] = VARIANTS[_base]
FUSED_GATE_UP = {"qlora_fused_gate_up", "noqlora_fused_gate_up"}


def lora_patterns(name):
    """(rank_pattern, alpha_pattern) of config `name`'s adapter."""
    if name in FUSED_GATE_UP:
        return {GATE_UP_PATTERN: 2 * LORA_RANK}, {GATE_UP_PATTERN: 2 * LORA_ALPHA}
    return {}, {}


# ----------------------------------------------------------------------------------------------
# model construction
# ----------------------------------------------------------------------------------------------


def make_config(overrides):
    kwargs = dict(COMMON)
    kwargs.update(overrides)
    try:
        cfg = DeepseekV3Config(num_mtp_layers=0, **kwargs)
    except TypeError:  # older field name
        cfg = DeepseekV3Config(num_nextn_predict_layers=0, **kwargs)
    rp = getattr(cfg, "rope_parameters", None)
    check(isinstance(rp, dict) and rp.get("rope_type") == overrides["rope_parameters"]["rope_type"],
          f"config.rope_parameters not taken as given: {rp!r} (transformers {transformers.__version__})")
    check(cfg.qk_head_dim == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, "qk_head_dim")
    return cfg


def build_model(cfg, device):
    model = DeepseekV3ForCausalLM._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    )
    check(model.config._attn_implementation == "eager",
          f"attention implementation is {model.config._attn_implementation!r}, want 'eager'")
    check(getattr(model.config, "_experts_implementation", "eager") == "eager",
          f"experts implementation is {model.config._experts_implementation!r}, want 'eager'")
    experts = model.model.layers[cfg.first_k_dense_replace].mlp.experts
    E, F_, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    check(hasattr(experts, "gate_up_proj") and tuple(experts.gate_up_proj.shape) == (E, 2 * F_, D),
          "this transformers version does not keep routed experts as a fused gate_up_proj [E, 2F, D] "
          f"parameter (got {type(experts).__name__}); the script and docs/HF_SEMANTICS.md assume 5.x")
    check(tuple(experts.down_proj.shape) == (E, D, F_), "experts.down_proj is not [E, D, F]")
    check(not getattr(experts, "is_transposed", False), "experts.is_transposed is set: layout differs")
    return model.to(device)


@torch.no_grad()
def init_weights(model, seed):
    """Sets every parameter and the routing bias from one seeded generator (independent of HF's init).

    Matrices ~ N(0, 1/fan_in) so activations stay O(1) and the gradients are far above fp32 noise;
    norm weights 1 + N(0, 0.1^2) so a test that ignores them fails; embeddings N(0, 1).
    e_score_correction_bias ~ U[0, BIAS_MAX): non-negative, see docs/FIXTURES.md.
    """
    gen = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        if name.endswith("embed_tokens.weight"):
            val = torch.randn(p.shape, generator=gen)
        elif p.ndim >= 2:
            val = torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1])
        elif p.ndim == 1 and ("norm" in name):
            val = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            fail(f"init_weights: unexpected parameter {name} {tuple(p.shape)}")
        p.copy_(val.to(p.dtype))
    n_bias = 0
    for name, b in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            b.copy_((BIAS_MAX * torch.rand(b.shape, generator=gen)).to(b.dtype))
            n_bias += 1
    moe_layers = model.config.num_hidden_layers - model.config.first_k_dense_replace
    check(n_bias == moe_layers, f"found {n_bias} e_score_correction_bias buffers, want {moe_layers}")


def attach_lora(model, targets, seed, rank_pattern, alpha_pattern):
    cfg = LoraConfig(
        r=LORA_RANK,
        lora_alpha=LORA_ALPHA,
        lora_dropout=0.0,
        use_rslora=False,
        bias="none",
        init_lora_weights=True,
        target_modules=targets,
        target_parameters=EXPERT_PARAMS + MLP_PARAMS,
        rank_pattern=dict(rank_pattern),
        alpha_pattern=dict(alpha_pattern),
    )
    pm = get_peft_model(model, cfg)
    live = pm.peft_config["default"]
    check(set(live.target_modules) == set(targets) and set(live.target_parameters) == set(EXPERT_PARAMS + MLP_PARAMS)
          and dict(live.rank_pattern or {}) == rank_pattern and dict(live.alpha_pattern or {}) == alpha_pattern,
          f"PEFT rewrote the LoRA config: target_modules={live.target_modules} target_parameters="
          f"{live.target_parameters} rank_pattern={live.rank_pattern} alpha_pattern={live.alpha_pattern}")
    gen = torch.Generator().manual_seed(seed)
    trainable = sorted((n, p) for n, p in pm.named_parameters() if p.requires_grad)
    check(trainable, "no trainable parameters after get_peft_model")
    with torch.no_grad():
        for name, p in trainable:
            p.copy_(common.lora_value(name, p, gen, B_STD).to(p.dtype))
    return pm


# ----------------------------------------------------------------------------------------------
# data, forward, loss
# ----------------------------------------------------------------------------------------------


def make_batch(vocab, seed):
    return common.make_batch(vocab, seed, BATCH, SEQ, EXTRA_MASKED)


def masked_mean_ce(logits, labels):
    """Mean cross-entropy over positions whose label != -100; labels are already aligned with logits."""
    flat = logits.reshape(-1, logits.shape[-1]).double()
    return F.cross_entropy(flat, labels.reshape(-1), ignore_index=IGNORE, reduction="mean")


def inner_model(pm):
    return pm.get_base_model().model  # DeepseekV3Model


def register_hooks(pm, cfg, store):
    m = inner_model(pm)

    def router_hooks(i, layer):
        if i < cfg.first_k_dense_replace:
            return []

        def router_hook(_mod, inp, out, i=i):
            check(isinstance(out, tuple) and len(out) == 3,
                  "DeepseekV3TopkRouter.forward no longer returns (logits, weights, indices)")
            _, weights, idx = out
            check(not idx.dtype.is_floating_point, "router indices are not integer")
            store[f"router_in.layers.{i}"] = inp[0].detach().reshape(-1, cfg.hidden_size).clone()
            store[f"router.layers.{i}.raw_index"] = idx.detach().clone()
            store[f"router.layers.{i}.raw_weight"] = weights.detach().clone()
        return [layer.mlp.gate.register_forward_hook(router_hook)]
    return common.activation_hooks(m, enumerate(m.layers), store, router_hooks)


def forward(pm, cfg, ids, labels):
    store = {}
    out = common.run_hooked(register_hooks(pm, cfg, store), lambda: pm(input_ids=ids))
    logits = out.logits
    check(tuple(logits.shape) == (BATCH, SEQ, cfg.vocab_size), f"logits shape {tuple(logits.shape)}")
    check(logits.dtype == torch.float32, f"logits dtype {logits.dtype}")
    return logits, masked_mean_ce(logits, labels), store


# ----------------------------------------------------------------------------------------------
# saving the HF directory in the requested expert layout
# ----------------------------------------------------------------------------------------------


def expert_layout_of(path):
    with safe_open(path, "pt") as f:
        keys = list(f.keys())
    fused = any(k.endswith("mlp.experts.gate_up_proj") for k in keys)
    per = any(".mlp.experts.0.gate_proj.weight" in k for k in keys)
    check(fused != per, f"{path}: cannot tell the expert layout (fused={fused}, per_expert={per})")
    return ("fused" if fused else "per_expert"), keys


def convert_layout(sd, want, F_):
    """Converts a state dict between the fused and the per-expert expert layout (documented mapping)."""
    out = {}
    for k, v in sd.items():
        if want == "per_expert" and k.endswith("mlp.experts.gate_up_proj"):
            base = k[: -len("gate_up_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = v[e, :F_].contiguous()
                out[f"{base}{e}.up_proj.weight"] = v[e, F_:].contiguous()
        elif want == "per_expert" and k.endswith("mlp.experts.down_proj"):
            base = k[: -len("down_proj")]
            for e in range(v.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = v[e].contiguous()
        elif want == "fused" and ".mlp.experts." in k and k.endswith(".weight"):
            continue  # rebuilt below
        else:
            out[k] = v
    if want == "fused":
        prefixes = sorted({k.split(".mlp.experts.")[0] for k in sd if ".mlp.experts." in k})
        for pfx in prefixes:
            n = 1 + max(int(k.split(".mlp.experts.")[1].split(".")[0]) for k in sd if k.startswith(pfx + ".mlp.experts."))
            gate = [sd[f"{pfx}.mlp.experts.{e}.gate_proj.weight"] for e in range(n)]
            up = [sd[f"{pfx}.mlp.experts.{e}.up_proj.weight"] for e in range(n)]
            down = [sd[f"{pfx}.mlp.experts.{e}.down_proj.weight"] for e in range(n)]
            out[f"{pfx}.mlp.experts.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
            out[f"{pfx}.mlp.experts.down_proj"] = torch.stack(down)
    return out


def save_hf_dir(model, cfg, out_dir, layout):
    os.makedirs(out_dir, exist_ok=True)
    try:
        model.save_pretrained(out_dir, save_original_format=(layout == "per_expert"))
    except TypeError:  # no such keyword: save as it comes and convert below
        model.save_pretrained(out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    check(os.path.exists(path), f"save_pretrained did not write {path} (sharded?)")
    got, _ = expert_layout_of(path)
    note = f"save_pretrained(save_original_format={layout == 'per_expert'}) wrote the {got} layout"
    if got != layout:
        with safe_open(path, "pt") as f:
            sd = {k: f.get_tensor(k) for k in f.keys()}
        torch_save_file(convert_layout(sd, layout, cfg.moe_intermediate_size), path, metadata={"format": "pt"})
        note += f"; converted to {layout} by this script"
    got, keys = expert_layout_of(path)
    check(got == layout, f"{path}: expert layout {got}, want {layout}")
    with safe_open(path, "pt") as f:
        bad = [k for k in keys if f.get_slice(k).get_dtype() not in ("F32",)]
    check(not bad, f"{path}: non-fp32 tensors {bad}")
    return note




def find_expert_adapter_keys(pm, cfg):
    """Returns {'gate_up_proj': key template, 'down_proj': ...} for the ParamWrapper(s) on layer experts."""
    from peft.tuners.lora.layer import ParamWrapper

    L = cfg.first_k_dense_replace
    found = {}
    for name, mod in pm.named_modules():
        if isinstance(mod, ParamWrapper) and mod.num_experts > 1 and f".layers.{L}.mlp.experts" in name:
            short = name[len("base_model.model."):] if name.startswith("base_model.model.") else name
            found[mod.parameter_name] = short.replace(f".layers.{L}.", ".layers.{L}.")
            E = cfg.n_routed_experts
            check(mod.num_experts == E, f"ParamWrapper {name}: num_experts {mod.num_experts} != {E}")
            check(mod._did_swap_in_out_features, f"ParamWrapper {name}: in/out not swapped; layout differs from docs")
    check(set(found) == {"gate_up_proj", "down_proj"}, f"expert ParamWrappers found: {found}")
    return found


def check_delta_layout(pm, cfg, gate_up_rank=LORA_RANK):
    """Asserts PEFT's delta for every ParamWrapper equals scaling * B_e @ A_e with the documented indexing:
    A [E*r, in] has rows e*r + k, B [out, r*E] has columns k*E + e (E = 1 for 2-D weights). The routed
    experts' gate_up_proj adapter has rank gate_up_rank (2r in PEFT's fused form, with alpha 2 alpha:
    the scaling is alpha / r for every adapter either way)."""
    from peft.tuners.lora.layer import ParamWrapper

    n3, n2 = 0, 0
    for name, mod in pm.named_modules():
        if not isinstance(mod, ParamWrapper):
            continue
        E = mod.num_experts
        r = gate_up_rank if E > 1 and mod.parameter_name == "gate_up_proj" else LORA_RANK
        check(mod.r["default"] == r and abs(mod.scaling["default"] - LORA_ALPHA / LORA_RANK) < 1e-12,
              f"{name}: rank {mod.r['default']} scaling {mod.scaling['default']}, want {r} and {LORA_ALPHA / LORA_RANK}")
        with torch.no_grad():
            delta = mod.get_delta_weight("default").double()
            if E == 1:
                delta = delta.reshape(1, *delta.shape)
            A = mod.lora_A["default"].weight.double().reshape(E, r, -1)
            Bw = mod.lora_B["default"].weight.double()
            Bm = Bw.reshape(Bw.shape[0], r, E)
            for e in range(E):
                mine = mod.scaling["default"] * Bm[:, :, e] @ A[e]
                err = (mine - delta[e]).abs().max().item() / max(mine.abs().max().item(), 1e-30)
                check(err < 1e-5, f"{name}: PEFT delta[{e}] != scaling*B[:, k*E+e] @ A[e*r+k, :] "
                                  f"(relative error {err:.2e}; PEFT computes it in fp32)")
            want = tuple(mod.get_param().shape)
            check(tuple(delta.shape[-2:]) == want[-2:], f"{name}: delta shape {tuple(delta.shape)} vs {want}")
        n3 += E > 1
        n2 += E == 1
    moe = cfg.num_hidden_layers - cfg.first_k_dense_replace
    check(n3 == 2 * moe, f"found {n3} expert ParamWrappers, want {2 * moe}")
    check(n2 == 3 * cfg.num_hidden_layers, f"found {n2} 2-D ParamWrappers (dense + shared MLP), want {3 * cfg.num_hidden_layers}")


# ----------------------------------------------------------------------------------------------
# one config
# ----------------------------------------------------------------------------------------------


def make_one(name, out_root, device, seed):
    overrides, layout, targets = VARIANTS[name]
    cfg = make_config(overrides)
    out_dir, tmp_dir = common.fresh_tmp_dir(out_root, name)
    print(f"\n=== {name}: q_lora_rank={cfg.q_lora_rank} rope={cfg.rope_parameters} "
          f"routed_scaling_factor={cfg.routed_scaling_factor}, experts saved {layout}")

    torch.manual_seed(seed)
    model = build_model(cfg, device)
    init_weights(model, seed)
    model.train()
    note = save_hf_dir(model, cfg, tmp_dir, layout)
    print(f"  {note}")

    rank_pattern, alpha_pattern = lora_patterns(name)
    gate_up_rank = pattern_value(rank_pattern, "model.layers.1.mlp.experts.gate_up_proj", LORA_RANK)
    pm = attach_lora(model, targets, seed + 1, rank_pattern, alpha_pattern)
    pm.train()
    EXPERT_ADAPTER_KEYS.clear()
    EXPERT_ADAPTER_KEYS.update(find_expert_adapter_keys(pm, cfg))
    print(f"  expert adapter modules: {EXPERT_ADAPTER_KEYS}")
    check_delta_layout(pm, cfg, gate_up_rank)
    adapter_dir = os.path.join(tmp_dir, "adapter")
    # The target lists come back sorted; the content is unchanged and the reload check below uses this file.
    adapter, acfg = common.save_peft_adapter(pm, adapter_dir)
    check(acfg.get("r") == LORA_RANK and acfg.get("lora_alpha") == LORA_ALPHA and not acfg.get("use_rslora")
          and (acfg.get("rank_pattern") or {}) == rank_pattern and (acfg.get("alpha_pattern") or {}) == alpha_pattern,
          f"adapter_config.json: unexpected r/alpha/rslora/patterns: {acfg}")
    if gate_up_rank == 2 * LORA_RANK:
        # PEFT's fused form as after training: one B for gate and up, non-zero everywhere (not block diagonal).
        for L in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
            key = ADAPTER_PREFIX + EXPERT_ADAPTER_KEYS["gate_up_proj"].format(L=L) + ".lora_B.weight"
            b = adapter[key]
            check(tuple(b.shape) == (2 * cfg.moe_intermediate_size, gate_up_rank * cfg.n_routed_experts)
                  and bool((b != 0).all()), f"{key}: {tuple(b.shape)}, not a full rank-{gate_up_rank} B")
    print(f"  adapter_config: target_modules={acfg.get('target_modules')} "
          f"target_parameters={acfg.get('target_parameters')}")

    # Pick a batch whose routing has no near-ties anywhere (C++ float32 must pick the same experts).
    moe_layers = list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    for attempt in range(MAX_DATA_TRIES):
        ids, labels = make_batch(cfg.vocab_size, seed + 100 + attempt)
        with torch.no_grad():
            _, _, store = forward(pm, cfg, ids.to(device), labels.to(device))
        margin = common.smallest_routing_margin(store, moe_layers, lambda L: inner_model(pm).layers[L].mlp.gate, cfg)
        if margin >= MIN_ROUTING_MARGIN:
            break
        print(f"  batch seed {seed + 100 + attempt}: routing margin {margin:.2e} too small, next batch")
    else:
        fail(f"no batch with routing margin >= {MIN_ROUTING_MARGIN} in {MAX_DATA_TRIES} tries")
    print(f"  batch seed {seed + 100 + attempt}, smallest routing margin {margin:.3e}")

    ids_d, logits, loss, store = common.forward_backward(pm, lambda i, lab: forward(pm, cfg, i, lab), ids, labels,
                                                         device, cfg.vocab_size)

    # Training mode must equal eval mode: no dropout, no router noise in HF's DeepseekV3.
    common.check_eval_equals_train(pm, ids_d, logits)

    # Gradients, keyed like the saved adapter.
    grads = common.collect_grads(pm, adapter, strict=True)

    # Every expert's adapter must see tokens: per layer, count experts whose A rows got gradient.
    E = cfg.n_routed_experts
    hit_any = np.zeros(E, bool)
    for L in moe_layers:
        key = ADAPTER_PREFIX + EXPERT_ADAPTER_KEYS["gate_up_proj"].format(L=L) + ".lora_A.weight"
        g = grads[key].reshape(E, gate_up_rank, -1).abs().amax(dim=(1, 2)).numpy()
        hit = g > 0
        hit_any |= hit
        print(f"  layer {L}: experts with gradient {np.flatnonzero(hit).tolist()}")
        check(hit.sum() >= E // 2, f"layer {L}: only {hit.sum()} of {E} experts got gradient")
    if not hit_any.all():
        print(f"  WARNING: experts {np.flatnonzero(~hit_any).tolist()} got no gradient in any layer")

    # Reload check: the saved files alone reproduce the logits in transformers/PEFT.
    base2 = DeepseekV3ForCausalLM.from_pretrained(
        tmp_dir, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    ).to(device)
    sd1 = {k: v for k, v in pm.get_base_model().state_dict().items()}
    for k, v in base2.state_dict().items():
        ks = [k2 for k2 in sd1 if k2.replace(".base_layer", "") == k]
        if ks:
            check(torch.equal(sd1[ks[0]].cpu(), v.cpu()), f"reloaded {k} differs from the saved model")
    pm2 = PeftModel.from_pretrained(base2, adapter_dir)
    pm2.train()
    with torch.no_grad():
        logits2 = pm2(input_ids=ids_d).logits
    diff = (logits2 - logits.detach()).abs().max().item()
    check(diff <= 1e-5, f"reloaded HF+PEFT logits differ by {diff}")
    print(f"  reload through from_pretrained + PeftModel.from_pretrained: max |dlogits| = {diff:.2e}")

    # Independent float64 numpy forward from the saved files.
    ref = NumpyReference(tmp_dir, adapter_dir)
    ids_np, labels_np = ids.numpy(), labels.numpy()
    ref_logits = ref.logits(ids_np)
    check(ref.used == set(adapter), f"numpy reference did not use adapter keys {sorted(set(adapter) - ref.used)}")
    lg = logits.detach().cpu().double().numpy()
    err = np.abs(ref_logits - lg).max() / max(1.0, np.abs(ref_logits).max())
    ref_loss = NumpyReference.loss(ref_logits, labels_np)
    print(f"  numpy float64 reference: max |dlogits|/max|logits| = {err:.2e}, loss {ref_loss:.8f}")
    check(err < 1e-4, f"numpy reference logits differ from HF by {err} (relative to max |logit|)")
    check(abs(ref_loss - loss.item()) < 1e-5 * abs(ref_loss), f"numpy loss {ref_loss} vs HF {loss.item()}")

    # Central differences (float64 numpy) on a few gradient entries, routed experts included.
    probe_keys = sorted(k for k in adapter if "lora_A" in k)[:2] + sorted(k for k in adapter if "lora_B" in k)[-2:]
    probe_keys += [ADAPTER_PREFIX + EXPERT_ADAPTER_KEYS[w].format(L=moe_layers[-1]) + f".lora_{ab}.weight"
                   for w in ("gate_up_proj", "down_proj") for ab in ("A", "B")]
    worst = 0.0
    for key, idx, g, fd, rel in common.central_differences(ref, NumpyReference.loss, grads, probe_keys, ids_np,
                                                          labels_np, seed):
        worst = max(worst, rel)
        check(rel < 2e-2, f"{key}{list(idx)}: autograd {g:.6e} vs central difference {fd:.6e}")
    print(f"  central differences on {len(probe_keys)} entries: worst relative error {worst:.2e}")

    # golden.safetensors
    golden = common.golden_tensors(ids, labels, logits, loss, grads, store, ("hidden.", "attn_out.", "mlp_out."),
                                   moe_layers)
    meta = {
        "generator": "scripts/make_fixtures.py",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "device": str(device),
        "seed": str(seed),
        "batch_seed": str(seed + 100 + attempt),
        "min_routing_margin": f"{margin:.6e}",
        "expert_layout": layout,
        "expert_adapter_keys": json.dumps(EXPERT_ADAPTER_KEYS),
        "loss": f"{loss.item():.9e}",
    }
    if rank_pattern:  # only the fused-form configs: the others' files stay byte-identical
        meta.update(rank_pattern=json.dumps(rank_pattern), alpha_pattern=json.dumps(alpha_pattern))
    common.save_golden(golden, meta, tmp_dir)
    common.publish(tmp_dir, adapter_dir, out_dir, adapter)
    return loss.item()


def main():
    args = common.parse_args(__doc__, VARIANTS)
    device, names, _ = common.start(args, VARIANTS, "needs transformers 5.x (fused experts)")
    losses = {n: make_one(n, args.out, device, args.seed) for n in names}

    total = common.summary(args.out, names, across_names=True)  # of the configs written now
    for n, l in losses.items():
        print(f"  loss[{n}] = {l:.8f}")
    check(total < 3 << 20, f"fixtures are {human(total)}, budget is 3 MiB")


if __name__ == "__main__":
    main()
