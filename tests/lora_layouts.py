"""LoRA files for the reader's tests (tests/test_lora_reader.py, tests/test_lora_refusals.py): tiny FLUX.1 and
Z-Image models with one LoRA each in every layout convert_lora reads or another trainer writes, and the
consumers (every tool that applies a LoRA), each returning its dense deltas. tests/conftest.py builds the sets
once per session (flux_loras, zimage_loras, qwen_lora)."""

import copy
import json

import torch
from safetensors.torch import load_file, save_file

from library.lora_spec import LoRASpec
from library.models.flux1.checkpoint import flux_diffusers_module_map, save_flux_bfl, save_flux_diffusers
from library.models.flux1.model import Flux, FluxConfig
from library.models.qwen_image.model import QwenImage, QwenImageConfig
from library.models.zimage.checkpoint import save_zimage_diffusers, save_zimage_single_file
from library.models.zimage.model import ZImage
from library.models.zimage.tiny import tiny_config as zimage_config
from library.training.base_loras import merge_base_loras
from networks import lora_files as lf
from networks.factory import network_from_file
from networks.lora import LoRANetwork
from tests import test_lora_clients as lora_clients
from tools import convert_lora, merge_lora
from tools.precision_doctor import read_lora_for

FLUX_CFG = FluxConfig(in_channels=64, vec_in_dim=16, context_in_dim=32, hidden_size=64, num_heads=2, depth=1,
                      depth_single=1, axes_dim=(4, 14, 14))  # fmt: skip
TOL = 1e-5  # relative to the largest delta entry: float32, the same products summed in another order


def randomized(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() == 2 else 10))
    return model.eval()


def random_lora(model, arch: str, **args) -> LoRANetwork:
    return lora_clients.random_lora(model, arch, up_std=0.2, **args)


def dense(weights: dict) -> dict[str, torch.Tensor]:
    return {p: w.delta() for p, w in weights.items()}


# ----------------------------------------------------------------------------------------------
# Layouts: our file converted by convert_lora, or renamed as other trainers write it


def renamed(src: str, dst: str, rename) -> str:
    save_file({rename(k): v for k, v in load_file(src).items()}, dst)
    return dst


def with_text_encoder(src: str, dst: str) -> str:
    """sd-scripts' file: CLIP-L modules beside the transformer's (left out by every consumer)."""
    tensors = load_file(src)
    name = "lora_te1_text_model_encoder_layers_0_mlp_fc1"
    tensors.update({f"{name}.lora_down.weight": torch.ones(4, 8), f"{name}.lora_up.weight": torch.ones(8, 4),
                    f"{name}.alpha": torch.tensor(4.0)})
    save_file(tensors, dst)
    return dst


def with_diffusers_text_encoder(src: str, dst: str) -> str:
    """FluxPipeline.save_lora_weights with text_encoder_lora_layers: CLIP-L's modules under `text_encoder.`
    beside the transformer's (left out by every consumer, with one warning)."""
    name = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"
    save_file({**load_file(src), f"{name}.lora_A.weight": torch.ones(4, 8), f"{name}.lora_B.weight": torch.ones(8, 4)}, dst)
    return dst


def with_bias_diffs(src: str, dst: str) -> str:
    """ComfyUI's Extract and Save Lora with bias_diff (its default): a `.diff_b` bias delta beside each module
    (left out by every consumer, with one warning)."""
    tensors = load_file(src)
    modules = {k.removesuffix(".lora_up.weight"): v.shape[0] for k, v in tensors.items() if k.endswith(".lora_up.weight")}
    save_file({**tensors, **{f"{m}.diff_b": torch.ones(rows) for m, rows in modules.items()}}, dst)
    return dst


def with_adapter_name(key: str, name: str = "default") -> str:
    """A PEFT key as a raw model.state_dict() names it: the adapter name between lora_A / lora_B and weight."""
    return key.replace(".lora_A.weight", f".lora_A.{name}.weight").replace(".lora_B.weight", f".lora_B.{name}.weight")


def kohya_of_peft(src: str, dst: str, prefix: str) -> str:
    """A diffusers file's modules as kohya names (`<prefix>_<diffusers path>`): OneTrainer's
    lora_transformer_, and diffusers names under lora_unet_ (alpha folded: alpha = rank)."""
    out = {}
    for key, v in load_file(src).items():
        module, part = key.removeprefix("transformer.").rsplit(".lora_", 1)
        name = lf.kohya_name(module, prefix)
        out[f"{name}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = v
        out.setdefault(f"{name}.alpha", torch.tensor(float(v.shape[0] if part.startswith("A") else v.shape[1])))
    save_file(out, dst)
    return dst


def common_layouts(root, ours: str, model) -> dict[str, str]:
    files = {"kohya (ours)": ours}
    for to in ("diffusers", "comfy"):
        files[to] = str(root / f"{to}.safetensors")
        assert convert_lora.convert_lora(ours, files[to], to)["to"] == to
    files["kohya + text encoder (sd-scripts)"] = with_text_encoder(ours, str(root / "te.safetensors"))
    files["PEFT base_model.model."] = renamed(files["diffusers"], str(root / "peft.safetensors"),
                                              lambda k: k.replace("transformer.", "base_model.model.", 1))
    paths = {lf.kohya_name(p): p for p, _ in model.named_modules() if p}  # '_' in names: dotted from the model's
    files["ComfyUI dotted lora_down"] = renamed(ours, str(root / "comfy_down.safetensors"),
                                                lambda k: "diffusion_model." + paths[k.split(".")[0]] + k[len(k.split(".")[0]):])
    return files


# ----------------------------------------------------------------------------------------------
# FLUX.1: BFL-named model (fused qkv, linear1), files in BFL or diffusers names


def flux_loras(root) -> dict:
    """A tiny FLUX.1 (BFL file base.safetensors, diffusers folder diffusers/) and one LoRA of it in every layout
    in `root`: {"root", "model", "cases": {layout: (file, its dense deltas by the model's module)}}."""
    model = randomized(Flux(FLUX_CFG), 1)
    save_flux_bfl(model, str(root / "base.safetensors"))
    save_flux_diffusers(model, FLUX_CFG, str(root / "diffusers"))
    net = random_lora(model, "flux", train_modulation=True)
    ours = str(root / "ours.safetensors")
    net.save(ours)
    files = common_layouts(root, ours, model)
    files["OneTrainer lora_transformer_ (diffusers names)"] = kohya_of_peft(files["diffusers"], str(root / "ot.safetensors"), "lora_transformer")
    files["lora_unet_ in diffusers names"] = kohya_of_peft(files["diffusers"], str(root / "ku.safetensors"), "lora_unet")
    files["diffusers + text_encoder (diffusers pipeline)"] = with_diffusers_text_encoder(files["diffusers"], str(root / "dte.safetensors"))
    files["PEFT adapter name (raw state_dict)"] = renamed(files["diffusers"], str(root / "adapter.safetensors"), with_adapter_name)
    files["ComfyUI extraction (.diff_b beside)"] = with_bias_diffs(files["ComfyUI dotted lora_down"], str(root / "extract.safetensors"))
    split, split_reference = split_downs_lora(root)
    cases = {name: (path, dense(net.lora_weights())) for name, path in files.items()}
    cases["diffusers q / k / v with their own downs"] = (split, split_reference)
    return {"root": root, "model": model, "cases": cases}


def split_downs_lora(root) -> tuple[str, dict[str, torch.Tensor]]:
    """A diffusers FLUX.1 LoRA as diffusers / ai-toolkit train it: every split module (to_q, to_k, to_v, proj_mlp
    ...) with its own down, alpha 2 in diffusers' adapter-config header (pipeline-level keys); and the oracle: each module's own
    delta (alpha / r) B @ A, placed at its rows of the fused BFL module (what diffusers applies, module by module)."""
    in_features = {p: m.in_features for p, m in Flux(FLUX_CFG).named_modules() if isinstance(m, torch.nn.Linear)}
    g = torch.Generator().manual_seed(9)
    tensors, reference = {}, {}
    for bfl, parts in flux_diffusers_module_map(1, 1, 64, 256, 64, FLUX_CFG.guidance_embed).items():
        reference[bfl] = torch.zeros(max(end for _, _, end in parts), in_features[bfl])
        for d in dict.fromkeys(d for d, _, _ in parts):  # a module's rows may be several ranges (norm_out: shift, scale)
            ranges = [(start, end) for name, start, end in parts if name == d]
            down = torch.randn(4, in_features[bfl], generator=g)
            up = torch.randn(sum(end - start for start, end in ranges), 4, generator=g) * 0.2
            tensors[f"transformer.{d}.lora_A.weight"], tensors[f"transformer.{d}.lora_B.weight"] = down, up
            delta, row = 0.5 * up @ down, 0  # alpha 2 / rank 4
            for start, end in ranges:
                reference[bfl][start:end], row = delta[row : row + end - start], row + end - start
    path = str(root / "split.safetensors")  # the adapter config as a pipeline's save_lora_weights writes it
    modules = sorted(k.removeprefix("transformer.").removesuffix(".lora_A.weight") for k in tensors if k.endswith("lora_A.weight"))
    config = {"transformer.r": 4, "transformer.lora_alpha": 2, "transformer.target_modules": modules}
    save_file(tensors, path, metadata={lf.ADAPTER_METADATA_KEY: json.dumps(config)})
    return path, reference


# ----------------------------------------------------------------------------------------------
# Z-Image: diffusers-named model (split q / k / v); ComfyUI's own names fuse them


def zimage_loras(root) -> dict:
    """A tiny Z-Image (single file base.safetensors, diffusers folder diffusers/) and one LoRA of it in every
    layout in `root`, as flux_loras."""
    model = randomized(ZImage(zimage_config()), 2)
    save_zimage_single_file(model, str(root / "base.safetensors"), zimage_config())
    save_zimage_diffusers(model, zimage_config(), str(root / "diffusers"))
    net = random_lora(model, "zimage")
    ours = str(root / "ours.safetensors")
    net.save(ours)
    files = common_layouts(root, ours, model)
    files["ComfyUI's own names (fused qkv, musubi-tuner)"] = comfy_own_zimage(net.lora_weights(), str(root / "own.safetensors"))
    return {"root": root, "model": model, "cases": {n: (p, dense(net.lora_weights())) for n, p in files.items()}}


def comfy_own_zimage(weights: dict, path: str) -> str:
    """musubi-tuner's convert_z_image_lora_to_comfy.py form: q / k / v fused (downs stacked, ups
    block-diagonal with each part's scale, alpha = the new rank), out renamed attention.out."""
    out = {}
    for p, w in weights.items():
        if p.endswith((".attention.to_k", ".attention.to_v")):
            continue
        if p.endswith(".attention.to_q"):
            block = p[: -len(".attention.to_q")]
            parts = [weights[f"{block}.attention.to_{c}"] for c in "qkv"]
            down = torch.cat([x.down for x in parts])
            out[f"{block}.attention.qkv"] = lf.LoRAWeights(down, torch.block_diag(*[x.up * x.scale for x in parts]), 12.0)
        else:
            out[p.replace("attention.to_out.0", "attention.out")] = w
    lf.write_kohya(out, path)
    return path


# ----------------------------------------------------------------------------------------------
# Consumers: each returns {the model's module path, or the checkpoint's weight name: dense delta}


def generate_reads(model, arch, path, root):  # generate.py --lora (and output_error, concept_demo)
    return dense(network_from_file(model, arch, path).lora_weights())


def network_weights_reads(model, arch, path, root):  # the trainer's network_weights: rank 4, default targets
    net = LoRANetwork(model, arch, rank=4, alpha=2, network_args={"train_modulation": True} if arch == "flux" else {})
    counts = net.load_weights(path, strict=False)
    assert counts["loaded"] > 0
    return {p: d for p, d in dense(net.lora_weights()).items() if d.abs().max() > 0}  # untouched modules: up = 0


def base_loras_reads(model, arch, path, root):  # the trainer's base_loras: merged into a copy of the base
    merged = copy.deepcopy(model)
    merge_base_loras(merged, arch, [LoRASpec(path, 1.0)])
    before, after = dict(model.named_modules()), dict(merged.named_modules())
    return {p: after[p].weight - before[p].weight for p in before
            if isinstance(before[p], torch.nn.Linear) and not torch.equal(after[p].weight, before[p].weight)}


def precision_tools_read(model, arch, path, root):  # precision_doctor / precision_matrix
    return dense(read_lora_for(model, arch, path))


def merge_reads(checkpoint: str):
    def reads(model, arch, path, root):
        base = merge_lora.open_base(str(root / checkpoint))
        deltas = merge_lora.lora_deltas(base, LoRASpec(path, 1.0), False).items()  # bias deltas: tests/test_whole_deltas.py
        return {k.removesuffix(".weight"): w.delta() for k, w in deltas if not k.endswith(".bias")}

    return reads


CONSUMERS = {"generate": generate_reads, "network_weights": network_weights_reads, "base_loras": base_loras_reads,
             "precision_tools": precision_tools_read, "merge_lora": merge_reads("base.safetensors"),
             "merge_lora into the other naming": merge_reads("diffusers")}  # fmt: skip


def expected_in(checkpoint_naming: str, root, reference: dict) -> dict:
    """The reference deltas named as the consumer names them: the model's modules, or a checkpoint's
    weights in its naming (rows of fused modules joined or split through the checkpoint's module map)."""
    if checkpoint_naming is None:
        return reference
    base = merge_lora.open_base(str(root / checkpoint_naming))
    if base.module_map is None:
        return reference
    out = {}
    if base.native:  # the checkpoint fuses modules the model splits (Z-Image's single file)
        for fused, parts in base.module_map.items():
            if all(d in reference for d, _, _ in parts):
                out[fused] = torch.cat([reference[d] for d, _, _ in parts])
        return {**{p: d for p, d in reference.items() if p not in {d for ps in base.module_map.values() for d, _, _ in ps}}, **out}
    for own, parts in base.module_map.items():  # the checkpoint splits modules the model fuses (a diffusers folder)
        for d, start, end in parts if own in reference else ():
            out[d] = reference[own][start:end] if d not in out else torch.cat([out[d], reference[own][start:end]])
    return {**{p: d for p, d in reference.items() if p not in base.module_map}, **out}


def assert_same_deltas(got: dict, want: dict):
    assert set(got) == set(want)
    for p, d in want.items():
        assert (got[p] - d).abs().max() <= TOL * d.abs().max(), p


# ----------------------------------------------------------------------------------------------
# Another family's LoRA

QWEN_CFG = QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 12, 12))


def qwen_lora(root) -> str:
    """A LoRA of a tiny Qwen-Image (another family's LoRA for the FLUX.1 consumers), in `root`."""
    path = str(root / "qwen_lora.safetensors")
    random_lora(QwenImage(QWEN_CFG), "qwen_image").save(path)
    return path
