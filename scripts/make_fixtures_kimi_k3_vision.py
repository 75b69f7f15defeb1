#!/usr/bin/env python3
"""Golden fixtures for Kimi K3's vision side: NVIDIA NeMo AutoModel's KimiK3ForConditionalGeneration.

The reference is NeMo AutoModel's own multimodal model (nemo_automodel/components/models/kimi_k3/
multimodal.py and vision.py: the MoonViT3d tower, the temporal-pool patch merger, the patchmergerv2
projector and the placeholder merge) on the all-MLA text model of scripts/make_fixtures_kimi_k3.py's
`kimi_k3` config (whose helpers this script reuses for the config, the weights, the checkpoint names
and the PEFT adapter). The vision tower is tiny (2 blocks, hidden 32, 2 heads of 16, 14 x 14 patches,
a 5 x 7 position table so that no image has the table's size, 4 frames at most). One batch of two
samples of SEQ tokens each (after expansion):

    sample 0: text, image A (grid 1 x 4 x 6: 6 tokens), text, image B (2 frames of 6 x 8: 12 tokens), text
    sample 1: text only

NeMo runs each sample on its own (its merge expands one placeholder per image; both samples have
SEQ tokens after it); the loss is the mean cross-entropy over both samples' targets. Training as
NeMo's VLM recipes do: the tower frozen, the projector trained in full (its three weights), PEFT LoRA
on the language model (the kimi_k3 fixture's targets).

It writes <out>/kimi_k3_vision/:

    config.json, model.safetensors   a released-style kimi_k3 directory: text under language_model.,
                                     vision_tower.* and mm_projector.* as NeMo's to_hf gives them
    adapter/                         the language model's PEFT adapter (checkpoint names)
    golden.safetensors               input_ids [2, SEQ] in the pre-expanded form (one placeholder per
                                     image token), labels (next-token targets, -100 where none: before
                                     every image token and at the end), logits, loss, grad.<adapter key>,
                                     projector_grad.<mm_projector weight>, pixel_values [patches, 3, 14,
                                     14], grid_thws [images, 3], vision.tower_output (merged, [image
                                     tokens, 4 x 32]), vision.projector_output [image tokens, 48],
                                     vision.merged_embeddings [2, SEQ, 48]

Checks. Fatal (nothing is written): the model has the requested tower; the checkpoint holds the
vision and projector tensors under their released names and loads back through NeMo to the same
values; NeMo's merge gives the labels and placeholder layout this script expects; every adapter and
projector tensor gets a non-zero gradient; routing has no near-ties. Reported (WARN, still written):
NeMo's own shifted loss of sample 0 equals this script's; the RMSNorm default epsilon torch uses in
float32 and bfloat16 (docs/HF_SEMANTICS.md section 11), recorded in the metadata.

The model computes in float32 (build_model moves it there after NeMo's constructor), but that
constructor first casts the tower to the model's dtype (bf16) and the position embedding's fixed
sin-cos time table is a non-persistent buffer no checkpoint restores: the reference adds the
bf16-rounded table, as every bf16 run of NeMo does (docs/HF_SEMANTICS.md section 11).

torch.compile is turned off (TORCHDYNAMO_DISABLE): NeMo compiles its position-table interpolation,
which then runs as the plain F.interpolate call it wraps, with no compiler needed.

Needs what scripts/make_fixtures_kimi_k3.py needs (torch, transformers 5.x, peft, safetensors, numpy,
NeMo AutoModel's source in .nemo_ref/ or --nemo); CPU is enough.

    python3 scripts/make_fixtures_kimi_k3_vision.py --out tests/fixtures/golden [--nemo PATH]
"""

import json
import math
import os
import sys
import types

os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures_kimi_k3 as k3  # noqa: E402  (the text model's config, weights, checkpoint and adapter)
from fixtures import common  # noqa: E402
from fixtures.kimi_k3_nemo import import_nemo  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import transformers  # noqa: E402
import peft  # noqa: E402
from safetensors.torch import save_file as torch_save_file  # noqa: E402

fail, check = common.fail, common.check
NAME = "kimi_k3_vision"
IGNORE = k3.IGNORE
SEQ = 40
VOCAB = k3.COMMON["vocab_size"]
PLACEHOLDER = VOCAB - 1  # k3_config_json's media_placeholder_token_id
PAD = 0                  # NeMo's merge zeroes the embedding of pad tokens: text ids avoid it
PATCH = 14
VISION = dict(model_type="kimi_k3_vision", patch_size=PATCH, init_pos_emb_height=5, init_pos_emb_width=7,
              init_pos_emb_time=4, vt_num_attention_heads=2, vt_num_hidden_layers=2, vt_hidden_size=32,
              vt_intermediate_size=64, qkv_hidden_size=32, merge_kernel_size=[2, 2], mm_hidden_size=32,
              mm_projector_type="patchmergerv2", projector_ln_eps=1e-5, norm_type="rmsnorm", attn_bias=False,
              linear_bias=False, patch_embed_proj_bias=False, pos_emb_interpolation_mode="bilinear",
              merge_type="sd2_tpool", pos_emb_type="divided_fixed", mlp_type="mlp2", attn_implementation="eager",
              text_hidden_size=k3.COMMON["hidden_size"], media_placeholder_token_id=PLACEHOLDER)
GRIDS = [(1, 4, 6), (2, 6, 8)]  # sample 0's images, in order
# Sample 0 before expansion: the text positions at which its two placeholders stand.
PLACEHOLDER_AT = (3, 12)
MASKED = [(0, 1), (0, 20), (1, 0), (1, 7)]  # more positions without a target (prompt masking), ours


def tokens_of(grid):
    t, h, w = grid
    return (h // 2) * (w // 2)


def config_json():
    top = k3.k3_config_json(k3.VARIANTS["kimi_k3"], k3.layer_plan("kimi_k3"))
    check(top["media_placeholder_token_id"] == PLACEHOLDER, "the kimi_k3 fixture's placeholder id moved")
    top["vision_config"] = dict(VISION)
    return top


def build_model(nemo, config, device):
    """NeMo's KimiK3ForConditionalGeneration in fp32, the text model's backend as the kimi_k3 fixture's."""
    mm = sys.modules.get("nemo_automodel.components.models.kimi_k3.multimodal")
    if mm is None:
        from nemo_automodel.components.models.kimi_k3 import multimodal as mm  # noqa: PLC0415
    backend = nemo.BackendConfig(attn="eager", linear="torch", rms_norm="torch", experts="torch",
                                 dispatcher="torch", enable_hf_state_dict_adapter=True, gate_precision=torch.float32)
    model = mm.KimiK3ForConditionalGeneration(config, backend=backend).to(device=device, dtype=torch.float32)
    model.state_dict_adapter.dtype = torch.float32
    vt = model.vision_tower
    check(len(vt.encoder.blocks) == VISION["vt_num_hidden_layers"] and vt.merge_type == "sd2_tpool"
          and type(model.mm_projector).__name__ == "PatchMergerMLPV2"
          and tuple(vt.patch_embed.pos_emb.weight.shape) == (5, 7, 32)
          and vt.patch_embed.pos_emb.interpolation_mode == "bilinear" and vt.patch_embed.proj.bias is None
          and isinstance(vt.encoder.blocks[0].norm0, torch.nn.RMSNorm) and vt.encoder.blocks[0].norm0.eps is None,
          f"NeMo did not build the requested tower: {vt}")
    return model


@torch.no_grad()
def init_vision(model, seed):
    """The tower's and projector's weights from their own generator: matrices N(0, 1/fan_in) (the
    patch embedding's fan-in 3 x 14 x 14), the position table N(0, 0.25), norms 1 + 0.1 N(0, 1)."""
    gen = torch.Generator().manual_seed(seed + 11)
    for name, p in sorted(list(model.vision_tower.named_parameters(prefix="vision_tower"))
                          + list(model.mm_projector.named_parameters(prefix="mm_projector"))):
        if name.endswith("pos_emb.weight"):
            val = 0.5 * torch.randn(p.shape, generator=gen)
        elif p.ndim >= 2:
            val = torch.randn(p.shape, generator=gen) / math.sqrt(p[0].numel())
        elif "norm" in name:
            val = 1.0 + 0.1 * torch.randn(p.shape, generator=gen)
        else:
            fail(f"init_vision: unexpected parameter {name} {tuple(p.shape)}")
        p.copy_(val)


def make_sample_ids(gen):
    """Sample 0 before expansion (placeholders at PLACEHOLDER_AT), sample 1 (text): ids in [1, V - 1)."""
    short = SEQ - sum(tokens_of(g) for g in GRIDS) + len(GRIDS)
    ids0 = torch.randint(1, PLACEHOLDER, (short,), generator=gen)
    for t in PLACEHOLDER_AT:
        ids0[t] = PLACEHOLDER
    ids1 = torch.randint(1, PLACEHOLDER, (SEQ,), generator=gen)
    return ids0, ids1


def expand(ids0):
    """The pre-expanded form of sample 0 (one placeholder per image token) and each position's
    unshifted label: the token itself for text, IGNORE for image tokens."""
    out, label = [], []
    image = 0
    for tok in ids0.tolist():
        if tok == PLACEHOLDER:
            n = tokens_of(GRIDS[image])
            out += [PLACEHOLDER] * n
            label += [IGNORE] * n
            image += 1
        else:
            out.append(tok)
            label.append(tok)
    check(len(out) == SEQ and image == len(GRIDS), f"expansion gave {len(out)} tokens, {image} images")
    return torch.tensor(out), torch.tensor(label)


def targets_of(unshifted, masked_row):
    """Our labels: label[t] = unshifted[t + 1], IGNORE at the end and at the masked positions."""
    labels = torch.full_like(unshifted, IGNORE)
    labels[:-1] = unshifted[1:]
    for t in masked_row:
        labels[t] = IGNORE
    return labels


def make_pixels(gen):
    """Patches [sum t h w, 3, 14, 14] in U(-1, 1), each image in raster order (frame, row, column)."""
    patches = sum(t * h * w for t, h, w in GRIDS)
    return 2.0 * torch.rand((patches, 3, PATCH, PATCH), generator=gen) - 1.0


def router_hooks(model, store, sample):
    """Forward hooks that append each MoE layer's router input and choices of `sample` to store."""
    handles = []
    for i, layer in model.model.layers.items():
        if not hasattr(layer.mlp, "gate"):
            continue

        def hook(_mod, inp, out, i=i):
            check(isinstance(out, tuple) and len(out) == 3, "KimiK3Gate no longer returns (weights, indices, aux)")
            store.setdefault(f"router_in.layers.{i}", []).append(inp[0].detach().reshape(-1, inp[0].shape[-1]))
            store.setdefault(f"router.layers.{i}.raw_index", []).append(out[1].detach().reshape(-1, out[1].shape[-1]))
        handles.append(layer.mlp.gate.register_forward_hook(hook))
    return handles


def run_reference(model, ids0, ids1, pixels, grids, store):
    """NeMo's logits of both samples ([2, SEQ, V]), each sample on its own; the tower's and the
    projector's outputs land in store."""
    vt_out, proj_out = [], []
    handles = [model.vision_tower.register_forward_hook(lambda _m, _i, out: vt_out.append(out)),
               model.mm_projector.register_forward_hook(lambda _m, _i, out: proj_out.append(out))]
    handles += router_hooks(model, store, 0)
    try:
        ids0_b = ids0[None].to(pixels.device)
        logits0 = model(input_ids=ids0_b, pixel_values=pixels, grid_thws=grids,
                        attention_mask=torch.ones_like(ids0_b)).logits
        logits1 = model(input_ids=ids1[None].to(pixels.device)).logits
    finally:
        for h in handles:
            h.remove()
    check(len(vt_out) == 1 and len(proj_out) == 1, f"tower ran {len(vt_out)} times, projector {len(proj_out)}")
    check(tuple(logits0.shape) == (1, SEQ, VOCAB) and tuple(logits1.shape) == (1, SEQ, VOCAB),
          f"logits {tuple(logits0.shape)} / {tuple(logits1.shape)}: NeMo's merge did not give {SEQ} tokens")
    store["vision.tower_output"] = torch.cat([x.reshape(x.shape[0], -1) for x in vt_out[0]]).detach()
    store["vision.projector_output"] = torch.cat(list(proj_out[0])).detach()
    return torch.cat([logits0, logits1])


@torch.no_grad()
def merged_embeddings(model, ids0, ids1, pixels, grids, labels0, warn):
    """NeMo's merge of sample 0 (embeddings, labels), sample 1's embeddings, and NeMo's placement
    checked against the pre-expanded form."""
    features = model._extract_image_features(pixels, grids)
    ids0_b = ids0[None].to(pixels.device)
    embeds = model.get_input_embeddings()(ids0_b)
    merged, mask, labels, _positions = model._merge_input_ids_with_image_features(
        features, embeds, ids0_b, torch.ones_like(ids0_b), labels0[None].to(pixels.device))
    check(bool(mask.all()), "NeMo's merge masked positions of a full-length sample")
    expanded, want_labels = expand(ids0)
    check(torch.equal(labels[0].cpu(), want_labels), f"NeMo's merged labels {labels[0].tolist()} differ from "
          f"the pre-expanded form's {want_labels.tolist()}")
    rows = (expanded == PLACEHOLDER).nonzero().reshape(-1)
    check(torch.equal(merged[0, rows.to(merged.device)], torch.cat(list(features))),
          "NeMo's merge did not put the image tokens at the expanded placeholders, in order")
    other = model.get_input_embeddings()(ids1[None].to(pixels.device))
    return torch.cat([merged, other]).detach()


def rmsnorm_default_eps():
    """The epsilon nn.RMSNorm() (eps None) adds, measured per dtype: x of mean square 1e-8."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.full((1, 8), 1e-4, dtype=dtype)
        y = torch.nn.RMSNorm(8, dtype=dtype)(x).double()
        ms = float(x.double().pow(2).mean())
        out[str(dtype).replace("torch.", "")] = float((x.double() / y).pow(2).mean()) - ms
    return out


def main():
    args = common.parse_args(__doc__, {NAME: None}, nemo_default=os.path.join(k3.REPO, ".nemo_ref"))
    device, names, nemo = common.start(args, {NAME: None}, cudnn_tf32=False, prepare=lambda: import_nemo(args.nemo))
    check(names == [NAME], f"--configs: only {NAME}")
    seed = args.seed
    out_dir, tmp_dir = common.fresh_tmp_dir(args.out, NAME)
    warn = []
    print(f"\n=== {NAME}: the kimi_k3 text model + a tower of {VISION['vt_num_hidden_layers']} blocks, grids {GRIDS}")

    with open(os.path.join(tmp_dir, "config.json"), "w") as f:
        json.dump(config_json(), f, indent=2, sort_keys=True)
        f.write("\n")
    config = k3.load_nemo_config(nemo, tmp_dir, warn)
    torch.manual_seed(seed)
    model = build_model(nemo, config, device)
    k3.init_weights(model, seed)
    init_vision(model, seed)
    written = k3.checkpoint_tensors(model, "bf16", seed)
    for key in ("vision_tower.patch_embed.proj.weight", "vision_tower.patch_embed.pos_emb.weight",
                "vision_tower.encoder.blocks.1.wqkv.weight", "vision_tower.encoder.final_layernorm.weight",
                "mm_projector.proj.0.weight", "mm_projector.proj.2.weight", "mm_projector.post_norm.weight"):
        check(key in written, f"model.safetensors lacks {key} (NeMo's to_hf renamed the vision side?): "
              f"{sorted(k for k in written if 'language_model.' not in k)}")
    torch_save_file(written, os.path.join(tmp_dir, "model.safetensors"))
    k3.load_checkpoint(model, tmp_dir)
    k3.check_loaded(model, written)
    model.eval()
    eps = rmsnorm_default_eps()
    print(f"  nn.RMSNorm's default eps: {eps}")

    plan = k3.layer_plan("kimi_k3")
    pm = k3.attach_lora(model, seed + 1, plan)
    for p in model.mm_projector.parameters():
        p.requires_grad_(True)
    for p in model.vision_tower.parameters():
        check(not p.requires_grad, "a tower weight is trainable")
    adapter_dir = os.path.join(tmp_dir, "adapter")
    adapter, _ = k3.save_adapter(pm, model, adapter_dir)

    grids = torch.tensor(GRIDS, dtype=torch.int64, device=device)
    moe_layers = [int(i) for i, layer in model.model.layers.items() if hasattr(layer.mlp, "gate")]
    ns = types.SimpleNamespace(n_routed_experts=k3.COMMON["num_experts"], n_group=1, topk_group=1,
                               num_experts_per_tok=k3.COMMON["num_experts_per_token"])
    for attempt in range(k3.mf.MAX_DATA_TRIES):
        gen = torch.Generator().manual_seed(seed + 200 + attempt)
        ids0, ids1 = make_sample_ids(gen)
        pixels = make_pixels(gen).to(device)
        store = {}
        with torch.no_grad():
            run_reference(model, ids0, ids1, pixels, grids, store)
        routed = {k: torch.cat(v) for k, v in store.items() if k.startswith("router")}
        margin = common.smallest_routing_margin(routed, moe_layers, lambda L: model.model.layers[str(L)].mlp.gate, ns,
                                                "NeMo's")
        if margin >= k3.mf.MIN_ROUTING_MARGIN:
            break
    else:
        fail(f"no batch with routing margin >= {k3.mf.MIN_ROUTING_MARGIN} in {k3.mf.MAX_DATA_TRIES} tries")
    print(f"  batch seed {seed + 200 + attempt}, smallest routing margin {margin:.3e}")

    expanded0, unshifted0 = expand(ids0)
    ids = torch.stack([expanded0, ids1])
    labels = torch.stack([targets_of(unshifted0, [t for b, t in MASKED if b == 0]),
                          targets_of(ids1.clone(), [t for b, t in MASKED if b == 1])])
    pm.zero_grad(set_to_none=True)
    store = {}
    logits = run_reference(model, ids0, ids1, pixels, grids, store)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), labels.to(device).reshape(-1), ignore_index=IGNORE)
    loss.backward()
    print(f"  loss {loss.item():.6f} over {int((labels != IGNORE).sum())} targets (ln V = {math.log(VOCAB):.4f})")

    projector_grads = {}
    for name, p in model.mm_projector.named_parameters(prefix="mm_projector"):
        check(p.grad is not None and bool(p.grad.abs().max() > 0), f"{name}: no or all-zero gradient")
        projector_grads[f"projector_grad.{name}"] = p.grad.detach().cpu().float().clone()
        p.requires_grad_(False)  # collect_grads takes the adapter's tensors only
    grads = common.collect_grads(pm, adapter, key_of=lambda key: k3.hf_adapter_key(model, key))

    # NeMo's own loss of sample 0 (its shift over the merged labels) against ours on that sample.
    try:
        with torch.no_grad():
            labels0 = ids0.clone()
            ids0_b = ids0[None].to(device)
            nemo_loss = model(input_ids=ids0_b, pixel_values=pixels, grid_thws=grids,
                              attention_mask=torch.ones_like(ids0_b), labels=labels0[None].to(device)).loss
            ours0 = F.cross_entropy(logits[0].detach(), targets_of(unshifted0, []).to(device), ignore_index=IGNORE)
        diff = abs(nemo_loss.item() - ours0.item())
        print(f"  NeMo's shifted loss of sample 0 {nemo_loss.item():.6f} vs the pre-expanded targets' {ours0.item():.6f}")
        if diff > 1e-5 * max(1.0, abs(ours0.item())):
            warn.append(f"NeMo's loss of sample 0 differs from the pre-expanded targets' by {diff:.2e}")
    except Exception as exc:  # noqa: BLE001 - reported, the C++ test is the judge
        warn.append(f"NeMo's own loss failed: {type(exc).__name__}: {exc}")

    golden = {
        "input_ids": ids.to(torch.int32).contiguous(),
        "labels": labels.to(torch.int32).contiguous(),
        "logits": logits.detach().cpu().float().contiguous(),
        "loss": torch.tensor([loss.item()], dtype=torch.float32),
        "pixel_values": pixels.detach().cpu().float().contiguous(),
        "grid_thws": torch.tensor(GRIDS, dtype=torch.int32),
        "vision.tower_output": store["vision.tower_output"].cpu().float().contiguous(),
        "vision.projector_output": store["vision.projector_output"].cpu().float().contiguous(),
        "vision.merged_embeddings": merged_embeddings(model, ids0, ids1, pixels, grids, ids0.clone(),
                                                      warn).cpu().float().contiguous(),
    }
    golden.update({f"grad.{k}": g.contiguous() for k, g in grads.items()})
    golden.update({k: g.contiguous() for k, g in projector_grads.items()})
    meta = {
        "generator": "scripts/make_fixtures_kimi_k3_vision.py",
        "reference": "NeMo AutoModel KimiK3ForConditionalGeneration (eval mode, eager attention)",
        "nemo_automodel_commit": nemo.commit, "nemo_kimi_k3_sha256_16": json.dumps(nemo.hashes, sort_keys=True),
        "stubbed_modules": json.dumps(nemo.stubbed), "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__, "numpy": np.__version__,
        "device": str(device), "seed": str(seed), "batch_seed": str(seed + 200 + attempt),
        "min_routing_margin": f"{margin:.6e}", "grids": json.dumps(GRIDS), "warnings": json.dumps(warn),
        "loss": f"{loss.item():.9e}", "rmsnorm_default_eps": json.dumps(eps), "projector_train": "full",
    }
    common.save_golden(golden, meta, tmp_dir)
    common.publish(tmp_dir, adapter_dir, out_dir, adapter, prune_top=False)
    total = common.summary(args.out, [NAME])
    common.report({NAME: (loss.item(), warn)}, "NeMo's own loss, RMSNorm epsilon", total, 3)


if __name__ == "__main__":
    main()
