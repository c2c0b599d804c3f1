"""One LoRA training step, ours against the trainers people use: sd-scripts (FLUX.1) and musubi-tuner
(Qwen-Image), on the same weights, plus the step's FLOPs as a fraction of this machine's matmul peak.

Their code is imported at run time from checkouts given on the command line (`--sd_scripts DIR`,
`--musubi DIR`: clones of kohya-ss/sd-scripts and kohya-ss/musubi-tuner); nothing of theirs is
copied here. sd-scripts' top-level packages are called `library` and `networks`, like ours, so they
are imported with ours moved out of sys.modules and put back afterwards (their modules keep
references to each other). Stubbed imports (only when not installed, reported at start):
torchvision and cv2, imported by sd-scripts' library/utils.py for image helpers that the model and
LoRA code never call.

Per family, size and precision, in one process:
  ours     library.models.flux1.model.Flux / library.models.qwen_image.model.QwenImage + networks.lora.LoRANetwork
           (default targets), through the family's `predict` as train_lora.py calls it;
  theirs   sd-scripts library/flux_models.Flux + networks/lora_flux.create_network (its default
           targets: every Linear of the double/single blocks, modulation included), or musubi-tuner
           qwen_image/qwen_image_model.QwenImageTransformer2DModel + networks/lora_qwen_image
           (attention + MLP Linears of the blocks, `_mod_` excluded); rank r, alpha r, float32 LoRA.
Both models hold the very tensors of one random base (BFL names for FLUX, diffusers names for
Qwen-Image; loaded with assign=True, no copy), the same inputs (fixed x_t, text, pooled vector,
sigma 0.5: exact in bf16, where sd-scripts rounds the timestep), MSE against a fixed target in
float32, AdamW lr 1e-4, gradient checkpointing on both (or off on both: --no-checkpointing).
Precision as each trainer runs it:
  fp32        no autocast (mixed_precision no); musubi's trainer forces a bf16 DiT, so its fp32 row
              is its model code only;
  bf16        bf16 base, the forward under autocast(bf16) as accelerate's mixed_precision=bf16 does
              for all three trainers; inputs as each trainer passes them (sd-scripts casts latents,
              text and timesteps to bf16, musubi passes float32, ours casts at model entry);
  fp8         sd-scripts/musubi `fp8_base`: the whole model cast to float8_e4m3fn (embedders and norms
              included), upcast by autocast; ours: the blocks' Linears plain-cast (library.precision.fp8);
  fp8_scaled  musubi `fp8_scaled` (block-64 absmax scales, the blocks' Linears, its monkey-patched
              forward); ours fp8_scaled. sd-scripts has no scaled fp8 for FLUX.1: no row.
Step-0 check: both LoRAs start with up = 0, so before any update the two predictions must agree up to
rounding; the max |ours - theirs| and the relative step-0 loss difference are printed.
--compile: then (after the eager step-0 check) both sides torch.compile'd as their trainers do it
(compile_both); the warm-up steps compile. Every non-tiny comparison ends the run with a line
`headline: <family> <precision> <eager|compiled>: ours/<peer> <ratio>, MFU <percent>%`.

MFU: the step's matmul FLOPs counted from shapes (bench/step_flops.py) over the fastest step time,
divided by this CPU's best large-GEMM FLOP/s in the compute dtype (bf16 for bf16/fp8 steps): the best
of the probes at start and just before and after each comparison (a shared machine's load moves it).

    python bench/bench_peers.py --sd_scripts /tmp/sd-scripts --musubi /tmp/musubi-tuner
    python bench/bench_peers.py ... --families flux --sizes mid --precisions bf16 --reps 3
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
import time
import types

import torch
import torch.nn.functional as F

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.dirname(BENCH))

from bench_train_step import (  # noqa: E402
    MiB, PeakMemory, add_our_lora, alternate, build_ours, flux_config, fp8_twin, machine_summary, median,
    memory_method, our_forward, pin_malloc_threshold, qwen_config,
)
from library.models.core import checkpointing  # noqa: E402
from library.models.flux1.model import make_img_ids  # noqa: E402
from library.precision.fp8_compute import enable_fp8_compute, fp8_gemm_available  # noqa: E402
from step_flops import count_step, matmul_peak  # noqa: E402
import op_counts  # noqa: E402
from tools.devices import device_or_exit  # noqa: E402

PRECISIONS = ("fp32", "bf16", "fp8", "fp8_scaled")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SIGMA = 0.5  # 500 and 0.5 are exact in bf16: sd-scripts' bf16 timestep round trip loses nothing
PEER = {"flux": "sd-scripts", "qwen_image": "musubi-tuner"}
FAMILY_NAME = {"flux": "flux1", "qwen_image": "qwen_image"}  # the headline lines' family names (issue 29)

# ----------------------------------------------------------------------------------------------
# Importing their code


def _stub(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    sys.modules[name] = module
    return module


def import_sd_scripts(root: str):
    """(flux_models, lora_flux) from an sd-scripts checkout, our `library`/`networks` kept intact."""
    import diffusers  # noqa: F401  (probes torchvision at import: must not see the stub)
    import transformers  # noqa: F401
    # diffusers loads its models lazily; the first AutoencoderKL import pulls in bitsandbytes, whose op
    # registration inspects the calling modules and fails on their namespace `networks`: load it first.
    from diffusers import AutoencoderKL  # noqa: F401

    stubs = [n for n in ("torchvision", "cv2") if importlib.util.find_spec(n) is None]
    for name in stubs:
        _stub(name)
    if "torchvision" in stubs:
        sys.modules["torchvision"].transforms = _stub("torchvision.transforms")
    ours = {k: sys.modules.pop(k) for k in list(sys.modules) if k.split(".")[0] in ("library", "networks")}
    # Their `networks` has no __init__.py (a namespace package): a regular package of that name anywhere
    # on the path (ours) would win, so our root and the working directory leave the path meanwhile.
    saved_path, project = list(sys.path), os.path.dirname(BENCH)
    sys.path[:] = [root] + [p for p in sys.path if os.path.abspath(p or ".") not in (project, os.getcwd())]
    try:
        flux_models = importlib.import_module("library.flux_models")
        lora_flux = importlib.import_module("networks.lora_flux")
    finally:
        sys.path[:] = saved_path
        for k in [k for k in sys.modules if k.split(".")[0] in ("library", "networks")]:
            sys.modules["sd_scripts." + k] = sys.modules.pop(k)  # theirs, under another name
        sys.modules.update(ours)
    if stubs:
        print(f"sd-scripts: stubbed imports {stubs} (used by library/utils.py image helpers only)")
    return flux_models, lora_flux


def checkout_or_exit(root: str, flag: str, marker: str, repo: str) -> str:
    """`root` made absolute, or one line naming the flag and the file a `repo` checkout has (a wrong
    folder gave an import traceback from deep inside the importer)."""
    root = os.path.abspath(root)
    if not os.path.isfile(os.path.join(root, marker)):
        raise SystemExit(f"{flag} {root}: no {marker} there; expected a {repo} checkout (git clone https://github.com/{repo})")
    return root


def import_musubi(root: str):
    sys.path.insert(0, os.path.join(root, "src"))
    model = importlib.import_module("musubi_tuner.qwen_image.qwen_image_model")
    lora = importlib.import_module("musubi_tuner.networks.lora_qwen_image")
    fp8 = importlib.import_module("musubi_tuner.modules.fp8_optimization_utils")
    utils = importlib.import_module("musubi_tuner.utils.model_utils")
    return model, lora, fp8, utils


# ----------------------------------------------------------------------------------------------
# Their models on our weights


def _assign(model, state: dict):
    model.load_state_dict(state, strict=True, assign=True)
    return model


def sd_scripts_flux(flux_models, ours, precision: str):
    """sd-scripts' Flux holding our tensors; `fp8`: then cast whole to float8_e4m3fn as its fp8_base does."""
    from accelerate import init_empty_weights

    c = ours.config
    params = flux_models.FluxParams(
        in_channels=c.in_channels, vec_in_dim=c.vec_in_dim, context_in_dim=c.context_in_dim, hidden_size=c.hidden_size,
        mlp_ratio=c.mlp_ratio, num_heads=c.num_heads, depth=c.depth, depth_single_blocks=c.depth_single,
        axes_dim=list(c.axes_dim), theta=int(c.theta), qkv_bias=c.qkv_bias, guidance_embed=c.guidance_embed)
    with init_empty_weights():
        model = flux_models.Flux(params)
    _assign(model, ours.state_dict())
    return model.to(torch.float8_e4m3fn) if precision == "fp8" else model


def musubi_qwen(qwen_model, fp8_utils, ours, precision: str):
    """musubi-tuner's QwenImageTransformer2DModel on our tensors; fp8 as its loader does it."""
    from accelerate import init_empty_weights

    c = ours.config
    with init_empty_weights():  # parameters on meta, RoPE tables real (as musubi's create_model)
        model = qwen_model.QwenImageTransformer2DModel(
            patch_size=c.patch_size, in_channels=c.in_channels, out_channels=c.out_channels, num_layers=c.num_layers,
            attention_head_dim=c.attention_head_dim, num_attention_heads=c.num_attention_heads,
            joint_attention_dim=c.joint_attention_dim, axes_dims_rope=tuple(c.axes_dims_rope), attn_mode="torch")
    state = dict(ours.state_dict())
    if precision == "fp8_scaled":  # load_qwen_image_model(fp8_scaled=True): quantize, then patch forwards
        fp8_utils.optimize_state_dict_with_fp8(state, None, qwen_model.FP8_OPTIMIZATION_TARGET_KEYS,
                                               qwen_model.FP8_OPTIMIZATION_EXCLUDE_KEYS, move_to_device=False)
        fp8_utils.apply_fp8_monkey_patch(model, state, use_scaled_mm=False)
    _assign(model, state)
    return model.to(torch.float8_e4m3fn) if precision == "fp8" else model  # fp8_base: transformer.to(fp8)


def add_their_lora(family: str, model, rank: int, peer):
    """Their network through their own factory (create_network / create_arch_network) and apply_to."""
    if family == "flux":
        network = peer["lora"].create_network(1.0, rank, rank, None, [], model)
        network.apply_to([], model, apply_text_encoder=False, apply_unet=True)
    else:
        # musubi's own default exclude `.*(_mod_).*` is matched against names like `img_mod.1` and never
        # fires, so its default trains the modulation too; excluded here as intended (and as ours).
        network = peer["lora"].create_arch_network(1.0, rank, rank, None, [], model,
                                                   exclude_patterns=repr([r".*_mod\..*"]))
        network.apply_to(None, model, apply_text_encoder=False, apply_unet=True)
    network.to(next(p.device for p in model.parameters()))  # their trainers move it with the model
    params = [p for p in network.parameters()]
    for p in params:
        p.requires_grad_(True)
    network.train()
    return network, params


def their_forward(family: str, model, x: dict, precision: str):
    """The call their trainer makes (flux_train_network.get_noise_pred_and_target /
    qwen_image_train_network.call_dit), inputs in the dtypes it passes."""
    b, T, dev = x["x_t"].shape[0], x["txt"].shape[1], x["x_t"].device
    if family == "flux":
        wd = torch.float32 if precision == "fp32" else torch.bfloat16  # sd-scripts' weight_dtype
        timesteps = (x["sigmas"] * 1000).to(wd)  # get_noisy_model_input_and_timesteps(...).to(dtype)
        return model(img=x["x_t"].to(wd), img_ids=make_img_ids(b, x["h"], x["w"], dev).float(), txt=x["txt"].to(wd),
                     txt_ids=torch.zeros(b, T, 3, device=dev), timesteps=timesteps / 1000, y=x["pooled"].to(wd),
                     guidance=torch.full((b,), 1.0, device=dev))
    return model(hidden_states=x["x_t"], encoder_hidden_states=x["txt"], encoder_hidden_states_mask=None,
                 timestep=x["sigmas"], img_shapes=[[(1, x["h"], x["w"])]] * b, txt_seq_lens=[T] * b)


def compile_both(family: str, ours, theirs, peer, our_mode: str | None = None):
    """torch.compile as each trainer does it (after the LoRA is applied and checkpointing is on):
    ours each block and its checkpointed call (train_lora.py's torch_compile: core.compile_block; our_mode:
    a torch.compile mode to try on ours, e.g. reduce-overhead's CUDA graphs against the host gaps);
    musubi-tuner each block (its --compile: model_utils.compile_transformer, inductor, mode default,
    dynamic auto); sd-scripts the whole model (its --torch_compile: accelerate's dynamo_backend,
    inductor). Returns their model to call."""
    from library.models.core import compile_block

    for block in ours.swappable_blocks():
        compile_block(block, **({"mode": our_mode} if our_mode else {}))
    if family == "flux":
        return torch.compile(theirs, backend="inductor")
    options = argparse.Namespace(compile_backend="inductor", compile_mode="default", compile_dynamic=None,
                                 compile_fullgraph=False, compile_cache_size_limit=None)
    return peer["utils"].compile_transformer(options, theirs, [theirs.transformer_blocks], disable_linear=False)


# ----------------------------------------------------------------------------------------------
# One comparison


def inputs(family: str, cfg, args) -> dict:
    from bench_train_step import make_inputs

    x = make_inputs(family, cfg, args.image_tokens, args.text_tokens, args.batch, args.device)
    x["sigmas"] = torch.full_like(x["sigmas"], SIGMA)
    return x


def autocast_for(precision: str, device: torch.device):
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)  # what accelerate's autocast() is for bf16


def make_step(forward, params, target, precision: str, device: torch.device):
    optimizer = torch.optim.AdamW(params, lr=1e-4)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        with autocast_for(precision, device):
            pred = forward()
        loss = F.mse_loss(pred.float(), target)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def build_pair(family: str, size: str, precision: str, args, peer):
    """(ours, theirs) on one set of base weights for `precision`."""
    base_dtype = torch.float32 if precision == "fp32" else torch.bfloat16
    base = build_ours(family, size, args, base_dtype, args.device)
    ours = fp8_twin(base, family, precision) if precision.startswith("fp8") else base
    if args.fp8_compute and precision.startswith("fp8"):
        if not fp8_gemm_available(args.device):
            raise SystemExit(f"--fp8-compute: {args.device} runs no fp8 GEMM with per-row scales")
        enable_fp8_compute(ours)
    if family == "flux":
        theirs = sd_scripts_flux(peer["model"], base, precision)
    else:
        theirs = musubi_qwen(peer["model"], peer["fp8"], base, precision)
    del base
    for model in (ours, theirs):  # frozen base, as both trainers load it; train mode: sd-scripts and
        model.requires_grad_(False).train()  # musubi checkpoint only while training
    if args.checkpointing:
        ours.gradient_checkpointing = checkpointing(True, args.save_projections, args.save_attention,
                                                    args.save_dequantized)
        theirs.enable_gradient_checkpointing()
    return ours, theirs


def compare(family: str, size: str, precision: str, args, peer, peaks: dict) -> dict:
    ours, theirs = build_pair(family, size, precision, args, peer)
    x = inputs(family, ours.config, args)
    _, our_params = add_our_lora(ours, family, args.rank)
    network, their_params = add_their_lora(family, theirs, args.rank, peer)
    fwd_ours = lambda: our_forward(family, ours, x)  # noqa: E731
    fwd_theirs = lambda: their_forward(family, theirs, x, precision)  # noqa: E731
    with torch.no_grad(), autocast_for(precision, args.device):  # LoRA up = 0 on both: the same function
        with op_counts.AttentionKernels() as kernels_ours:
            p_ours = fwd_ours().float()
        with op_counts.AttentionKernels() as kernels_theirs:
            p_theirs = fwd_theirs().float()
    diff = (p_ours - p_theirs).abs().max().item()
    rel = ((p_ours - p_theirs).norm() / p_ours.norm()).item()
    if args.compile:  # after the eager step-0 check: the steps below compile at their first (warm-up) call
        theirs = compile_both(family, ours, theirs, peer, args.our_compile_mode)
        fwd_theirs = lambda: their_forward(family, theirs, x, precision)  # noqa: E731
    steps = {"ours": make_step(fwd_ours, our_params, x["target"], precision, args.device),
             "theirs": make_step(fwd_theirs, their_params, x["target"], precision, args.device)}
    peak_dtype = "fp32" if precision == "fp32" else "bf16"
    before = matmul_peak(DTYPES[peak_dtype], args.gemm, device=args.device)  # re-measured around the steps:
    res = alternate(steps, args.warmup, args.reps, args.device)
    peak = max(peaks[peak_dtype], before, matmul_peak(DTYPES[peak_dtype], args.gemm, device=args.device))  # load moves it
    t_o, t_t = median(res["ours"]["times"]), median(res["theirs"]["times"])
    m_o, m_t = median(res["ours"]["peaks"]), median(res["theirs"]["peaks"])
    l_o, l_t = res["ours"]["loss"], res["theirs"]["loss"]
    counted = functools.partial(count_step, family, ours.config, args.batch, args.image_tokens, args.text_tokens,
                                args.rank, args.checkpointing)
    kept_attention = args.checkpointing and args.save_attention
    flops = counted(tail_skipped=args.save_projections or None, attention_kept=kept_attention)["total"]  # ours as run
    kept = counted(tail_skipped=args.save_projections or None)["total"] < counted(tail_skipped=None)["total"]
    keys = [k for k, on in (("checkpoint_saves_projections", kept), ("checkpoint_saves_attention", kept_attention),
                            ("checkpoint_saves_dequantized", args.checkpointing and args.save_dequantized),
                            ("fp8_compute", args.fp8_compute and precision.startswith("fp8"))) if on]
    flops_t = counted(tail_skipped=False)["total"]  # theirs recompute every GEMM in full
    n_o, n_t = sum(p.numel() for p in our_params), sum(p.numel() for p in their_params)
    print(f"[{family} {size} {precision}] {PEER[family]}; LoRA params ours {n_o:,} ({len(our_params) // 2}), "
          f"theirs {n_t:,} ({len(their_params) // 2}); step-0 prediction max|ours-theirs| {diff:.2e} "
          f"(rel. L2 {rel:.2e}); step-0 loss ours {l_o:.6f} theirs {l_t:.6f} (rel. diff {abs(l_o - l_t) / l_t:.1e})")
    print(f"  attention kernels (step-0 forward, no grad): ours {kernels_ours}; theirs {kernels_theirs}")
    print(f"  step ours {t_o:.3f} s  theirs {t_t:.3f} s  ratio {t_o / t_t:.2f}  (ours {fmt(res['ours']['times'])}, "
          f"theirs {fmt(res['theirs']['times'])}); memory ours {m_o / MiB:.0f} MiB theirs {m_t / MiB:.0f} MiB ratio "
          f"{m_o / max(m_t, 1):.2f}")
    # Load only ever slows a run down: the fastest step against the fastest GEMM is the fairest MFU.
    best_o, best_t = min(res["ours"]["times"]), min(res["theirs"]["times"])
    print(f"  {flops / 1e9:.1f} / {flops_t / 1e9:.1f} GFLOP; MFU (fastest step / best GEMM {peak / 1e9:.0f} GFLOP/s "
          f"{peak_dtype}) ours {flops / best_o / peak:.1%} theirs {flops_t / best_t / peak:.1%}; at the median step ours "
          f"{flops / t_o / peak:.1%} theirs {flops_t / t_t / peak:.1%}")
    del steps, network
    mode = "compiled" if args.compile else "eager"
    headline = (f"headline: {FAMILY_NAME[family]} {precision} {mode}: ours/{PEER[family]} {t_o / t_t:.2f}, "
                f"MFU {100 * flops / best_o / peak:.0f}%{' (' + ', '.join(keys) + ')' if keys else ''}")
    return {"headline": headline, "time": t_o / t_t, "mem": m_o / max(m_t, 1), "loss": abs(l_o - l_t) / l_t, "diff": diff,
            "mfu_ours": flops / best_o / peak, "mfu_theirs": flops_t / best_t / peak, "t_ours": t_o, "t_theirs": t_t}


# the models count_ops builds: (double, single) FLUX blocks or Qwen-Image blocks, the first one the base
OP_COUNT_MODELS = {"flux": {"base": (1, 1), "double block": (2, 1), "single block": (1, 2)},
                   "qwen_image": {"base": 1, "block": 2}}


def count_ops(family: str, precision: str, args, peer) -> str:
    """--count-ops: the aten ops of one step (op_counts.py), ours and theirs, at toy widths (the count
    does not depend on widths or tokens); per block from models one block apart. Returns a summary.
    --count-bytes: the bytes those ops move, at full width and the given tokens."""
    counted, measure = {}, "traffic" if args.count_bytes else "counts"
    for name, blocks in OP_COUNT_MODELS[family].items():
        args.double, args.single = blocks if family == "flux" else (1, 1)
        args.qwen_blocks = blocks if family == "qwen_image" else 1
        ours, theirs = build_pair(family, "mid" if args.count_bytes else "narrow", precision, args, peer)
        x = inputs(family, ours.config, args)
        _, our_params = add_our_lora(ours, family, args.rank)
        _, their_params = add_their_lora(family, theirs, args.rank, peer)
        autocast = functools.partial(autocast_for, precision, args.device)
        counted[name] = {
            "ours": op_counts.step_counts(lambda: our_forward(family, ours, x), our_params, x["target"], autocast,
                                          measure),
            PEER[family]: op_counts.step_counts(lambda: their_forward(family, theirs, x, precision), their_params,
                                                x["target"], autocast, measure)}
        del ours, theirs
    base = counted.pop("base")
    if args.count_bytes:
        return traffic_report(family, precision, args, counted, base)
    first = OP_COUNT_MODELS[family]["base"]
    blocks = f"{first[0]} double + {first[1]} single" if family == "flux" else str(first)
    print(f"[{family} {precision}] aten ops per step of the smallest model ({blocks} block, "
          f"{args.image_tokens} + {args.text_tokens} tokens):")
    for side, counts in base.items():
        print("  " + op_counts.summary(side, counts))
    lines = []
    for name, sides in counted.items():
        per_block = {side: op_counts.difference(counts, base[side]) for side, counts in sides.items()}
        print(f"  per {name}:")
        for side, counts in per_block.items():
            print("    " + op_counts.summary(side, counts))
        print(op_counts.table(per_block))
        n_o, n_t = (sum(op_counts.total(c).values()) for c in per_block.values())
        lines.append(f"{name} {n_o}/{n_t}")
    return f"{family} {precision} ops per {', '.join(lines)} (ours/{PEER[family]})"


def traffic_report(family: str, precision: str, args, counted: dict, base: dict) -> str:
    """--count-bytes: per block, GB moved by the GEMMs and attention and by every other op (the unfused
    elementwise work, time ~ bytes / bandwidth on a GPU), ours and the peer's, and the top ops by bytes."""
    print(f"[{family} {precision}] bytes read + written per block, full width, "
          f"{args.image_tokens} + {args.text_tokens} tokens (GB; other = not GEMM / attention / view):")
    lines = []
    for name, sides in counted.items():
        per_block = {side: op_counts.total(op_counts.difference(c, base[side])) for side, c in sides.items()}
        split = {side: (sum(v for k, v in c.items() if op_counts.is_compute(k)) / 1e9,
                        sum(v for k, v in c.items() if not op_counts.is_compute(k)) / 1e9)
                 for side, c in per_block.items()}
        for side, (compute, other) in split.items():
            top = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in per_block[side].most_common(25)
                            if not op_counts.is_compute(k))
            print(f"  per {name}, {side}: GEMM + attention {compute:.2f} GB, other {other:.2f} GB ({top})")
        (_, o_other), (_, t_other) = split.values()
        lines.append(f"{name} other {o_other:.2f}/{t_other:.2f} GB")
    return f"{family} {precision} bytes per {', '.join(lines)} (ours/{PEER[family]})"


def fmt(times) -> str:
    return "[" + ", ".join(f"{t:.3f}" for t in times) + "]"


def supported(family: str, precision: str) -> bool:
    return not (family == "flux" and precision == "fp8_scaled")  # sd-scripts: no scaled fp8 for FLUX.1


def measure_peaks(args) -> dict:
    peaks = {name: matmul_peak(dtype, args.gemm, device=args.device) for name, dtype in DTYPES.items()}
    print(f"matmul peak ({args.gemm}^3 GEMM, best of 3): bf16 {peaks['bf16'] / 1e9:.0f} GFLOP/s, "
          f"fp32 {peaks['fp32'] / 1e9:.0f} GFLOP/s")
    return peaks


def add_pair_arguments(p: argparse.ArgumentParser, blocks: tuple[int, int, int], tokens: tuple[int, int]):
    """The options build_pair and the peers read (also profile_peers.py's): blocks = the defaults of
    --double, --single, --qwen-blocks; tokens = of --image-tokens, --text-tokens."""
    p.add_argument("--sd_scripts", help="sd-scripts checkout (FLUX.1 peer)")
    p.add_argument("--musubi", help="musubi-tuner checkout (Qwen-Image peer)")
    p.add_argument("--families", default="flux,qwen_image")
    p.add_argument("--double", type=int, default=blocks[0], help="FLUX mid: double blocks at width 3072")
    p.add_argument("--single", type=int, default=blocks[1], help="FLUX mid: single blocks at width 3072")
    p.add_argument("--qwen-blocks", type=int, default=blocks[2])
    p.add_argument("--image-tokens", type=int, default=tokens[0])
    p.add_argument("--text-tokens", type=int, default=tokens[1])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false")
    p.add_argument("--save-projections", action="store_true",
                   help="ours with checkpoint_saves_projections (the recompute skips the tails the trained gates need)")
    p.add_argument("--save-attention", action="store_true",
                   help="ours with checkpoint_saves_attention (the recompute runs no attention)")
    p.add_argument("--save-dequantized", action="store_true",
                   help="ours with checkpoint_saves_dequantized (a low-bit base: backward reuses the recompute's "
                        "weights)")
    p.add_argument("--fp8-compute", action="store_true",
                   help="ours with fp8_compute on its fp8 / fp8_scaled base: the base's Linears as fp8 GEMMs (per-row "
                        "scales, bf16 outputs; the peers have no such mode): a setting of ours, named in the headline")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile both sides as their trainers do (see compile_both); the warm-up steps compile")
    p.add_argument("--our-compile-mode", default=None, help="with --compile: a torch.compile mode for ours only "
                   "(e.g. reduce-overhead: CUDA graphs), a lever to measure; the trainer's is the default mode")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the GPU: peak from a bf16/fp32 GEMM on it)")
    p.add_argument("--sdpa", default="default", choices=("default", "flash"),
                   help="CUDA attention for both sides: default = torch's own choice (cuDNN first on sm90 / sm100 "
                        "with cuDNN >= 9.15, what a user of either trainer gets); flash = cuDNN off, so flash / "
                        "memory-efficient (every GPU line up to 2026-11-28 ran this way)")


def load_peers(args, families: list[str]) -> dict:
    """args.device as a torch.device, and {family: the peer's imported modules} from the checkouts given."""
    args.device = device_or_exit(args.device)
    if args.device.type == "cuda" and args.sdpa == "flash":
        # Until 2026-11-28 every GPU run switched cuDNN off here (bench_train_step's diffusers call hit an
        # illegal memory access in it on torch 2.11 + H100), so both sides ran flash where torch would pick cuDNN.
        torch.backends.cuda.enable_cudnn_sdp(False)
    peers = {}
    if "flux" in families:
        if not args.sd_scripts:
            raise SystemExit("--sd_scripts DIR is needed for the FLUX comparison (a kohya-ss/sd-scripts checkout)")
        flux_models, lora_flux = import_sd_scripts(
            checkout_or_exit(args.sd_scripts, "--sd_scripts", "library/flux_models.py", "kohya-ss/sd-scripts"))
        peers["flux"] = {"model": flux_models, "lora": lora_flux}
    if "qwen_image" in families:
        if not args.musubi:
            raise SystemExit("--musubi DIR is needed for the Qwen-Image comparison (a kohya-ss/musubi-tuner checkout)")
        model, lora, fp8, utils = import_musubi(checkout_or_exit(
            args.musubi, "--musubi", "src/musubi_tuner/qwen_image/qwen_image_model.py", "kohya-ss/musubi-tuner"))
        peers["qwen_image"] = {"model": model, "lora": lora, "fp8": fp8, "utils": utils}
    return peers


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    add_pair_arguments(p, blocks=(1, 1, 2), tokens=(256, 64))
    p.add_argument("--sizes", default="tiny,mid")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--tiny-reps", type=int, default=10)
    p.add_argument("--gemm", type=int, default=4096, help="matrix size of the peak GEMM")
    p.add_argument("--count-ops", action="store_true",
                   help="no timing: count the aten ops of one step (forward, backward, AdamW) ours and theirs, "
                        "per block, at toy widths (bench/op_counts.py); --sizes is not used")
    p.add_argument("--count-bytes", action="store_true",
                   help="no timing: the bytes the ops of one step read and write per block, at full width and "
                        "the given tokens (bench/op_counts.py); --sizes is not used")
    args = p.parse_args(argv)
    families = args.families.split(",")
    peers = load_peers(args, families)
    if args.count_ops or args.count_bytes:
        lines = [count_ops(family, precision, args, peers[family]) for family in families
                 for precision in args.precisions.split(",") if supported(family, precision)]
        print("SUMMARY: " + "; ".join(lines))
        return
    pinned = pin_malloc_threshold() if args.device.type == "cpu" else False
    gpu = f"; GPU {torch.cuda.get_device_name()}" if args.device.type == "cuda" else ""
    print(f"machine: {machine_summary()}{gpu}; load average {os.getloadavg()[0]:.1f}; memory: "
          f"{memory_method(args.device)}{' (malloc mmap threshold pinned)' if pinned else ''}; "
          f"checkpointing {'on' if args.checkpointing else 'off'}"
          f"{' (ours: checkpoint_saves_projections)' if args.checkpointing and args.save_projections else ''}"
          f"{' (ours: checkpoint_saves_attention)' if args.checkpointing and args.save_attention else ''}"
          f"{' (ours: checkpoint_saves_dequantized)' if args.checkpointing and args.save_dequantized else ''}"
          f"{' (ours: fp8_compute on fp8 bases)' if args.fp8_compute else ''}"
          f"{'; SDPA: ' + args.sdpa if args.device.type == 'cuda' else ''}")
    peaks = measure_peaks(args)
    summary, headlines, start, reps, threads = [], [], time.time(), args.reps, torch.get_num_threads()
    for size in args.sizes.split(","):
        args.reps = args.tiny_reps if size == "tiny" else reps
        # Toy ops take microseconds: on a shared machine more threads only add OpenMP sync stalls.
        torch.set_num_threads(1 if size == "tiny" else threads)
        for family in families:
            for precision in args.precisions.split(","):
                if supported(family, precision):
                    r = compare(family, size, precision, args, peers[family], peaks)
                    summary.append(f"{family}/{size}/{precision} time {r['time']:.2f} mem {r['mem']:.2f} "
                                   f"loss0 {r['loss']:.0e} mfu {r['mfu_ours']:.0%}/{r['mfu_theirs']:.0%}")
                    if size != "tiny":
                        headlines.append(r["headline"])
    print(f"load average at end {os.getloadavg()[0]:.1f}")
    print(f"SUMMARY (ours/theirs, {time.time() - start:.0f} s): " + "; ".join(summary))
    print("\n".join(headlines))  # RESULTS.md's performance section opens with these (from a GPU run)


if __name__ == "__main__":
    main()
