"""networks/lora_reader.py, the one LoRA reader: every tool that applies a LoRA (generate's --lora, the
trainer's network_weights and base_loras, merge_lora into either naming of a checkpoint, the precision
tools) reads every layout convert_lora reads, and applies the same deltas. Tiny FLUX.1 and Z-Image files
in each layout are built once per session; each consumer's dense deltas are compared with the LoRA's own
(float32 math on both sides)."""

import copy
import json
import re
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from library.models import spec as S
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


@pytest.fixture(scope="session")
def flux(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader_flux")
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


@pytest.fixture(scope="session")
def zimage(tmp_path_factory):
    root = tmp_path_factory.mktemp("reader_zimage")
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
        return {k.removesuffix(".weight"): w.delta() for k, w in merge_lora.lora_deltas(base, LoRASpec(path, 1.0), False).items()}

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


FLUX_CASES = ["kohya (ours)", "diffusers", "comfy", "kohya + text encoder (sd-scripts)", "PEFT base_model.model.",
              "ComfyUI dotted lora_down", "OneTrainer lora_transformer_ (diffusers names)", "lora_unet_ in diffusers names",
              "diffusers q / k / v with their own downs", "ComfyUI extraction (.diff_b beside)",
              "diffusers + text_encoder (diffusers pipeline)", "PEFT adapter name (raw state_dict)"]  # fmt: skip
ZIMAGE_CASES = ["kohya (ours)", "diffusers", "comfy", "kohya + text encoder (sd-scripts)", "PEFT base_model.model.",
                "ComfyUI dotted lora_down", "ComfyUI's own names (fused qkv, musubi-tuner)"]  # fmt: skip


def checkpoint_of(consumer: str):
    return {"merge_lora": "base.safetensors", "merge_lora into the other naming": "diffusers"}.get(consumer)


@pytest.mark.filterwarnings("ignore:.*text-encoder", "ignore:.*tensors beside the LoRA")
@pytest.mark.parametrize("arch, layout", [("flux", c) for c in FLUX_CASES] + [("zimage", c) for c in ZIMAGE_CASES])
@pytest.mark.parametrize("consumer", CONSUMERS)
def test_every_consumer_applies_every_layout_exactly(request, consumer, arch, layout):
    built = request.getfixturevalue(arch)  # the flux / zimage fixture: model, files and references
    path, reference = built["cases"][layout]
    got = CONSUMERS[consumer](built["model"], arch, path, built["root"])
    assert_same_deltas(got, expected_in(checkpoint_of(consumer), built["root"], reference))


def test_a_diffusers_lora_with_text_encoder_modules_loads_the_transformers(flux, tmp_path):
    """diffusers' pipelines save a text encoder's LoRA under its component name (`text_encoder.text_model...`,
    CLIP-L for FLUX.1). The old reader took those for transformer modules: generate and network_weights stopped
    after the model loaded with "LoRA module 'text_encoder.text_model.encoder.layers.0.self_attn.q_proj' is not a
    Linear of this flux model". Now they are left out as sd-scripts' lora_te1_ are, with one warning; --to kohya
    leaves them out too (a kohya file holds sd-scripts' names only)."""
    from networks.lora_reader import check_lora_arch

    path, _ = flux["cases"]["diffusers + text_encoder (diffusers pipeline)"]
    check_lora_arch(path, "flux")
    with pytest.warns(UserWarning) as said:
        network_from_file(flux["model"], "flux", path)
    assert [str(w.message) for w in said] == [f"{path}: left out 1 text-encoder modules (diffusers text_encoder. x1): "
                                              f"they adapt the text encoders, not this network's model"]
    convert_lora.convert_lora(path, str(tmp_path / "k.safetensors"), "kohya")
    assert all(k.startswith("lora_unet_") for k in load_file(str(tmp_path / "k.safetensors")))


def test_peft_keys_with_an_adapter_name_read_without_it_and_two_adapters_are_one_line(flux, tmp_path, capsys):
    """A raw model.state_dict() of a PEFT-wrapped model names each tensor `<module>.lora_A.default.weight`: every
    reader stopped with "LoRA key '...lora_A.default.weight': expected a name ending in .lora_down.weight ...".
    Now the adapter name is dropped where one name is on every lora_A / lora_B key (every consumer: FLUX_CASES),
    for a file, a state dict and lora_info alike; two adapters in one file are one line naming both."""
    from tools import lora_info

    path, reference = flux["cases"]["PEFT adapter name (raw state_dict)"]
    tensors = load_file(path)
    assert (sum(".lora_A.default.weight" in k for k in tensors), len(reference)) == (20, 13)  # diffusers names: q / k / v split
    assert_same_deltas(dense(LoRANetwork.from_weights(flux["model"], "flux", tensors).lora_weights()), reference)
    info = lora_info.read_info(path)
    plain = lora_info.read_info(flux["cases"]["diffusers"][0])
    assert (info["format"], info["arch"], info["modules"]) == (plain["format"], "flux", plain["modules"]) == ("diffusers", "flux", 20)
    dora = ["x.lora_A.mine.weight", "x.lora_B.mine.weight", "x.lora_magnitude_vector.mine.weight"]  # peft's saved names
    assert lf.adapter_name_dropped(dora) == dict(zip(dora, ["x.lora_A.weight", "x.lora_B.weight", "x.lora_magnitude_vector"]))
    two = {**tensors, **{k.replace(".default.", ".style."): v.clone() for k, v in tensors.items() if "single_transformer_blocks" in k}}
    mixed = {**tensors, "transformer.proj_out.lora_A.weight": torch.ones(4, 64), "transformer.proj_out.lora_B.weight": torch.ones(64, 4)}
    for name, bad, line in (("two", two, "holds the PEFT adapters 'default', 'style' (keys like "),
                            ("mixed", mixed, "key 'transformer.proj_out.lora_A.weight' has no adapter name beside keys of "
                                             "the PEFT adapter 'default'")):
        save_file(bad, str(tmp_path / f"{name}.safetensors"))
        assert merge_lora.main(["--model", str(flux["root"] / "base.safetensors"), "--lora", str(tmp_path / f"{name}.safetensors"),
                                "--save_to", str(tmp_path / "m.safetensors")]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"error: {tmp_path / name}.safetensors: {line}") and "\n" not in error, error
        with pytest.raises(CheckpointError, match="^" + re.escape(f"state dict: {line}")):
            LoRANetwork.from_weights(flux["model"], "flux", bad)


def test_onetrainers_flux1_t5_lora_te2_is_called_t5_where_a_file_is_described(flux, tmp_path, capsys):
    """OneTrainer writes FLUX.1's T5-XXL LoRA as lora_te2_ (its text_encoder_2; CLIP-L lora_te1_). Every line
    that said what a file holds called it CLIP-G (sd-scripts' SDXL name): lora_info, generate's and merge_lora's
    warnings, the refusal of text encoders alone. Now FLUX.1's and Chroma's say T5-XXL (the family's
    LoRAFiles.text_encoders); the modules stay left out, and the generic name stays for other files."""
    from networks.lora_reader import check_lora_arch
    from tools import lora_info

    te = {f"{m}.{part}": t for m, n in (("lora_te1_text_model_encoder_layers_0_mlp_fc1", 8), ("lora_te2_encoder_block_0_layer_0_SelfAttention_q", 32))
          for part, t in (("lora_down.weight", torch.ones(4, n)), ("lora_up.weight", torch.ones(n, 4)), ("alpha", torch.tensor(4.0)))}
    path, t5_only = str(tmp_path / "ot.safetensors"), str(tmp_path / "t5.safetensors")
    save_file({**load_file(flux["cases"]["OneTrainer lora_transformer_ (diffusers names)"][0]), **te}, path)
    save_file({k: v for k, v in te.items() if k.startswith("lora_te2_")}, t5_only)
    note = "2 text-encoder modules (CLIP-L lora_te1_ x1, T5-XXL lora_te2_ x1)"
    assert lora_info.read_info(path)["text_encoders"] == note
    with pytest.warns(UserWarning) as said:
        network_from_file(flux["model"], "flux", path)
    assert [str(w.message) for w in said] == [f"{path}: left out {note}: they adapt the text encoders, not this network's model"]
    assert merge_lora.main(["--model", str(flux["root"] / "base.safetensors"), "--lora", path, "--save_to", str(tmp_path / "m.safetensors")]) == 0
    assert f"skipped {note}: they adapt the text encoders" in capsys.readouterr().err
    for arch in ("flux", "chroma"):
        with pytest.raises(CheckpointError, match=re.escape(f"{t5_only}: holds only 1 text-encoder modules (T5-XXL lora_te2_ x1)")):
            check_lora_arch(t5_only, arch)
    assert lf.text_encoder_note(te) == "2 text-encoder modules (CLIP-L lora_te1_ x1, CLIP-G lora_te2_ x1)"


def test_a_comfyui_extracted_lora_reads_its_down_up_and_says_what_it_leaves_out(flux, tmp_path):
    """ComfyUI's Extract and Save Lora writes a `.diff_b` per bias (bias_diff, on by default) beside the down/up
    modules. The old readers took the file for LyCORIS' full type: generate said "LyCORIS module 'diffusion_model'
    names no module of this model", network_weights asked for network_module lycoris.kohya, lora_info said "full
    in lycoris layout". OneTrainer's embeddings bundled with a LoRA (`bundle_emb.<name>.t5`) stopped every reader
    with "LoRA key 'bundle_emb...': expected a name ending in .lora_down.weight ...". Now the LoRA loads and one
    line counts what is left out; lora_info says it too."""
    from tools import lora_info

    path, _ = flux["cases"]["ComfyUI extraction (.diff_b beside)"]
    with pytest.warns(UserWarning) as said:
        network_from_file(flux["model"], "flux", path)
    assert [str(w.message) for w in said] == [f"{path}: left out 13 tensors beside the LoRA (bias deltas .diff_b x13): "
                                              f"a LoRA network applies the down/up modules only"]
    info = lora_info.read_info(path)
    assert (info["format"], info["network"], info["beside_lora"]) == ("comfy", "LoRA", "13 tensors beside the LoRA (bias deltas .diff_b x13)")
    assert "left out by LoRA loaders: 13 tensors beside the LoRA (bias deltas .diff_b x13)" in lora_info.text_report(info).splitlines()
    bundled = str(tmp_path / "onetrainer.safetensors")
    save_file({**load_file(flux["cases"]["OneTrainer lora_transformer_ (diffusers names)"][0]),
               "bundle_emb.mystyle.clip_l": torch.ones(2, 8), "bundle_emb.mystyle.t5": torch.ones(2, 32)}, bundled)
    with pytest.warns(UserWarning) as said:
        assert len(network_from_file(flux["model"], "flux", bundled).lora_modules()) == 13
    assert [str(w.message) for w in said] == [f"{bundled}: left out 2 tensors beside the LoRA (OneTrainer's bundled "
                                              f"embeddings bundle_emb. x2): a LoRA network applies the down/up modules only"]


# ----------------------------------------------------------------------------------------------
# Another family's LoRA: one line saying what tools/lora_info.py says, before any model loads

QWEN_CFG = QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(8, 12, 12))


@pytest.fixture(scope="session")
def qwen_lora(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("reader_qwen") / "qwen_lora.safetensors")
    random_lora(QwenImage(QWEN_CFG), "qwen_image").save(path)
    return path


def qwen_on_flux(path: str) -> str:
    from tools import lora_info

    info = lora_info.read_info(path)
    assert (info["arch"], info["naming"]) == ("qwen_image", "diffusers")
    return f"{path}: a LoRA for Qwen-Image (tools/lora_info.py: arch qwen_image, diffusers names), not for this FLUX.1 model"


def test_generate_names_the_architecture_of_another_familys_lora(qwen_lora, tmp_path, capsys):
    """The old generate loaded the text encoders and the transformer, then said "LoRA module
    'lora_unet_transformer_blocks_0_attn_add_k_proj' matches no module ... convert_lora ... --to kohya",
    which no conversion fixes; now the header decides, before any model file is opened (these are missing)."""
    from tests.test_reliability import one_error_line
    from tools import generate

    missing = str(tmp_path / "missing.safetensors")
    code = generate.main(["--model_type", "flux", "--model", missing, "--ae", missing, "--clip_l", missing, "--t5xxl", missing,
                          "--prompt", "a cat", "--lora", f"{qwen_lora}:0.5", "--out", str(tmp_path / "out")])  # fmt: skip
    assert one_error_line(capsys, code) == f"error: {qwen_on_flux(qwen_lora)}"
    assert not (tmp_path / "out").exists()


def test_network_weights_and_base_loras_of_another_family_are_refused_before_caching(qwen_lora, flux):
    """library/training/lora_inputs.py, which both tasks call before the model loads (the diffusion task also
    before caching); the old runs cached the dataset and loaded the model first."""
    from types import SimpleNamespace

    from library.errors import ConfigError
    from library.training.lora_inputs import check_lora_inputs

    ours = flux["cases"]["kohya (ours)"][0]
    for key, arch, args in (("network_weights", "flux", dict(network_weights=qwen_lora, base_loras=[ours])),
                            ("base_loras", "flux", dict(network_weights=ours, base_loras=[f"{qwen_lora}:0.5"])),
                            ("network_weights", "llm", dict(network_weights=ours))):
        with pytest.raises(ConfigError) as error:
            check_lora_inputs(SimpleNamespace(config_file="run.toml", **args), arch)
        line = qwen_on_flux(qwen_lora) if arch == "flux" else (
            f"{ours}: a LoRA for FLUX.1 (tools/lora_info.py: arch flux, bfl names), not for this LLM model")
        assert str(error.value) == f"run.toml: key '{key}': {line}"


def flux1_on(path: str, title: str, names: str = "bfl") -> str:
    return f"{path}: a LoRA for FLUX.1 (tools/lora_info.py: arch flux, {names} names), not for this {title} model"


@pytest.mark.parametrize("layout, names", [("kohya (ours)", "bfl"), ("diffusers", "diffusers")])
def test_a_flux1_lora_is_refused_by_flux2_from_its_header(flux, layout, names):
    """FLUX.2 shares FLUX.1's block names, so the header check let a FLUX.1 LoRA through to a FLUX.2 run (which
    then failed after the model loaded). Its modulation Linears (img_mod.lin / norm1.linear: FLUX.2 has none)
    and its MLP widths (4 x hidden rows, FLUX.2's are 6 x) say FLUX.1's."""
    from networks.lora_reader import check_lora_arch

    path = flux["cases"][layout][0]
    with pytest.raises(CheckpointError) as error:
        check_lora_arch(path, "flux2")
    assert str(error.value) == flux1_on(path, "FLUX.2", names)
    check_lora_arch(path, "flux")


@pytest.mark.parametrize("layout, others", [("kohya (ours)", 10), ("diffusers", 17)])  # the file's modules: q / k / v split
def test_chroma_loads_a_flux1_lora_without_the_modulation_it_lacks(flux, layout, others, tmp_path):
    """Chroma is FLUX.1's blocks less the modulation Linears (its approximator makes them): ComfyUI loads a
    FLUX.1 LoRA on Chroma, skipping those keys. The old header check refused it ('a LoRA for FLUX.1 ... not for
    this Chroma model'); now the blocks load, with one warning saying how many modules were left out and why.
    A LoRA of those modules alone is still refused: nothing of it would load."""
    from library.models.chroma.model import Chroma, ChromaConfig
    from networks.lora_reader import check_lora_arch

    path, reference = flux["cases"][layout]
    check_lora_arch(path, "chroma")
    chroma = Chroma(ChromaConfig(in_channels=64, context_in_dim=32, hidden_size=64, num_heads=2, depth=1, depth_single=1,
                                 axes_dim=(4, 14, 14), approximator_hidden=32, approximator_layers=1))
    with pytest.warns(UserWarning) as said:
        net = LoRANetwork.from_weights(chroma, "chroma", path)
    kept = {"double_blocks.0.img_attn.qkv", "double_blocks.0.img_attn.proj", "double_blocks.0.img_mlp.0", "double_blocks.0.img_mlp.2",
            "double_blocks.0.txt_attn.qkv", "double_blocks.0.txt_attn.proj", "double_blocks.0.txt_mlp.0", "double_blocks.0.txt_mlp.2",
            "single_blocks.0.linear1", "single_blocks.0.linear2"}
    got = {m.name: m.weights().delta() for m in net.lora_modules()}
    assert set(got) == kept and all((got[p] - reference[p]).abs().max() <= TOL * reference[p].abs().max() for p in kept)
    lines = [str(w.message) for w in said]
    assert len(lines) == 1 and lines[0].startswith(f"{path}: a FLUX.1 LoRA: left out its 3 modules this Chroma model "
                                                   f"lacks (e.g. '") and lines[0].endswith(f"kept the other {others}")
    modulation = {k: v for k, v in load_file(path).items() if "mod" in k or "norm1" in k or "norm.linear" in k}
    save_file(modulation, str(tmp_path / "mod.safetensors"))
    with pytest.raises(CheckpointError, match=r"mod.safetensors: a LoRA for FLUX.1 \(tools/lora_info.py: arch flux, "
                       r"\w+ names\), not for this Chroma model: its 3 modules are all ones this model lacks"):
        check_lora_arch(str(tmp_path / "mod.safetensors"), "chroma")


def test_a_flux1_lora_of_shared_modules_is_refused_by_its_metadata_or_its_released_size(tmp_path):
    """Attention and MLP of FLUX.1's shapes: refused by FLUX.2 where the header says FLUX.1 (ss_base_model_version
    flux1-dev, what our trainer and sd-scripts write) or where the width and blocks are FLUX.1 dev's (19 double
    at 3072; no FLUX.2 has 19). Chroma takes them, header or not (its blocks are FLUX.1's, as ComfyUI loads them);
    the old check refused the one whose header said FLUX.1."""
    from networks.lora_reader import check_lora_arch

    attn = {f"double_blocks.{i}.img_attn.qkv": lf.LoRAWeights(torch.zeros(1, 3072), torch.zeros(9216, 1), 1.0) for i in range(19)}
    lf.write_kohya(attn, str(tmp_path / "bare.safetensors"))
    lf.write_kohya(attn, str(tmp_path / "said.safetensors"), metadata={"ss_base_model_version": "flux1-dev"})
    for name in ("bare", "said"):
        check_lora_arch(str(tmp_path / f"{name}.safetensors"), "chroma")
    for name in ("said", "bare"):
        with pytest.raises(CheckpointError) as error:
            check_lora_arch(str(tmp_path / f"{name}.safetensors"), "flux2")
        assert str(error.value) == flux1_on(str(tmp_path / f"{name}.safetensors"), "FLUX.2")
    small = {p: w for p, w in attn.items() if int(p.split(".")[1]) < 5}  # FLUX.2 [klein] 4B's 5 double blocks fit too
    lf.write_kohya(small, str(tmp_path / "small.safetensors"))
    check_lora_arch(str(tmp_path / "small.safetensors"), "flux2")


def test_attention_only_loras_of_another_released_size_are_refused_from_the_header(tmp_path):
    """Attention projections (transformer_blocks.N.attn.to_q / add_q_proj) are in FLUX.1, FLUX.2 and Qwen-Image
    alike, so the header check let FLUX.2 [dev]'s (width 6144) or Qwen-Image's (60 blocks) through to a FLUX.1
    run, which failed after the model loaded (shapes, blocks it lacks). Where no release of the target fits the width and
    blocks and another's does, that one is named (what lora_info reports); a size the target's release fits
    stays the modules' to decide."""
    from networks.lora_reader import check_lora_arch

    names = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out")
    for name, width, blocks in (("flux2_dev", 6144, 8), ("qwen", 3072, 60), ("flux1_dev", 3072, 19)):
        lf.write_peft({f"transformer_blocks.{i}.attn.{n}": lf.LoRAWeights(torch.zeros(1, width), torch.zeros(width, 1), 1.0)
                       for i in range(blocks) for n in names}, str(tmp_path / f"{name}.safetensors"))
    for name, arch, said in (("flux2_dev", "flux", "FLUX.2 (tools/lora_info.py: arch flux2), not for this FLUX.1"),
                             ("qwen", "flux", "Qwen-Image (tools/lora_info.py: arch qwen_image), not for this FLUX.1"),
                             ("flux1_dev", "flux2", "FLUX.1 (tools/lora_info.py: arch flux), not for this FLUX.2")):
        with pytest.raises(CheckpointError) as error:
            check_lora_arch(str(tmp_path / f"{name}.safetensors"), arch)
        assert str(error.value) == f"{tmp_path / name}.safetensors: a LoRA for {said} model"
    check_lora_arch(str(tmp_path / "flux1_dev.safetensors"), "qwen_image")  # Qwen-Image's first 19 blocks: its own size


def test_musubi_tuners_modelspec_names_flux1_and_flux2(tmp_path):
    """musubi-tuner writes modelspec.architecture 'Flux.1-dev/lora' (Kontext) and 'Flux.2-klein-4b/lora' /
    'Flux.2-dev/lora' and no ss_base_model_version. The old header checks knew 'flux1' / 'flux-1' and
    ss_base_model_version 'flux2' only, so an attention-only LoRA of 5 double blocks at 3072 (FLUX.1's and
    FLUX.2 [klein] 4B's alike) from musubi-tuner went to the other model's run unrefused."""
    from networks.lora_reader import check_lora_arch

    attn = {f"double_blocks.{i}.img_attn.qkv": lf.LoRAWeights(torch.zeros(1, 3072), torch.zeros(9216, 1), 1.0) for i in range(5)}
    for name, arch, said in (("Flux.1-dev/lora", "flux2", "FLUX.1 (tools/lora_info.py: arch flux, bfl names), not for this FLUX.2"),
                             ("Flux.2-klein-4b/lora", "flux", "FLUX.2 (tools/lora_info.py: arch flux2, bfl names), not for this FLUX.1")):
        path = str(tmp_path / "musubi.safetensors")
        lf.write_kohya(attn, path, metadata={"modelspec.architecture": name})
        with pytest.raises(CheckpointError) as error:
            check_lora_arch(path, arch)
        assert str(error.value) == f"{path}: a LoRA for {said} model"


def test_an_attention_only_lora_both_families_have_is_refused_by_its_header_or_read_with_a_warning(tmp_path):
    """transformer_blocks.N.attn.* at width 3072 in blocks 0-18 is FLUX.1's (19 double blocks) and Qwen-Image's
    (its first 19 of 60) alike: diffusers' FluxLoraLoaderMixin and QwenImageLoraLoaderMixin read the same keys,
    and the shapes are the same. The old reader took it silently in a Qwen-Image run whatever its header said.
    Now a header naming the other model (ss_base_model_version flux1-dev, what sd-scripts and our trainer write;
    musubi-tuner's modelspec.architecture Qwen-Image/lora) refuses it in one line, and a file with no header
    is read with one warning saying nothing tells which model it is for."""
    from networks.lora_arch import lora_files
    from networks.lora_reader import check_lora_arch, lora_for_model

    names = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out")
    attn = {f"transformer_blocks.{i}.attn.{n}": lf.LoRAWeights(torch.zeros(1, 3072), torch.zeros(3072, 1), 1.0)
            for i in range(19) for n in names}
    for name, header in (("bare", {}), ("flux1", {"ss_base_model_version": "flux1-dev"}),
                         ("qwen", {"modelspec.architecture": "Qwen-Image/lora"})):
        lf.write_peft(attn, str(tmp_path / f"{name}.safetensors"), metadata=header)
    for name, arch, said in (("flux1", "qwen_image", "FLUX.1 (tools/lora_info.py: arch flux), not for this Qwen-Image"),
                             ("qwen", "flux", "Qwen-Image (tools/lora_info.py: arch qwen_image), not for this FLUX.1")):
        with pytest.raises(CheckpointError) as error:
            check_lora_arch(str(tmp_path / f"{name}.safetensors"), arch)
        assert str(error.value) == f"{tmp_path / name}.safetensors: a LoRA for {said} model"
    for name, arch in (("flux1", "flux"), ("qwen", "qwen_image"), ("bare", "flux"), ("bare", "qwen_image")):
        check_lora_arch(str(tmp_path / f"{name}.safetensors"), arch)
    tensors = load_file(str(tmp_path / "bare.safetensors"))
    paths = S.load_symbol(lora_files()["qwen_image"].module_paths)({"transformer_blocks": 60})
    with pytest.warns(UserWarning) as said:
        read = lora_for_model(tensors, {}, None, "qwen_image", paths, name="bare.safetensors")
    assert len(read.weights) == 19 * 8 and [str(w.message) for w in said] == [
        "bare.safetensors: its modules (e.g. 'transformer.transformer_blocks.0.attn.add_k_proj') are Qwen-Image's and FLUX.1's "
        "alike, at width 3072 in 19 blocks, and its header names no model (ss_base_model_version): read as this Qwen-Image "
        "model's LoRA"]


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_every_consumer_names_the_architecture_of_another_familys_lora(flux, qwen_lora, consumer):
    """The old readers said "LoRA module 'lora_unet_transformer_blocks_0_attn_add_k_proj' matches no module
    ... convert_lora.py IN OUT --to kohya" (generate, network_weights, base_loras) or "no LoRA module matches
    ... convert_lora first" (merge_lora): no conversion fixes another model's LoRA."""
    with pytest.raises(CheckpointError) as error:
        CONSUMERS[consumer](flux["model"], "flux", qwen_lora, flux["root"])
    assert str(error.value) == qwen_on_flux(qwen_lora)


def test_a_lora_whose_names_tell_no_family_is_read_by_its_modules(flux, tmp_path):
    """Attention projections alone (`transformer_blocks.0.attn.to_q`: FLUX.1 and Qwen-Image both have them)
    tell no architecture: the reader does not refuse them, the model's modules decide."""
    path, reference = flux["cases"]["diffusers"]
    tensors = {k: v for k, v in load_file(path).items() if k.startswith(tuple(f"transformer.transformer_blocks.0.attn.to_{c}." for c in "qkv"))}
    save_file(tensors, str(tmp_path / "attn.safetensors"))
    got = generate_reads(flux["model"], "flux", str(tmp_path / "attn.safetensors"), flux["root"])
    assert list(got) == ["double_blocks.0.img_attn.qkv"]
    assert (got["double_blocks.0.img_attn.qkv"] - reference["double_blocks.0.img_attn.qkv"]).abs().max() <= TOL


def test_network_weights_rebuilds_a_fused_module_at_the_rank_of_its_split_parts(flux):
    """q / k / v with their own downs (rank 4 each) are exactly one fused qkv LoRA of rank 12: the network
    (rank 4) rebuilds those modules at 12 and says so; the old reader stopped with "has down (12, 64) ...
    the network expects (4, 64)"."""
    path, _ = flux["cases"]["diffusers q / k / v with their own downs"]
    net = LoRANetwork(flux["model"], "flux", rank=4, alpha=2)
    net.apply()
    counts = net.load_weights(path, strict=False)
    ranks = {m.name: m.rank for m in net.lora_modules()}
    assert ranks["double_blocks.0.img_attn.qkv"] == 12 and ranks["double_blocks.0.img_attn.proj"] == 4
    assert ranks["single_blocks.0.linear1"] == 16  # q, k, v and proj_mlp
    assert "3 rebuilt at the rank of their fused / split form" in LoRANetwork.describe_loaded(counts)
    modules = dict(flux["model"].named_modules())
    assert modules["double_blocks.0.img_attn.qkv"].forward.__self__ is next(m for m in net.lora_modules() if m.name == "double_blocks.0.img_attn.qkv")
    net.remove()


def header_of_run(task_facts: dict, **args) -> dict:
    """The LoRA header train_lora.py writes for a run with these settings and its task's facts."""
    from types import SimpleNamespace

    from train_lora import lora_metadata

    args = SimpleNamespace(**{"network_module": "networks.lora", "network_dim": 4, "network_alpha": 2.0, "network_args": [], "network_dropout": None, "config_file": None,
                              "pretrained_model_name_or_path": "base.safetensors", "mixed_precision": "bf16",
                              "optimizer_type": "AdamW", "optimizer_args": [], "learning_rate": 1e-4, "lr_scheduler": "constant",
                              "discrete_flow_shift": 3.0, "guidance_scale": 1.0, "seed": 0, "output_name": "x", **args})
    facts = {"base_model_version": "flux1", "base_precision": "bf16", "resolution": "64x64", "batch_size": 1,
             "timestep_sampling": "flux_shift", "dataset": [], **task_facts}
    return lora_metadata(args, SimpleNamespace(metadata=lambda: facts), 1, 1, 1, 0.0)


def test_the_header_after_network_weights_rebuilt_a_module_says_the_ranks_the_file_holds(flux):
    """network_weights rebuilt qkv / linear1 at ranks 12 / 16 beside rank-4 modules: the header said
    ss_network_dim 4 (the config's) and alpha 12 (one rebuilt module's); now "Dynamic" for both, as
    sd-scripts' resize_lora.py writes for per-module ranks."""
    from library.training.lora_inputs import loaded_dim_alpha

    path, _ = flux["cases"]["diffusers q / k / v with their own downs"]
    net = LoRANetwork(flux["model"], "flux", rank=4, alpha=2)
    net.load_weights(path, strict=False)
    args = {"network_dim": 4, "network_alpha": 2.0}
    header = header_of_run(loaded_dim_alpha(net, SimpleNamespace(**args)), **args)
    assert (header["ss_network_dim"], header["ss_network_alpha"]) == ("Dynamic", "Dynamic")
    ours = LoRANetwork(flux["model"], "flux", rank=4, alpha=8)
    ours.load_weights(flux["cases"]["kohya (ours)"][0], strict=False)  # the config's rank, the file's alpha (2) wins
    assert loaded_dim_alpha(ours, SimpleNamespace(network_dim=4, network_alpha=8.0)) == {"network_alpha": "2"}


def test_convert_lora_header_says_the_ranks_and_alphas_it_wrote(flux, tmp_path):
    """q / k / v with their own rank-4 downs join into one rank-12 qkv (--to kohya): the header kept the
    source's ss_network_dim 4; --alpha 1 kept ss_network_alpha 2. Now what the file holds."""
    tensors, metadata, _ = lf.read_lora_tensors(flux["cases"]["diffusers q / k / v with their own downs"][0])
    save_file(tensors, str(tmp_path / "split.safetensors"), {**metadata, "ss_network_dim": "4", "ss_network_alpha": "2"})
    convert_lora.convert_lora(str(tmp_path / "split.safetensors"), str(tmp_path / "k.safetensors"), "kohya")
    convert_lora.convert_lora(flux["cases"]["kohya (ours)"][0], str(tmp_path / "a.safetensors"), "kohya", alpha=1.0)
    meta = {name: load_file_metadata(str(tmp_path / f"{name}.safetensors")) for name in ("k", "a")}
    assert (meta["k"]["ss_network_dim"], meta["k"]["ss_network_alpha"]) == ("Dynamic", "Dynamic")
    assert (meta["a"]["ss_network_dim"], meta["a"]["ss_network_alpha"]) == ("4", "1")


def load_file_metadata(path: str) -> dict:
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        return f.metadata()


@pytest.mark.parametrize("sampling, written", [("shift", "3.0"), ("flux_shift", None), ("sigmoid", None), ("uniform", None)])
def test_the_header_names_discrete_flow_shift_only_where_the_timestep_draw_read_it(sampling, written):
    """flow_matching.sample_sigmas reads discrete_flow_shift for timestep_sampling = "shift" alone; the header
    said ss_discrete_flow_shift 3.0 for every run (a flux_shift run's own mu, not 3.0, shifted its draws)."""
    assert header_of_run({"timestep_sampling": sampling}).get("ss_discrete_flow_shift") == written


def test_precision_tools_refuse_a_dora_file_they_would_apply_as_plain_lora(flux, tmp_path):
    """read_lora_for dropped the DoRA magnitude and applied up @ down as a plain LoRA (silently another
    weight: m * (W + dW) / ||W + dW|| is not W + dW); the runtime and merged columns add plain deltas, so it is refused."""
    net = random_lora(flux["model"], "flux", dora=True)
    net.save(str(tmp_path / "dora.safetensors"))
    with pytest.raises(CheckpointError, match=r"dora.safetensors: LoRA module '.*' is DoRA; the precision tools apply "
                                              r"and merge plain LoRAs"):
        read_lora_for(flux["model"], "flux", str(tmp_path / "dora.safetensors"))


def test_merge_reads_a_diffusers_named_lora_into_a_single_file_in_the_models_own_names(tmp_path):
    """Krea 2's single file has the model's own names and no module map of its own (merge_lora's Base): a
    diffusers-named LoRA (convert_lora --to diffusers of ours) found no weight ("no LoRA module matches a weight
    of the krea2 checkpoint"); the reader sizes the architecture's map from the LoRA, as convert_lora does."""
    from library.models.krea2.checkpoint import save_krea2_single_file
    from library.models.krea2.tiny import random_krea2, tiny_config

    model = random_krea2(tiny_config()).eval()
    save_krea2_single_file(model, str(tmp_path / "base.safetensors"), tiny_config())
    net = random_lora(model, "krea2")
    net.save(str(tmp_path / "ours.safetensors"))
    convert_lora.convert_lora(str(tmp_path / "ours.safetensors"), str(tmp_path / "d.safetensors"), "diffusers")
    got = merge_reads("base.safetensors")(model, "krea2", str(tmp_path / "d.safetensors"), tmp_path)
    assert_same_deltas(got, dense(net.lora_weights()))


def test_a_lora_of_text_encoders_alone_is_refused_in_one_line(flux, tmp_path):
    """sd-scripts can train CLIP-L / T5 alone into a file: the old reader said "LoRA file holds no tensors"
    (it holds two) after generate had loaded the models. Now the header check (before any model) and the
    network's reader name what it holds."""
    from networks.lora_reader import check_lora_arch

    tensors = {k: v for k, v in load_file(flux["cases"]["kohya + text encoder (sd-scripts)"][0]).items()
               if k.startswith("lora_te1_")}  # fmt: skip
    save_file(tensors, str(tmp_path / "te.safetensors"))
    line = f"{tmp_path / 'te.safetensors'}: holds only 1 text-encoder modules (CLIP-L lora_te1_ x1); this LoRA adapts no module of the transformer"
    with pytest.raises(CheckpointError) as error:
        check_lora_arch(str(tmp_path / "te.safetensors"), "flux")
    assert str(error.value) == line
    with pytest.raises(CheckpointError) as error:
        network_from_file(flux["model"], "flux", str(tmp_path / "te.safetensors"))
    assert str(error.value) == line


@pytest.mark.parametrize("to", ["diffusers", "comfy"])
def test_a_dora_file_in_another_layout_loads_as_the_same_dora(flux, tmp_path, to):
    """DoRA's magnitude is per output row: split into to_q / to_k / to_v by convert_lora --to diffusers and
    joined back by the reader, magnitude and down are the same tensors (bitwise) and (alpha / r) up the same
    within 1e-6 (the diffusers and ComfyUI layouts fold alpha into up)."""
    net = random_lora(flux["model"], "flux", dora=True)
    net.save(str(tmp_path / "dora.safetensors"))
    convert_lora.convert_lora(str(tmp_path / "dora.safetensors"), str(tmp_path / f"{to}.safetensors"), to)
    path = str(tmp_path / f"{to}.safetensors")
    resumed = LoRANetwork(flux["model"], "flux", rank=4, alpha=2, network_args={"dora": True})  # network_weights
    resumed.load_weights(path, strict=False)
    for loaded in (network_from_file(flux["model"], "flux", path), resumed):  # generate, network_weights
        got = {m.name: m.weights() for m in loaded.lora_modules()}
        for module, want in net.lora_weights().items():
            w = got[module]
            assert torch.equal(w.magnitude, want.magnitude) and torch.equal(w.down, want.down), module
            assert (w.up.float() * w.scale - want.up.float() * want.scale).abs().max() <= 1e-6 * want.up.abs().max()


def test_network_weights_rebuilds_a_dora_qkv_joined_from_parts_with_their_own_downs(flux, tmp_path):
    """DoRA normalises per output row, so diffusers' to_q / to_k / to_v DoRA with their own downs is exactly
    one fused DoRA of the summed rank: the merged qkv weight is the row-concatenation of each part's."""
    net = random_lora(flux["model"], "flux", dora=True)
    net.save(str(tmp_path / "dora.safetensors"))
    convert_lora.convert_lora(str(tmp_path / "dora.safetensors"), str(tmp_path / "d.safetensors"), "diffusers")
    tensors, g = load_file(str(tmp_path / "d.safetensors")), torch.Generator().manual_seed(4)
    for c in "kv":  # to_q keeps the shared down, to_k and to_v get their own
        key = f"transformer.transformer_blocks.0.attn.to_{c}.lora_A.weight"
        tensors[key] = torch.randn(tensors[key].shape, generator=g)
    save_file(tensors, str(tmp_path / "own.safetensors"), metadata={lf.FOLDED_MARK: "true"})
    resumed = LoRANetwork(flux["model"], "flux", rank=4, alpha=2, network_args={"dora": True})
    assert resumed.load_weights(str(tmp_path / "own.safetensors"), strict=False)["resized"] >= 1
    qkv = next(m for m in resumed.lora_modules() if m.name == "double_blocks.0.img_attn.qkv")
    weight = dict(flux["model"].named_modules())["double_blocks.0.img_attn.qkv"].weight
    parts = lf.parse_lora({k: v for k, v in tensors.items() if ".transformer_blocks.0.attn.to_" in k and "add" not in k})[0]
    want = torch.cat([parts[f"transformer_blocks.0.attn.to_{c}"].merged(w) for c, w in zip("qkv", weight.chunk(3))])
    assert qkv.rank == 12 and (qkv.weights().merged(weight) - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_lora_on_comfyuis_fused_gate_up_applies_by_rows_in_every_runtime_consumer(tmp_path):
    """Qwen-Image-2.1's released file fuses the SwiGLU gate_up (gate rows first); ComfyUI / ai-toolkit LoRAs
    name it so. convert_lora read it; generate and network_weights said "not a Linear of this model"."""
    from library.models.qwen_image21.model import QwenImage21
    from library.models.qwen_image21.tiny import tiny_config as qwen21_config

    model = randomized(QwenImage21(qwen21_config()), 3)
    gate = dict(model.named_modules())["transformer_blocks.1.img_mlp.gate_layer"]
    g = torch.Generator().manual_seed(5)
    down, up = torch.randn(4, gate.in_features, generator=g), torch.randn(2 * gate.out_features, 4, generator=g)
    save_file({"diffusion_model.transformer_blocks.1.img_mlp.gate_up.lora_A.weight": down,
               "diffusion_model.transformer_blocks.1.img_mlp.gate_up.lora_B.weight": up}, str(tmp_path / "c.safetensors"))
    half = gate.out_features
    want = {"transformer_blocks.1.img_mlp.gate_layer": up[:half] @ down, "transformer_blocks.1.img_mlp.proj": up[half:] @ down}
    for consumer in ("generate", "network_weights", "base_loras", "precision_tools"):
        assert_same_deltas(CONSUMERS[consumer](model, "qwen_image21", str(tmp_path / "c.safetensors"), tmp_path), want)


def test_the_refusal_names_what_lora_info_reports_for_every_family(tiny_set, tmp_path):
    """For each family's tiny LoRA in each layout it writes, every other architecture that refuses it names
    the arch and naming tools/lora_info.py prints for the file (one word for one thing across the tools);
    the ones that take it are its own architecture or share its names."""
    from library.models.registry import arch_specs
    from library.models.spec import load_symbol
    from networks.lora_arch import lora_files
    from networks.lora_reader import check_lora_arch
    from tools import lora_info

    archs = [a for a, s in arch_specs().items() if s.tiny and s.tiny.transformer]
    refused = 0
    for arch in archs:
        spec = arch_specs()[arch]
        src = str(tmp_path / f"{arch}.safetensors")
        LoRANetwork(load_symbol(spec.transformer.load)(tiny_set[spec.tiny.transformer]), arch, rank=2).save(src)
        files = [src]
        for layout in set(lora_files()[arch].layouts) - {"kohya", "peft"}:
            files.append(str(tmp_path / f"{arch}_{layout}.safetensors"))
            convert_lora.convert_lora(src, files[-1], layout)
        for path in files:
            info = lora_info.read_info(path)
            for target in archs:
                try:
                    check_lora_arch(path, target)
                except CheckpointError as e:
                    refused += 1
                    assert f"(tools/lora_info.py: arch {info['arch']}, {info['naming']} names)" in str(e), (target, str(e))
                else:
                    assert target == arch or info["arch"] in (target, lora_files()[target].names_of), (path, target)
    assert refused > len(archs) ** 2  # most pairs are told apart by the names


def test_split_downs_on_our_fused_flux_give_diffusers_output(flux):
    """The oracle diffusers itself: its FluxTransformer2DModel (the same weights, split to_q / to_k / to_v)
    with the split-downs file loaded by load_lora_weights (its PEFT layers, alpha from the header) gives the
    output of our fused model with the file read by generate's reader (rank 12 qkv, 16 linear1). Most of its
    time alone is importing diffusers' pipelines (~15 s, once per session: test_merge_convert imports them too)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from library.models.flux1.model import make_img_ids, make_txt_ids

    path, _ = flux["cases"]["diffusers q / k / v with their own downs"]
    theirs = FluxTransformer2DModel.from_pretrained(str(flux["root"] / "diffusers")).eval()
    pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                        transformer=theirs)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    img, txt, y = torch.randn(1, 16, 64, generator=g), torch.randn(1, 8, 32, generator=g), torch.randn(1, 16, generator=g)
    sigma, img_ids = torch.tensor([0.4]), make_img_ids(1, 4, 4)

    def outputs():
        with torch.no_grad():
            mine = flux["model"](img, img_ids, txt, make_txt_ids(1, 8), sigma, y)
            reference = theirs(hidden_states=img, encoder_hidden_states=txt, pooled_projections=y, timestep=sigma,
                               img_ids=img_ids[0].float(), txt_ids=torch.zeros(8, 3), return_dict=False)[0]  # fmt: skip
        return mine, reference

    base, base_reference = outputs()
    assert (base - base_reference).abs().max() <= 1e-4
    net = network_from_file(flux["model"], "flux", path)
    net.apply()
    pipe.load_lora_weights(path)
    try:
        mine, reference = outputs()
    finally:
        net.remove()
    assert (mine - base).abs().max() > 0.1  # the LoRA shows
    assert (mine - reference).abs().max() <= 1e-4 * reference.abs().max()
