"""LoRAs in ComfyUI: every key of the file we write for it is one ComfyUI's LoRA key map takes, onto a
weight its model has, and the weights ComfyUI computes from it are ours merged (tests/comfyui_lora.py
restates ComfyUI's loader; the model keys are the single-file layouts, which are ComfyUI's model names).

Z-Image: ComfyUI's model fuses attention.qkv and keeps the original names; it takes our diffusers
names under `diffusion_model.` / `transformer.` and patches q / k / v into the qkv rows, but takes
`lora_unet_` names only in its own names, so our kohya file (musubi-tuner's names) needs --to comfy.
Chroma and FLUX.1: ComfyUI's models have the BFL names our kohya files already use."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.chroma.checkpoint import load_chroma, save_chroma_bfl
from library.models.flux1.checkpoint import load_flux, save_flux_bfl
from library.models.zimage.checkpoint import load_zimage, to_single_file_state_dict
from networks.lora_files import read_lora
from tests import comfyui_lora as comfy
from tests.test_merge_convert import lora
from tools import convert_lora


def merged(model: torch.nn.Module, weights) -> dict[str, torch.Tensor]:
    """Our model's state dict (float32) with each LoRA module's delta (alpha / r) * up @ down added."""
    sd = {k: v.float().clone() for k, v in model.state_dict().items()}
    for path, w in weights.items():
        sd[f"{path}.weight"] += w.delta()
    return sd


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def zimage(tiny_set, tmp_path_factory):
    """The tiny Z-Image, a kohya LoRA of ours on every target kind (main blocks, refiners, modulation;
    rank 4, alpha 2, random ups) and ComfyUI's model keys and LoRA key map for it."""
    root = tmp_path_factory.mktemp("comfy_zimage")
    model = load_zimage(tiny_set["zimage"]).float()
    net = lora(model, "zimage", rank=4, alpha=2.0, seed=4, refiner_dim=4, refiner_mod_dim=4, train_modulation="true")
    kohya = str(root / "kohya.safetensors")
    net.save(kohya)
    comfy_sd = to_single_file_state_dict(model.state_dict())
    cfg = model.config
    names = comfy.key_map(comfy_sd, comfy.z_image_diffusers_map(cfg.n_layers, cfg.dim, cfg.n_refiner_layers))
    return {"model": model, "weights": net.lora_weights(), "kohya": kohya, "root": root, "comfy_sd": comfy_sd,
            "names": names}


@pytest.mark.parametrize("to, prefix", [("comfy", "diffusion_model."), ("diffusers", "transformer.")])
def test_zimage_lora_for_comfyui_loads_every_key_as_our_merge(zimage, to, prefix):
    out = str(zimage["root"] / f"{to}.safetensors")
    assert convert_lora.main([zimage["kohya"], out, "--to", to]) == 0
    tensors = load_file(out)
    assert all(k.startswith(prefix) for k in tensors)
    patches, not_loaded = comfy.load_lora(tensors, zimage["names"])
    assert not not_loaded
    weights = zimage["weights"]
    kinds = {p.split(".")[0] for p in weights}
    assert kinds == {"layers", "noise_refiner", "context_refiner"} and any("adaLN" in p for p in weights)
    # 2 layers + 2 + 2 refiners: q, k, v patch rows of one qkv each; out, w1-3 whole; adaLN of layers and
    # noise refiners
    assert len(patches) == len(weights) and sum(not isinstance(t, str) for t in patches) == 3 * 6
    theirs = comfy.patched(zimage["comfy_sd"], patches)
    ours = to_single_file_state_dict(merged(zimage["model"], weights))
    error = max_diff(theirs, ours)
    print(f"Z-Image --to {to} in ComfyUI: {len(patches)} patches, max abs diff vs our merge {error:.3g}")
    assert error <= 1e-6  # float32: the same products, summed in another order where alpha is folded


def test_our_zimage_kohya_names_are_not_comfyuis(zimage):
    """Why --to comfy exists: ComfyUI takes lora_unet_ only in its own names, so the attention of our
    kohya file (musubi-tuner's diffusers names) is "lora key not loaded" there; the SwiGLU and adaLN
    keep their names and load."""
    tensors = load_file(zimage["kohya"])
    _, not_loaded = comfy.load_lora(tensors, zimage["names"])
    modules = {k.split(".")[0] for k in not_loaded}
    assert modules and all(m.split("_attention_")[1] in ("to_q", "to_k", "to_v", "to_out_0") for m in modules)


def test_zimage_lora_in_comfyuis_own_names_reads_as_ours(zimage):
    """A LoRA in ComfyUI's Z-Image names (kohya lora_unet_<comfy name>, q / k / v fused as musubi-tuner's
    convert_z_image_lora_to_comfy.py writes them: downs stacked, ups block-diagonal, alpha x 3) loads in
    ComfyUI whole, and convert_lora reads it back as our modules with the same deltas."""
    weights, tensors = zimage["weights"], {}
    for path, w in weights.items():
        if path.endswith((".to_k", ".to_v")):
            continue
        if path.endswith(".attention.to_q"):
            block = path[: -len(".attention.to_q")]
            parts = [weights[f"{block}.attention.to_{p}"] for p in "qkv"]
            name = f"lora_unet_{block.replace('.', '_')}_attention_qkv"
            down, up, alpha = torch.cat([p.down for p in parts]), torch.block_diag(*[p.up for p in parts]), 3 * w.alpha
        else:
            name = "lora_unet_" + path.replace(".", "_").replace("attention_to_out_0", "attention_out")
            down, up, alpha = w.down, w.up, w.alpha
        tensors.update({f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
                        f"{name}.alpha": torch.tensor(alpha)})
    native = str(zimage["root"] / "native.safetensors")
    save_file(tensors, native)
    patches, not_loaded = comfy.load_lora(tensors, zimage["names"])
    assert not not_loaded and any(t.endswith("attention.qkv.weight") for t in patches)

    back = str(zimage["root"] / "back.safetensors")
    assert convert_lora.main([native, back, "--to", "kohya"]) == 0
    read_back, _, _ = read_lora(back, module_paths=dict(zimage["model"].named_modules()))
    assert set(read_back) == set(weights)
    error = max((read_back[p].delta() - weights[p].delta()).abs().max().item() for p in weights)
    print(f"Z-Image ComfyUI-named LoRA read back: max abs delta diff {error:.3g}")
    assert error <= 1e-6


@pytest.mark.parametrize("family", ["chroma", "flux"])
def test_bfl_named_lora_kohya_and_comfy_load_every_key_as_our_merge(tiny_set, tmp_path, family):
    """ComfyUI's Chroma and FLUX.1 models have the BFL names our kohya files have: our kohya file and
    --to comfy load whole, as our merge (its Flux branch's diffusers names are not needed)."""
    load, save = {"chroma": (load_chroma, save_chroma_bfl), "flux": (load_flux, save_flux_bfl)}[family]
    model = load(tiny_set[f"{family}_bfl"]).float()
    net = lora(model, family, rank=4, alpha=2.0, seed=5)
    kohya, comfy_file = str(tmp_path / "kohya.safetensors"), str(tmp_path / "comfy.safetensors")
    net.save(kohya)
    save(model, str(tmp_path / "single.safetensors"), model.config)
    comfy_sd = load_file(str(tmp_path / "single.safetensors"))
    assert convert_lora.main([kohya, comfy_file, "--to", "comfy", "--model_type", family]) == 0
    ours = merged(model, net.lora_weights())
    for path in (kohya, comfy_file):
        patches, not_loaded = comfy.load_lora(load_file(path), comfy.key_map(comfy_sd))
        assert not not_loaded and len(patches) == len(net.lora_weights())
        assert max_diff(comfy.patched(comfy_sd, patches), ours) <= 1e-6


def test_anima_lora_kohya_and_comfy_load_every_key_as_our_merge(tiny_set, tmp_path):
    """ComfyUI's Anima model has the released single file's names less its `net.` prefix, ours: sd-scripts' kohya
    names and --to comfy load whole (the blocks, their adaLN-LoRA modulation and the LLM adapter), as our merge."""
    from library.models.anima.checkpoint import load_anima

    model = load_anima(tiny_set["anima"]).float()
    net = lora(model, "anima", rank=4, alpha=2.0, seed=5, adapter_dim=4, train_modulation="true")
    kohya, comfy_file = str(tmp_path / "kohya.safetensors"), str(tmp_path / "comfy.safetensors")
    net.save(kohya)
    assert convert_lora.main([kohya, comfy_file, "--to", "comfy"]) == 0
    comfy_sd = {k: v.float() for k, v in model.state_dict().items()}
    ours = merged(model, net.lora_weights())
    assert any(p.startswith("llm_adapter.") for p in net.lora_weights())
    for path in (kohya, comfy_file):
        patches, not_loaded = comfy.load_lora(load_file(path), comfy.key_map(comfy_sd))
        assert not not_loaded and len(patches) == len(net.lora_weights())
        assert max_diff(comfy.patched(comfy_sd, patches), ours) <= 1e-6


@pytest.mark.parametrize("strength", [1.0, 0.5])
def test_comfyui_applies_our_dora_as_ours_but_normalised_by_the_base_weight(tiny_set, tmp_path, strength):
    """ComfyUI's DoRA math on our kohya DoRA file reads our magnitude on the output axis, our alpha and
    delta: its weights are W + s (m (W + dW) / ||W|| - W), ours merged with the per-row norm taken of W
    instead of W + dW (ComfyUI's output-axis branch; docs/configuration.md). Measured on the quickstart
    DoRA: ||W + dW|| / ||W|| median 1.004 (0.954 to 1.212); concept rate 16/18 ours, 17/18 ComfyUI's."""
    model = load_flux(tiny_set["flux_bfl"]).float()
    net = lora(model, "flux", rank=4, alpha=2.0, seed=7, dora=True)
    with torch.no_grad():  # magnitudes away from ||W|| as training moves them, so a transposed or
        for m in net.lora_modules():  # mis-scaled dora_scale shows
            m.dora_scale.mul_(torch.linspace(0.5, 1.5, m.dora_scale.shape[0]).reshape(-1, 1))
    kohya = str(tmp_path / "kohya.safetensors")
    net.save(kohya)
    save_flux_bfl(model, str(tmp_path / "single.safetensors"), model.config)
    comfy_sd = load_file(str(tmp_path / "single.safetensors"))
    patches, not_loaded = comfy.load_lora(load_file(kohya), comfy.key_map(comfy_sd))
    assert not not_loaded and len(patches) == len(net.lora_weights())
    theirs = comfy.patched(comfy_sd, patches, strength)
    base = {k: v.float() for k, v in model.state_dict().items()}
    worst = 0.0
    for path, w in net.lora_weights().items():
        weight = base[f"{path}.weight"]
        ratio = (weight + w.delta()).norm(dim=1, keepdim=True) / weight.norm(dim=1, keepdim=True)
        ours_at_their_norm = weight + strength * (ratio * w.merged(weight) - weight)
        worst = max(worst, (theirs[f"{path}.weight"] - ours_at_their_norm).abs().max().item())
    assert worst <= 1e-5


def test_dora_for_comfyui_has_its_magnitude_as_dora_scale_per_output_row(tiny_set, tmp_path):
    """ComfyUI reads a DoRA magnitude only as `<name>.dora_scale` ([out, 1] on the output axis, as our kohya
    files write it); --to comfy wrote PEFT's lora_magnitude_vector, which ComfyUI leaves unloaded."""
    model = load_flux(tiny_set["flux_bfl"]).float()
    net = lora(model, "flux", rank=4, alpha=2.0, seed=6, dora=True)
    kohya, comfy_file, back = (str(tmp_path / f"{n}.safetensors") for n in ("kohya", "comfy", "back"))
    net.save(kohya)
    save_flux_bfl(model, str(tmp_path / "single.safetensors"), model.config)
    comfy_sd = load_file(str(tmp_path / "single.safetensors"))
    assert convert_lora.main([kohya, comfy_file, "--to", "comfy"]) == 0
    tensors = load_file(comfy_file)
    patches, not_loaded = comfy.load_lora(tensors, comfy.key_map(comfy_sd))
    assert not not_loaded and len(patches) == len(net.lora_weights())
    for target, (up, _, _, dora) in patches.items():
        assert dora is not None and tuple(dora.shape) == (up.shape[0], 1), target
    assert convert_lora.main([comfy_file, back, "--to", "kohya"]) == 0
    read_back, _, _ = read_lora(back, module_paths=dict(model.named_modules()))
    for path, w in net.lora_weights().items():
        assert torch.equal(read_back[path].magnitude, w.magnitude.reshape(-1)), path
        assert (read_back[path].delta() - w.delta()).abs().max().item() <= 1e-6, path



def test_resize_and_combine_write_a_comfy_file_back_in_comfyuis_layout(tiny_set, tmp_path):
    """resize_lora read --to comfy's lora_A / lora_B as PEFT's and wrote the DoRA magnitude as
    lora_magnitude_vector, which ComfyUI leaves unloaded: it rendered the resized DoRA as a plain LoRA."""
    from tools import combine_loras, resize_lora

    model = load_flux(tiny_set["flux_bfl"]).float()
    save_flux_bfl(model, str(tmp_path / "single.safetensors"), model.config)
    comfy_sd = load_file(str(tmp_path / "single.safetensors"))
    names = comfy.key_map(comfy_sd)
    for dora in (True, False):  # combine_loras refuses a DoRA (not additive)
        kohya, comfy_file, out = (str(tmp_path / f"{n}_{dora}.safetensors") for n in ("kohya", "comfy", "out"))
        lora(model, "flux", rank=4, alpha=2.0, seed=8, dora=dora).save(kohya)
        assert convert_lora.main([kohya, comfy_file, "--to", "comfy"]) == 0
        tool = resize_lora.main(["--lora", comfy_file, "--save_to", out, "--new_rank", "4"]) if dora else \
            combine_loras.main(["--lora", f"{comfy_file}:0.5", f"{comfy_file}:0.5", "--save_to", out])
        assert tool == 0
        written, wanted = load_file(out), load_file(comfy_file)
        assert set(written) == set(wanted), sorted(set(written) ^ set(wanted))
        (theirs, not_loaded), (want, _) = comfy.load_lora(written, names), comfy.load_lora(wanted, names)
        assert not not_loaded and max_diff(comfy.patched(comfy_sd, theirs), comfy.patched(comfy_sd, want)) <= 1e-5


def test_lumina2_lora_kohya_and_comfy_load_every_key_as_our_merge(tiny_set, tmp_path):
    """ComfyUI's Lumina 2 model (its NextDiT) has the released single file's names, ours: sd-scripts' kohya names and
    --to comfy load whole (the layers, the refiners, the modulation, the embedders, the final layer; the fused qkv
    whole, its grouped-query rows as they are), as our merge."""
    from library.models.lumina2.checkpoint import load_lumina2

    model = load_lumina2(tiny_set["lumina2"]).float()
    net = lora(model, "lumina2", rank=4, alpha=2.0, seed=5, refiner_dim=4, train_modulation="true",
               refiner_mod_dim=4, cap_embedder_dim=4, final_layer_dim=4)
    kohya, comfy_file = str(tmp_path / "kohya.safetensors"), str(tmp_path / "comfy.safetensors")
    net.save(kohya)
    assert convert_lora.main([kohya, comfy_file, "--to", "comfy"]) == 0
    comfy_sd = {k: v.float() for k, v in model.state_dict().items()}
    ours = merged(model, net.lora_weights())
    kinds = {"layers.0.attention.qkv", "context_refiner.0.feed_forward.w2", "final_layer.linear"}
    assert kinds <= set(net.lora_weights())
    for path in (kohya, comfy_file):
        patches, not_loaded = comfy.load_lora(load_file(path), comfy.key_map(comfy_sd))
        assert not not_loaded and len(patches) == len(net.lora_weights())
        assert max_diff(comfy.patched(comfy_sd, patches), ours) <= 1e-6
