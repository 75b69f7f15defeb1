#!/usr/bin/env python3
"""Golden fixtures for FP8 block-scaled checkpoints: DeepSeek-V3 and Kimi K2 as they ship.

Builds a tiny random DeepSeek-V3 (fp32, make_fixtures.py's weights and LoRA), quantizes its linears
to the released layout (per 128 x 128 block: scale = amax / 448, codes float8_e4m3fn, F32
`<name>.weight_scale_inv`; config.json gets quantization_config {quant_method fp8, fmt e4m3,
activation_scheme dynamic, weight_block_size [128, 128], modules_to_not_convert}) and writes,
per config, <out>/<name>/ as scripts/make_fixtures.py does:

    config.json, model.safetensors   the FP8 checkpoint (embeddings, norms, router, lm_head and the
                                     modules_to_not_convert stay fp32)
    adapter/                         the PEFT adapter
    golden.safetensors               batch, labels, logits, loss, one gradient per adapter tensor,
                                     per-layer activations and routing

The base weights of the reference run are transformers' own FP8 loading, dequantized
(FineGrainedFP8Config(dequantize=True)): the script checks (fatal) that they equal, bit for bit,
this script's float64 block dequantization rounded to fp32, and runs PEFT on a plain fp32 model
loaded from those dequantized values (the same tensors; a quantized model is not trainable in
transformers). transformers' Fp8Dequantize derives the block size from the scale grid
(rows // scale_rows), so a partial edge block (a dimension not a multiple of 128) is refused or
misread there: every quantized matrix here has dimensions that are multiples of 128, and the two
that cannot (kv_b_proj [128, 112], o_proj [128, 32]) are in modules_to_not_convert. Partial blocks
are covered by tests/unit/test_model_import_fp8.cpp against its own dequantization.

Configs: `deepseek_v3_fp8` (model_type deepseek_v3) and `kimi_k2_fp8` (model_type kimi_k2, as
moonshotai/Kimi-K2-* ship it: DeepseekV3ForCausalLM's keys with one expert group and Kimi's
routed_scaling_factor 2.827).

Needs torch (float8_e4m3fn), transformers 5.x (FineGrainedFP8Config), peft, safetensors, numpy.
transformers' FP8 loading wants a GPU of compute capability >= 8.9 unless it dequantizes; run on
the GPU machine:

    python3 scripts/make_fixtures_fp8.py --out tests/fixtures/golden --device cuda
    python3 scripts/make_fixtures_fp8.py --out $OUT/golden_fp8 --device cpu   # CPU also works when dequantizing

See docs/FIXTURES.md for the contents and docs/HF_SEMANTICS.md for the semantics.
"""

import copy
import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures as mf  # noqa: E402  (shared helpers; it checks the imports and sets CUBLAS_WORKSPACE_CONFIG)
from fixtures import common  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
import peft  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import DeepseekV3ForCausalLM  # noqa: E402

try:
    from transformers import FineGrainedFP8Config  # noqa: E402
except ImportError as exc:  # pragma: no cover
    sys.exit(f"make_fixtures_fp8.py: this transformers ({transformers.__version__}) has no FineGrainedFP8Config: {exc}")

fail, check = mf.fail, mf.check
ADAPTER_PREFIX = mf.ADAPTER_PREFIX
BLOCK = 128
FP8_MAX = 448.0
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
# Every linear weight the releases quantize ends so; the router (mlp.gate), embeddings, norms and
# lm_head do not.
QUANTIZED_SUFFIXES = ("_proj.weight", "_proj_with_mqa.weight")
NOT_CONVERT = ["lm_head", "self_attn.kv_b_proj", "self_attn.o_proj"]

# Multiples of 128 for every quantized matrix: hidden 128, q latent 128, q_b 2 x (48 + 16) = 128,
# kv_a 112 + 16 = 128, dense MLP 256, experts 128.
SIZES = dict(
    hidden_size=128, intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2, q_lora_rank=128,
    kv_lora_rank=112, qk_nope_head_dim=48, qk_rope_head_dim=16, v_head_dim=16,
    rope_parameters=dict(rope_type="default", rope_theta=10000.0),
)
VARIANTS = {
    "deepseek_v3_fp8": (dict(SIZES, routed_scaling_factor=2.5), "deepseek_v3"),
    "kimi_k2_fp8": (dict(SIZES, n_group=1, topk_group=1, routed_scaling_factor=2.827), "kimi_k2"),
}


def module_converted(key):
    module = key[: -len(".weight")]
    return key.endswith(QUANTIZED_SUFFIXES) and not any(
        module == p or module.startswith(p + ".") or module.endswith("." + p) for p in NOT_CONVERT)


def quantize(w):
    """w [out, in] fp32 -> (float8_e4m3fn codes, F32 scale_inv [ceil(out/128), ceil(in/128)])."""
    rows, cols = w.shape
    br, bc = -(-rows // BLOCK), -(-cols // BLOCK)
    w64 = w.double()
    scales = torch.ones(br, bc, dtype=torch.float32)
    codes = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(br):
        for j in range(bc):
            blk = w64[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            amax = blk.abs().max().item()
            s = torch.tensor(amax / FP8_MAX if amax > 0 else 1.0, dtype=torch.float32)
            scales[i, j] = s
            codes[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (
                (blk / s.double()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn))
    return codes, scales


def dequantize(codes, scales):
    """float64 codes * scale of each element's block (partial edge blocks included), rounded once to fp32."""
    rows, cols = codes.shape
    s = scales.double().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (codes.double() * s).float()


def write_fp8_dir(plain_dir, fp8_dir, deq_dir, model_type):
    """The released layout in fp8_dir, and this script's dequantization of it (fp32) in deq_dir."""
    with safe_open(os.path.join(plain_dir, "model.safetensors"), "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    fp8, deq, quantized = {}, {}, []
    for k, v in sorted(sd.items()):
        if v.ndim == 2 and module_converted(k):
            codes, scales = quantize(v)
            fp8[k], fp8[k + "_scale_inv"] = codes, scales
            deq[k] = dequantize(codes, scales)
            quantized.append(k)
        else:
            fp8[k] = deq[k] = v
    check(any(".experts.0." in k for k in quantized) and any(".mlp.gate_proj." in k for k in quantized),
          f"quantized {quantized}: no routed expert or dense MLP among them")
    for d in (fp8_dir, deq_dir):
        os.makedirs(d, exist_ok=True)
    save_file(fp8, os.path.join(fp8_dir, "model.safetensors"), metadata={"format": "pt"})
    save_file(deq, os.path.join(deq_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(plain_dir, "config.json")) as f:
        config = json.load(f)
    shutil.copy(os.path.join(plain_dir, "config.json"), os.path.join(deq_dir, "config.json"))
    config["model_type"] = model_type
    config["quantization_config"] = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                         weight_block_size=[BLOCK, BLOCK], modules_to_not_convert=NOT_CONVERT)
    with open(os.path.join(fp8_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    return quantized


def check_transformers_dequantization(fp8_dir, deq_dir, cfg, device):
    """transformers' FP8 loading (dequantized) must give exactly this script's fp32 values."""
    qcfg = FineGrainedFP8Config(dequantize=True, weight_block_size=(BLOCK, BLOCK), modules_to_not_convert=NOT_CONVERT)
    # The config must carry the checkpoint's quantization_config: without it transformers takes the
    # weights for unquantized ones and quantizes them itself, ignoring the shipped scales.
    quantized_cfg = copy.deepcopy(cfg)
    with open(os.path.join(fp8_dir, "config.json")) as f:
        quantized_cfg.quantization_config = json.load(f)["quantization_config"]
    loaded = DeepseekV3ForCausalLM.from_pretrained(fp8_dir, config=quantized_cfg, quantization_config=qcfg,
                                                   attn_implementation="eager", experts_implementation="eager",
                                                   dtype=torch.float32)
    plain = DeepseekV3ForCausalLM.from_pretrained(deq_dir, attn_implementation="eager",
                                                  experts_implementation="eager", dtype=torch.float32)
    got, want = loaded.state_dict(), plain.state_dict()
    check(sorted(got) == sorted(want), f"FP8-loaded parameters {sorted(set(got) ^ set(want))} differ in name")
    for k in sorted(want):
        a, b = got[k].detach().cpu(), want[k].detach().cpu()
        check(a.dtype == torch.float32 and a.shape == b.shape,
              f"{k}: transformers' FP8 loading gave {a.dtype} {tuple(a.shape)}, want float32 {tuple(b.shape)}")
        diff = (a.double() - b.double()).abs().max().item()
        check(diff == 0.0, f"{k}: transformers' dequantized weight differs from the block dequantization by {diff:.3e}")
    return plain.to(device)


def make_one(name, out_root, device, seed, results):
    overrides, model_type = VARIANTS[name]
    cfg = mf.make_config(overrides)
    out_dir, tmp_dir = common.fresh_tmp_dir(out_root, name)
    work = tempfile.mkdtemp(prefix=f"moetrain_{name}_")
    plain_dir, deq_dir = os.path.join(work, "plain"), os.path.join(work, "dequantized")
    print(f"\n=== {name}: model_type {model_type}, FP8 e4m3 in 128 x 128 blocks, not converted {NOT_CONVERT}")
    warn = []

    torch.manual_seed(seed)
    model = mf.build_model(cfg, torch.device("cpu"))
    mf.init_weights(model, seed)
    print(f"  {mf.save_hf_dir(model, cfg, plain_dir, 'per_expert')}")
    quantized = write_fp8_dir(plain_dir, tmp_dir, deq_dir, model_type)
    print(f"  quantized {len(quantized)} weights, e.g. {quantized[:3]}")
    base = check_transformers_dequantization(tmp_dir, deq_dir, cfg, device)
    print("  transformers' FP8 loading (dequantize=True) equals the block dequantization exactly")

    pm = mf.attach_lora(base, TARGETS, seed + 1, {}, {})
    pm.train()
    mf.EXPERT_ADAPTER_KEYS.clear()
    mf.EXPERT_ADAPTER_KEYS.update(mf.find_expert_adapter_keys(pm, cfg))
    mf.check_delta_layout(pm, cfg)
    adapter_dir = os.path.join(tmp_dir, "adapter")
    adapter, acfg = common.save_peft_adapter(pm, adapter_dir)
    print(f"  adapter: target_modules={acfg.get('target_modules')} target_parameters={acfg.get('target_parameters')}")

    layers = mf.inner_model(pm).layers
    moe_layers = list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    for attempt in range(mf.MAX_DATA_TRIES):
        ids, labels = mf.make_batch(cfg.vocab_size, seed + 100 + attempt)
        with torch.no_grad():
            _, _, store = mf.forward(pm, cfg, ids.to(device), labels.to(device))
        margin = common.smallest_routing_margin(store, moe_layers, lambda L: layers[L].mlp.gate, cfg)
        if margin >= mf.MIN_ROUTING_MARGIN:
            break
        print(f"  batch seed {seed + 100 + attempt}: routing margin {margin:.2e} too small, next batch")
    else:
        fail(f"no batch with routing margin >= {mf.MIN_ROUTING_MARGIN} in {mf.MAX_DATA_TRIES} tries")

    ids_d, logits, loss, store = common.forward_backward(pm, lambda i, lab: mf.forward(pm, cfg, i, lab), ids, labels,
                                                         device, cfg.vocab_size)
    common.check_eval_equals_train(pm, ids_d, logits)
    grads = common.collect_grads(pm, adapter, strict=True)
    common.reload_check(DeepseekV3ForCausalLM, deq_dir, adapter_dir, device, ids_d, logits, warn)

    ids_np, labels_np = ids.numpy(), labels.numpy()
    try:
        ref = mf.NumpyReference(deq_dir, adapter_dir)  # numpy has no FP8: the dequantized copy
        ref_logits = ref.logits(ids_np)

        def probes():
            return sorted(k for k in adapter if "lora_A" in k)[:2] + [
                ADAPTER_PREFIX + mf.EXPERT_ADAPTER_KEYS["gate_up_proj"].format(L=moe_layers[-1]) + ".lora_B.weight"]
        common.reference_checks(ref, ref_logits, mf.NumpyReference.loss, adapter, logits, loss, ids_np, labels_np,
                                grads, probes, seed, warn)
    except Exception as exc:  # noqa: BLE001 - reported, the C++ test is the judge
        warn.append(f"numpy reference failed: {type(exc).__name__}: {exc}")

    golden = common.golden_tensors(ids, labels, logits, loss, grads, store, ("hidden.", "attn_out.", "mlp_out."),
                                   moe_layers)
    meta = {
        "generator": "scripts/make_fixtures_fp8.py", "torch": torch.__version__,
        "transformers": transformers.__version__, "peft": peft.__version__, "device": str(device),
        "seed": str(seed), "batch_seed": str(seed + 100 + attempt), "min_routing_margin": f"{margin:.6e}",
        "model_type": model_type, "quantized": json.dumps(quantized), "not_converted": json.dumps(NOT_CONVERT),
        "expert_adapter_keys": json.dumps(mf.EXPERT_ADAPTER_KEYS, sort_keys=True), "warnings": json.dumps(warn),
        "loss": f"{loss.item():.9e}",
    }
    common.save_golden(golden, meta, tmp_dir)
    common.publish(tmp_dir, adapter_dir, out_dir, adapter)
    shutil.rmtree(work, ignore_errors=True)
    results[name] = (loss.item(), warn)


def main():
    args = common.parse_args(__doc__, VARIANTS)
    device, names, _ = common.start(args, VARIANTS, "needs transformers 5.x (FineGrainedFP8Config, fused experts)")
    check(hasattr(torch, "float8_e4m3fn"), f"torch {torch.__version__} has no float8_e4m3fn")
    results = {}
    for n in names:
        make_one(n, args.out, device, args.seed, results)
    total = common.summary(args.out, names)
    common.report(results, "reload, numpy reference, central differences", total, 3)


if __name__ == "__main__":
    main()
