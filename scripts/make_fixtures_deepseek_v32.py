#!/usr/bin/env python3
"""Golden fixtures for DSA: transformers' DeepseekV32ForCausalLM + PEFT.

Builds tiny random DeepSeek-V3.2 models (MLA with q LoRA and a lightning indexer in every layer, a
dense first layer, routed + shared experts), attaches a PEFT LoRA adapter with non-zero B to every
MLA projection, the dense MLP, the shared and the routed experts, runs one training-mode
forward/backward on two sequences of 16 tokens whose queries keep only the indexer's top-k keys
(k < 16, so the selection matters), and writes, per config, <out>/<name>/ as
scripts/make_fixtures.py does for DeepSeek-V3:

    config.json, model.safetensors   the HF model (save_pretrained, fp32; indexer weights included)
    adapter/                         the PEFT adapter
    golden.safetensors               batch, labels, logits, loss, one gradient per adapter tensor,
                                     per-layer activations, routing and the indexer's selection

Module names are read off the live model, never assumed. Checks (fatal ones stop before anything is
written): the model has the requested structure (an indexer with wq_b, wk, a LayerNorm k_norm and
weights_proj in every layer, no module this script does not know); train and eval logits are
identical; every adapter tensor gets a non-zero gradient; routing has no near-ties (2e-4) and
matches the documented algorithm; the indexer's selection equals the documented algorithm
recomputed in float64 from its inputs (moetrain's kernels/ops.h DsaIndexerArgs: half-split rope on
the first qk_rope_head_dim columns, LayerNorm'd shared key, relu, head weights) and has no near-ties
at any top-k boundary (2e-4), otherwise the next batch seed is tried. Reported (WARN, not fatal):
the saved files reload to the same logits; an independent float64 numpy forward that reads only the
saved files (indexer and top-k mask included) reproduces logits and loss; central differences of
that forward match a few gradient entries.

Needs torch, transformers 5.x (deepseek_v32), peft, safetensors, numpy; CPU is enough (seconds).

    python3 scripts/make_fixtures_deepseek_v32.py --out tests/fixtures/golden
    python3 scripts/make_fixtures_deepseek_v32.py --out $OUT/golden_v32   # elsewhere, then copy

See docs/FIXTURES.md for the contents and docs/HF_SEMANTICS.md (section 9) for the semantics.
"""

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

try:
    from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: E402
except ImportError as exc:  # pragma: no cover
    sys.exit(f"make_fixtures_deepseek_v32.py: this transformers ({transformers.__version__}) has no deepseek_v32: {exc}")

fail, check = mf.fail, mf.check
BATCH, SEQ = mf.BATCH, mf.SEQ  # 2 x 16; mf.forward checks the logits against these
IGNORE = mf.IGNORE
ADAPTER_PREFIX = mf.ADAPTER_PREFIX
MIN_INDEX_MARGIN = 2e-4  # smallest allowed gap between the k-th and (k+1)-th index score of a query
MLA_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
INDEXER_CHILDREN = {"wq_b": torch.nn.Linear, "wk": torch.nn.Linear, "k_norm": torch.nn.LayerNorm,
                    "weights_proj": torch.nn.Linear}

# Shared by both configs. 8 indexer heads: with 4, a query whose 4 head weights are all negative
# (1 in 16) scores every key <= 0 and many exactly 0 (all relus cut), a tie torch.topk breaks its
# own way; with 8 that is rare enough for the batch search below.
COMMON = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8,
    qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
    topk_group=1, first_k_dense_replace=1, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=32,
    rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, attention_dropout=0.0, use_cache=False,
    index_n_heads=8, index_head_dim=8, pad_token_id=None, bos_token_id=0, eos_token_id=1,
)
# name -> (config overrides, expert layout of model.safetensors). YaRN with mscale_all_dim 0.8 as in
# make_fixtures.py's qlora config: the indexer rotates with the same (scaled) cos/sin as MLA.
VARIANTS = {
    "deepseek_v32": (
        dict(index_topk=5, routed_scaling_factor=2.5,
             rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=8,
                                  beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)),
        "fused",
    ),
    "deepseek_v32_plain": (
        dict(index_topk=3, routed_scaling_factor=1.0, rope_parameters=dict(rope_type="default", rope_theta=10000.0)),
        "per_expert",
    ),
}


# ----------------------------------------------------------------------------------------------
# config and model
# ----------------------------------------------------------------------------------------------


def make_config(overrides):
    kwargs = dict(COMMON)
    kwargs.update(overrides)
    kwargs["mlp_layer_types"] = ["dense"] + ["sparse"] * (kwargs["num_hidden_layers"] - 1)
    try:
        cfg = DeepseekV32Config(**kwargs)
    except (TypeError, ValueError) as exc:
        fail(f"DeepseekV32Config rejected {sorted(kwargs)}: {exc}")
    rp = getattr(cfg, "rope_parameters", None)
    check(isinstance(rp, dict) and rp.get("rope_type") == overrides["rope_parameters"]["rope_type"],
          f"config.rope_parameters not taken as given: {rp!r}")
    for key in ("index_topk", "index_n_heads", "index_head_dim", "q_lora_rank"):
        check(getattr(cfg, key, None) == kwargs[key], f"config.{key} = {getattr(cfg, key, None)!r}, want {kwargs[key]}")
    check(cfg.qk_head_dim == cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, "qk_head_dim")
    return cfg


def check_structure(model, cfg):
    """Fails unless every layer is MLA with q LoRA plus an indexer of the shape this script documents."""
    c = COMMON
    Hi, di, D = cfg.index_n_heads, cfg.index_head_dim, cfg.hidden_size
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        linears = sorted(n for n, m in attn.named_children() if isinstance(m, torch.nn.Linear))
        check(linears == sorted(MLA_TARGETS), f"layer {i}: {type(attn).__name__} has linear layers {linears}, want "
                                              f"{sorted(MLA_TARGETS)} (a gate or a q_proj is not what moetrain reads)")
        ix = getattr(attn, "indexer", None)
        check(ix is not None, f"layer {i}: {type(attn).__name__} has no `indexer`; children {sorted(dict(attn.named_children()))}")
        children = dict(ix.named_children())
        check(sorted(children) == sorted(INDEXER_CHILDREN),
              f"layer {i}: indexer children {sorted(children)}, want {sorted(INDEXER_CHILDREN)}")
        for n, kind in INDEXER_CHILDREN.items():
            check(isinstance(children[n], kind), f"layer {i}: indexer.{n} is {type(children[n]).__name__}, want {kind.__name__}")
        check(tuple(ix.wq_b.weight.shape) == (Hi * di, c["q_lora_rank"]), f"layer {i}: wq_b {tuple(ix.wq_b.weight.shape)}")
        check(tuple(ix.wk.weight.shape) == (di, D), f"layer {i}: wk {tuple(ix.wk.weight.shape)}")
        check(tuple(ix.weights_proj.weight.shape) == (Hi, D), f"layer {i}: weights_proj {tuple(ix.weights_proj.weight.shape)}")
        check(ix.k_norm.bias is not None and tuple(ix.k_norm.normalized_shape) == (di,) and ix.k_norm.eps == 1e-6,
              f"layer {i}: k_norm is not LayerNorm({di}, eps=1e-6) with a bias")
        check(all(m.bias is None for m in (ix.wq_b, ix.wk, ix.weights_proj)), f"layer {i}: an indexer projection has a bias")
        mlp = layer.mlp
        check(hasattr(mlp, "experts") == (i >= cfg.first_k_dense_replace), f"layer {i}: dense/MoE layout")


def build_model(cfg, device):
    model = DeepseekV32ForCausalLM._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32)
    check(model.config._attn_implementation == "eager",
          f"attention implementation is {model.config._attn_implementation!r}, want 'eager' (the top-k mask path)")
    check_structure(model, cfg)
    experts = model.model.layers[cfg.first_k_dense_replace].mlp.experts
    E, F_, D = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    check(hasattr(experts, "gate_up_proj") and tuple(experts.gate_up_proj.shape) == (E, 2 * F_, D),
          f"routed experts are not a fused gate_up_proj [E, 2F, D] ({type(experts).__name__})")
    return model.to(device)


# ----------------------------------------------------------------------------------------------
# the indexer, recomputed in float64 (kernels/ops.h DsaIndexerArgs, core/model/dsa_indexer.h)
# ----------------------------------------------------------------------------------------------


def rope64(x, cos, sin, layout):
    """Rotates the last dim of x by per-pair angles; cos/sin [..., d/2] broadcastable to x[..., :d/2]."""
    h = x.shape[-1] // 2
    if layout == "half":
        x1, x2 = x[..., :h], x[..., h:]
    else:  # interleaved pairs (x0, x1), (x2, x3), ...
        x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def index_scores(w, hidden, q_resid, cos, sin, Hi, di, dr, layout="half", rope_first=True):
    """I[b, s, t] for every pair (no mask) in float64; w: the indexer's weights by child name (numpy),
    hidden [B, S, D], q_resid [B, S, q_lora], cos/sin [B or 1, S, dr / 2]."""
    B, S, _ = hidden.shape
    q = (q_resid @ w["wq_b"].T).reshape(B, S, Hi, di)
    k = hidden @ w["wk"].T
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6) * w["k_norm.weight"] + w["k_norm.bias"]
    rot = slice(0, dr) if rope_first else slice(di - dr, di)
    q = q.copy()
    k = k.copy()
    q[..., rot] = rope64(q[..., rot], cos[:, :, None, :], sin[:, :, None, :], layout)
    k[..., rot] = rope64(k[..., rot], cos, sin, layout)
    heads = np.maximum(np.einsum("bshd,btd->bsht", q, k), 0.0)  # relu(q_j . k_t)
    weights = hidden @ w["weights_proj"].T  # [B, S, Hi]
    return np.einsum("bsh,bsht->bst", weights, heads) * (di ** -0.5) * (Hi ** -0.5)


def select(scores, k):
    """Per query s, keys t <= s ranked by (score desc, t asc): the first min(k, s + 1) as a sorted list,
    and each query's gap at its top-k boundary (inf when it has at most k keys)."""
    B, S, _ = scores.shape
    chosen, margins = [], []
    for b in range(B):
        for s in range(S):
            row = scores[b, s, : s + 1]
            order = np.lexsort((np.arange(s + 1), -row))
            margins.append(row[order[k - 1]] - row[order[k]] if s + 1 > k else math.inf)
            chosen.append(sorted(order[: min(k, s + 1)].tolist()))
    return chosen, margins


def hf_selection(raw, S):
    """HF's top-k rows [B, S, k'] as sorted lists of the keys <= s (the rest are masked positions)."""
    rows = []
    for b in range(raw.shape[0]):
        for s in range(S):
            rows.append(sorted(t for t in raw[b, s].tolist() if t <= s))
    return rows


def indexer_weights(ix):
    return {"wq_b": ix.wq_b.weight, "wk": ix.wk.weight, "k_norm.weight": ix.k_norm.weight,
            "k_norm.bias": ix.k_norm.bias, "weights_proj": ix.weights_proj.weight}


def check_indexer(store, layers, cfg):
    """Compares HF's selection with the documented algorithm in float64; returns the smallest margin.
    A query whose k-th and (k+1)-th scores are closer than MIN_INDEX_MARGIN may differ (HF ranks in
    float32 and breaks exact ties, such as keys whose every head's relu is 0, its own way): the small
    margin sends the caller to the next batch. A difference at a query with a clear margin is a real
    defect: fail, naming the variant (rope layout / column order) that would have matched."""
    Hi, di, dr, k = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.index_topk
    margin = math.inf
    for L, layer in enumerate(layers):
        w = {n: t.detach().double().cpu().numpy() for n, t in indexer_weights(layer.self_attn.indexer).items()}
        hidden = store[f"indexer_in.layers.{L}"].double().cpu().numpy()
        q_resid = store[f"indexer_q.layers.{L}"].double().cpu().numpy()
        cos = store[f"indexer_cos.layers.{L}"].double().cpu().numpy()[..., : dr // 2]
        sin = store[f"indexer_sin.layers.{L}"].double().cpu().numpy()[..., : dr // 2]
        raw = store[f"indexer.layers.{L}.raw_index"].cpu()
        check(raw.shape[-1] == min(k, SEQ), f"layer {L}: indexer returned {raw.shape[-1]} keys per query, want {min(k, SEQ)}")
        hf = hf_selection(raw, SEQ)
        scores = index_scores(w, hidden, q_resid, cos, sin, Hi, di, dr)
        chosen, margins = select(scores, k)
        differing = [i for i in range(len(hf)) if chosen[i] != hf[i]]
        for i in differing:
            print(f"  layer {L} query {i}: HF {hf[i]}, documented {chosen[i]}, boundary margin {margins[i]:.3e}, "
                  f"scores {np.round(scores[i // SEQ, i % SEQ, : i % SEQ + 1], 6).tolist()}")
        if any(margins[i] >= MIN_INDEX_MARGIN for i in differing):
            tried = []
            for layout, rope_first in (("interleaved", True), ("half", False), ("interleaved", False)):
                alt, _ = select(index_scores(w, hidden, q_resid, cos, sin, Hi, di, dr, layout, rope_first), k)
                if alt == hf:
                    tried.append(f"{layout} rope on the {'first' if rope_first else 'last'} {dr} columns")
            fail(f"layer {L}: HF's indexer selection differs from the documented algorithm (half-split rope on the "
                 f"first {dr} columns) at a query with a clear top-k margin"
                 f"{'; it matches ' + tried[0] if tried else ''}: update moetrain "
                 "(model.dsa.indexer_rope_interleave, core/model/dsa_indexer.cpp) and docs/HF_SEMANTICS.md first")
        margin = min([margin] + margins)
    return margin


# ----------------------------------------------------------------------------------------------
# forward with the indexer's inputs and outputs captured
# ----------------------------------------------------------------------------------------------


def forward(pm, cfg, ids, labels):
    """mf.forward (logits, loss, activations, routing) plus each indexer's inputs and selection."""
    layers = mf.inner_model(pm).layers
    extra = {}
    handles = []
    for L, layer in enumerate(layers):
        def hook(_mod, args, kwargs, out, L=L):
            def arg(i, name):
                return args[i] if len(args) > i else kwargs[name]
            cos, sin = arg(2, "position_embeddings")
            extra[f"indexer_in.layers.{L}"] = arg(0, "hidden_states").detach().clone()
            extra[f"indexer_q.layers.{L}"] = arg(1, "q_resid").detach().clone()
            extra[f"indexer_cos.layers.{L}"] = cos.detach().clone()
            extra[f"indexer_sin.layers.{L}"] = sin.detach().clone()
            # The top-k indices: the output itself, or (in versions that also return the scores, for
            # the indexer's KL loss) the integer tensor of the returned tuple.
            outs = out if isinstance(out, (tuple, list)) else (out,)
            found = [o for o in outs if torch.is_tensor(o) and not o.dtype.is_floating_point]
            check(len(found) == 1, f"the indexer returned {[type(o).__name__ for o in outs]}, not one integer "
                                   "tensor of top-k indices (a mask? update this script)")
            extra[f"indexer.layers.{L}.raw_index"] = found[0].detach().clone()
        handles.append(layer.self_attn.indexer.register_forward_hook(hook, with_kwargs=True))
    try:
        logits, loss, store = mf.forward(pm, cfg, ids, labels)
    finally:
        for h in handles:
            h.remove()
    store.update(extra)
    return logits, loss, store


# ----------------------------------------------------------------------------------------------
# independent float64 numpy forward from the saved files
# ----------------------------------------------------------------------------------------------


class V32NumpyReference(mf.NumpyReference):
    """DeepSeek-V3.2 in float64 from the saved files: make_fixtures.py's DeepSeek-V3 reference with the
    indexer's causal top-k (half-split rope) masking each query's keys."""

    def __init__(self, hf_dir, adapter_dir):
        super().__init__(hf_dir, adapter_dir)
        self.selected = {}

    def attention(self, h, L):
        c = self.c
        B, T, _ = h.shape
        H, dn, dr, dv, kvr = (c["num_attention_heads"], c["qk_nope_head_dim"], c["qk_rope_head_dim"],
                              c["v_head_dim"], c["kv_lora_rank"])
        p = f"model.layers.{L}.self_attn"
        q_resid = self.rms(self.linear(h, f"{p}.q_a_proj"), f"{p}.q_a_layernorm.weight")
        q = self.linear(q_resid, f"{p}.q_b_proj").reshape(B, T, H, dn + dr).transpose(0, 2, 1, 3)
        ckv = self.linear(h, f"{p}.kv_a_proj_with_mqa")
        latent = self.rms(ckv[..., :kvr], f"{p}.kv_a_layernorm.weight")
        kv = self.linear(latent, f"{p}.kv_b_proj").reshape(B, T, H, dn + dv).transpose(0, 2, 1, 3)
        k_nope, v = kv[..., :dn], kv[..., dn:]
        cos, sin = self.rope_tables(T)
        q_rot = rope64(q[..., dn:], cos, sin, "interleaved")
        k_rot = rope64(ckv[:, None, :, kvr:], cos, sin, "interleaved")
        qf = np.concatenate([q[..., :dn], q_rot], -1)
        kf = np.concatenate([k_nope, np.broadcast_to(k_rot, (B, H, T, dr))], -1)
        scale = self.softmax_scale(dn, dr)
        # The indexer (frozen, no adapter): each query keeps its top index_topk keys <= itself.
        w = {n: self.w[f"{p}.indexer.{n}" + ("" if "." in n else ".weight")]
             for n in ("wq_b", "wk", "k_norm.weight", "k_norm.bias", "weights_proj")}
        scores = index_scores(w, h, q_resid, cos[None], sin[None], c["index_n_heads"], c["index_head_dim"], dr)
        chosen, _ = select(scores, c["index_topk"])
        self.selected[L] = chosen
        keep = np.zeros((B, T, T), bool)
        for n, keys in enumerate(chosen):
            keep[n // T, n % T, keys] = True
        s = qf @ kf.transpose(0, 1, 3, 2) * scale
        s = np.where(keep[:, None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        pr = s / s.sum(-1, keepdims=True)
        o = (pr @ v).transpose(0, 2, 1, 3).reshape(B, T, H * dv)
        return self.linear(o, f"{p}.o_proj")


# ----------------------------------------------------------------------------------------------
# one config
# ----------------------------------------------------------------------------------------------


def make_one(name, out_root, device, seed, results):
    overrides, layout = VARIANTS[name]
    cfg = make_config(overrides)
    out_dir, tmp_dir = common.fresh_tmp_dir(out_root, name)
    print(f"\n=== {name}: index_topk {cfg.index_topk} of {SEQ}, indexer {cfg.index_n_heads} x {cfg.index_head_dim}, "
          f"rope {cfg.rope_parameters}, routed_scaling_factor {cfg.routed_scaling_factor}, experts saved {layout}")
    warn = []

    torch.manual_seed(seed)
    model = build_model(cfg, device)
    mf.init_weights(model, seed)  # k_norm's weight and bias both ~ 1 + 0.1 N(0, 1), as every 1-D norm tensor
    model.train()
    note = mf.save_hf_dir(model, cfg, tmp_dir, layout)
    print(f"  {note}")
    with open(os.path.join(tmp_dir, "config.json")) as f:
        saved_config = json.load(f)
    for key in ("model_type", "index_topk", "index_n_heads", "index_head_dim", "q_lora_rank"):
        check(key in saved_config, f"config.json has no {key!r} (moetrain's importer needs it); keys {sorted(saved_config)}")
    check(saved_config["model_type"] == "deepseek_v32", f"config.json model_type {saved_config['model_type']!r}")
    with safe_open(os.path.join(tmp_dir, "model.safetensors"), "pt") as f:
        indexer_keys = sorted(k.split(".self_attn.")[1] for k in f.keys() if ".layers.0.self_attn.indexer." in k)
    print(f"  indexer tensors of layer 0: {indexer_keys}")
    check(indexer_keys == ["indexer.k_norm.bias", "indexer.k_norm.weight", "indexer.weights_proj.weight",
                           "indexer.wk.weight", "indexer.wq_b.weight"],
          f"saved indexer tensors {indexer_keys} are not the names moetrain reads (core/model/dsa_indexer.h)")

    pm = mf.attach_lora(model, MLA_TARGETS, seed + 1, {}, {})  # no rank or alpha patterns
    pm.train()
    mf.EXPERT_ADAPTER_KEYS.clear()
    mf.EXPERT_ADAPTER_KEYS.update(mf.find_expert_adapter_keys(pm, cfg))
    mf.check_delta_layout(pm, cfg)
    adapter_dir = os.path.join(tmp_dir, "adapter")
    adapter, acfg = common.save_peft_adapter(pm, adapter_dir)
    check(not any(".indexer." in k for k in adapter), "PEFT put an adapter on the indexer (it must stay frozen)")
    print(f"  adapter: target_modules={acfg.get('target_modules')} target_parameters={acfg.get('target_parameters')}")

    # A batch whose routing and key selection have no near-ties (float32 C++ must pick the same).
    layers = mf.inner_model(pm).layers
    moe_layers = list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    for attempt in range(mf.MAX_DATA_TRIES):
        ids, labels = mf.make_batch(cfg.vocab_size, seed + 100 + attempt)
        with torch.no_grad():
            _, _, store = forward(pm, cfg, ids.to(device), labels.to(device))
        route_margin = common.smallest_routing_margin(store, moe_layers, lambda L: layers[L].mlp.gate, cfg)
        index_margin = check_indexer(store, layers, cfg)
        if route_margin >= mf.MIN_ROUTING_MARGIN and index_margin >= MIN_INDEX_MARGIN:
            break
        print(f"  batch seed {seed + 100 + attempt}: margins routing {route_margin:.2e} index {index_margin:.2e}, next")
    else:
        fail(f"no batch with routing margin >= {mf.MIN_ROUTING_MARGIN} and index margin >= {MIN_INDEX_MARGIN} in "
             f"{mf.MAX_DATA_TRIES} tries")
    print(f"  batch seed {seed + 100 + attempt}: smallest margins routing {route_margin:.3e}, index {index_margin:.3e}")

    ids_d, logits, loss, store = common.forward_backward(pm, lambda i, lab: forward(pm, cfg, i, lab), ids, labels,
                                                         device, cfg.vocab_size)
    check(cfg.index_topk < SEQ, f"index_topk {cfg.index_topk} >= {SEQ} tokens: the selection would not matter")
    common.check_eval_equals_train(pm, ids_d, logits)

    grads = common.collect_grads(pm, adapter)

    # Reported checks: reload, numpy reference, central differences.
    common.reload_check(DeepseekV32ForCausalLM, tmp_dir, adapter_dir, device, ids_d, logits, warn)

    ids_np, labels_np = ids.numpy(), labels.numpy()
    try:
        ref = V32NumpyReference(tmp_dir, adapter_dir)
        ref_logits = ref.logits(ids_np)
        for L in range(cfg.num_hidden_layers):
            if ref.selected[L] != hf_selection(store[f"indexer.layers.{L}.raw_index"].cpu(), SEQ):
                warn.append(f"numpy reference selects other keys than HF in layer {L}")

        def probes():
            return [k for k in sorted(adapter) if ".kv_b_proj." in k][:2] + [
                k for k in sorted(adapter) if ".q_a_proj.lora_A" in k][:1] + [
                ADAPTER_PREFIX + mf.EXPERT_ADAPTER_KEYS["gate_up_proj"].format(L=moe_layers[-1]) + ".lora_B.weight"]
        common.reference_checks(ref, ref_logits, mf.NumpyReference.loss, adapter, logits, loss, ids_np, labels_np,
                                grads, probes, seed, warn)
    except Exception as exc:  # noqa: BLE001
        warn.append(f"numpy reference failed: {type(exc).__name__}: {exc}")

    golden = common.golden_tensors(ids, labels, logits, loss, grads, store, ("hidden.", "attn_out.", "mlp_out."),
                                   moe_layers)
    k = min(cfg.index_topk, SEQ)
    for L in range(cfg.num_hidden_layers):
        rows = hf_selection(store[f"indexer.layers.{L}.raw_index"].cpu(), SEQ)
        # moetrain's layout (DsaIndexerArgs): [tokens, k], keys ascending, -1 padded; tokens b * SEQ + s,
        # but keys numbered within their window (moetrain's indexer writes b * SEQ + key).
        golden[f"indexer.layers.{L}.topk_index"] = torch.tensor([r + [-1] * (k - len(r)) for r in rows],
                                                                dtype=torch.int32)
    meta = {
        "generator": "scripts/make_fixtures_deepseek_v32.py", "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__, "device": str(device),
        "seed": str(seed), "batch_seed": str(seed + 100 + attempt), "min_routing_margin": f"{route_margin:.6e}",
        "min_index_margin": f"{index_margin:.6e}", "expert_layout": layout, "save_note": note,
        "expert_adapter_keys": json.dumps(mf.EXPERT_ADAPTER_KEYS, sort_keys=True), "warnings": json.dumps(warn),
        "loss": f"{loss.item():.9e}",
    }
    common.save_golden(golden, meta, tmp_dir)
    common.publish(tmp_dir, adapter_dir, out_dir, adapter)
    results[name] = (loss.item(), warn)


def main():
    args = common.parse_args(__doc__, VARIANTS)
    device, names, _ = common.start(args, VARIANTS)
    results = {}
    for n in names:
        make_one(n, args.out, device, args.seed, results)

    total = common.summary(args.out, names)
    common.report(results, "reload, numpy reference, central differences", total, 2)


if __name__ == "__main__":
    main()
