"""Our LoKr files where people load them beyond ComfyUI: `convert_lora --to comfy` writes ai-toolkit's
`diffusion_model.<path>.lokr_w1 ...` names, which diffusers' FLUX.2 and Z-Image pipelines load with our
runtime LoKr's output; the converted file reads back in our network, generate's loader and merge_lora
with the kohya file's delta."""

import torch
from diffusers import ZImagePipeline
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from safetensors.torch import load_file

from library.models.zimage.checkpoint import to_single_file_state_dict
from networks.factory import network_from_file
from networks.lycoris_network import LycorisNetwork
from tests import comfyui_lora
from tests.test_flux2_lora import outputs, pair  # noqa: F401 (pair: a fixture)
from tests.test_merge_convert import merge
from tests.test_zimage import diffusers_velocity, inputs, loaded_pair, ours_velocity
from tools import convert_lora

TOLERANCE = 1e-5  # max abs difference, float32
LOKR = {"algo": "lokr", "factor": 4}  # rank 4 < the factors' width / 2: w2 is w2_a @ w2_b, so alpha / rank applies


def random_lokr(model, arch: str) -> LycorisNetwork:
    """Both Kronecker factors random (LyCORIS starts w2 at zero), alpha 2 at rank 4: a large delta."""
    torch.manual_seed(3)
    net = LycorisNetwork(model, arch, 4, 2.0, network_args=LOKR)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.normal_(0, 0.6 if "lokr_w1" in name else 0.3)
    return net


def saved_and_converted(net, root, version: str):
    """(kohya file, its --to comfy conversion)."""
    kohya, comfy = str(root / "lokr.safetensors"), str(root / "lokr_comfy.safetensors")
    net.save(kohya, metadata={"ss_base_model_version": version})
    assert convert_lora.main([kohya, comfy, "--to", "comfy"]) == 0
    source, converted = load_file(kohya), load_file(comfy)
    assert len(converted) == len(source) and all(k.startswith("diffusion_model.") for k in converted)
    return kohya, comfy, converted


def modules(tensors) -> set[str]:
    return {key.rpartition(".")[0] for key in tensors}  # LyCORIS parts are one name: lokr_w1, alpha ...


def runtime(net, forward):
    net.apply()
    try:
        return forward()
    finally:
        net.remove()


def read_back_diff(model, arch: str, kohya: str, comfy: str, with_lokr, forward) -> float:
    """Max abs diff, over both readers, of the converted file's output against the kohya file's through the
    same reader: from_weights (generate's network_from_file) and load_weights (network_weights, into a
    network as the one that saved it, whose output is `with_lokr`)."""
    rebuilt = [runtime(network_from_file(model, arch, path), forward) for path in (kohya, comfy)]
    fresh = LycorisNetwork(model, arch, 4, 2.0, network_args=LOKR)
    assert fresh.load_weights(comfy)["missing"] == 0
    return max((rebuilt[1] - rebuilt[0]).abs().max().item(), (runtime(fresh, forward) - with_lokr).abs().max().item())


def test_flux2_lokr_converted_to_comfy_loads_in_diffusers_with_our_output(pair, tmp_path):  # noqa: F811
    ours, theirs, _ = pair
    net = random_lokr(ours, "flux2")
    kohya, comfy, converted = saved_and_converted(net, tmp_path, "flux2-klein-4b")
    assert converted["diffusion_model.double_blocks.0.img_attn.qkv.alpha"] == 2.0  # BFL names, alpha kept
    assert "diffusion_model.single_blocks.1.linear2.lokr_w2_b" in converted
    assert modules(converted) <= set(comfyui_lora.key_map(ours.state_dict()))  # ComfyUI's model has the BFL names
    base, base_reference = outputs(ours, theirs)
    with_lokr = runtime(net, lambda: outputs(ours, theirs)[0])
    assert (base - base_reference).abs().max() <= TOLERANCE and (with_lokr - base).abs().max() > 0.5

    pipe = Flux2KleinPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=theirs)
    pipe.load_lora_weights(comfy)  # fuses diffusers' q / k / v for the BFL qkv factors
    diff = (outputs(ours, theirs)[1] - with_lokr).abs().max().item()
    pipe.unload_lora_weights()
    print(f"FLUX.2 LoKr (--to comfy) in diffusers, max abs diff {diff:.3g}; LoKr - base {(with_lokr - base).abs().max():.3g}")
    assert diff <= TOLERANCE

    assert read_back_diff(ours, "flux2", kohya, comfy, with_lokr, lambda: outputs(ours, theirs)[0]) == 0.0


def test_zimage_lokr_converted_to_comfy_loads_in_diffusers_and_merges_as_the_kohya_file(tmp_path):
    reference, model = loaded_pair()
    reference.save_pretrained(tmp_path / "transformer")
    net = random_lokr(model, "zimage")
    kohya, comfy, converted = saved_and_converted(net, tmp_path, "zimage-turbo")
    assert "diffusion_model.layers.0.attention.to_out.0.lokr_w1" in converted
    cfg = model.config  # ComfyUI's key map takes our names under diffusion_model. (q / k / v: rows of its qkv) ...
    names = comfyui_lora.key_map(to_single_file_state_dict(model.state_dict()),
                                 comfyui_lora.z_image_diffusers_map(cfg.n_layers, cfg.dim, cfg.n_refiner_layers))
    assert modules(converted) <= set(names)
    assert "lora_unet_layers_0_attention_to_q" in modules(load_file(kohya)) - set(names)  # ... not as lora_unet_
    x = inputs(3, 4, (6, 35))
    base = ours_velocity(model, *x)
    with_lokr = runtime(net, lambda: ours_velocity(model, *x))
    assert (base - diffusers_velocity(reference, *x)).abs().max() <= TOLERANCE and (with_lokr - base).abs().max() > 0.5

    pipe = ZImagePipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=reference)
    pipe.load_lora_weights(comfy)
    diff = (diffusers_velocity(reference, *x) - with_lokr).abs().max().item()
    pipe.unload_lora_weights()
    print(f"Z-Image LoKr (--to comfy) in diffusers, max abs diff {diff:.3g}; LoKr - base {(with_lokr - base).abs().max():.3g}")
    assert diff <= TOLERANCE

    assert read_back_diff(model, "zimage", kohya, comfy, with_lokr, lambda: ours_velocity(model, *x)) == 0.0
    for name, lora in (("kohya", kohya), ("comfy", comfy)):
        assert merge("--model", tmp_path / "transformer", "--lora", lora, "--save_to", tmp_path / name) == 0
    a, b = (load_file(str(tmp_path / n / "diffusion_pytorch_model.safetensors")) for n in ("kohya", "comfy"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_lycoris_converts_only_to_comfy_and_only_where_diffusers_loads_lokr(pair, tmp_path, capsys):  # noqa: F811
    ours, _, _ = pair
    net = random_lokr(ours, "flux2")
    kohya, comfy, _ = saved_and_converted(net, tmp_path, "flux2-klein-4b")
    for source, to in ((kohya, "diffusers"), (comfy, "kohya")):
        capsys.readouterr()
        assert convert_lora.main([source, str(tmp_path / "x.safetensors"), "--to", to]) == 2
        line = capsys.readouterr().err
        assert "has no kohya/diffusers LoRA form" in line and "--to comfy writes those for them" in line
    # FLUX.1 names alone (no FLUX.2 header): diffusers loads no FLUX.1 LoKr, so --to comfy is refused too
    assert convert_lora.main([kohya, str(tmp_path / "x.safetensors"), "--to", "comfy", "--model_type", "flux"]) == 2
    assert "loads LoKr only for Flux2 and Z-Image (not FLUX.1" in capsys.readouterr().err
    assert not (tmp_path / "x.safetensors").exists()
