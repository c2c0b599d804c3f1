"""FLUX.2 LoRAs in the files people load: our kohya file, its diffusers conversion and the
ai-toolkit / ComfyUI layout (`diffusion_model.<BFL path>.lora_A/B`) load in diffusers'
Flux2KleinPipeline with our runtime LoRA's output; each converts back and loads in our network."""

import pytest
import torch
from diffusers import Flux2Transformer2DModel
from diffusers.pipelines.flux2.pipeline_flux2_klein import Flux2KleinPipeline
from peft.tuners.lora import LoraLayer

from library.models.flux2.checkpoint import diffusers_config, flux2_diffusers_module_map, load_flux2
from library.models.flux2.model import Flux2Config, make_img_ids, make_txt_ids
from networks import lora_files as lf
from networks.lora_module_map import bfl_to_diffusers
from networks.lora import LoRANetwork
from tools import convert_lora

TOLERANCE = 1e-5  # max abs difference, float32
# Two double and two single blocks at a small width: diffusers' FLUX.2 kohya converter reads every
# width from the tensors (no hard-coded 3072, unlike its FLUX.1 one).
TINY = Flux2Config(in_channels=128, context_in_dim=96, hidden_size=64, num_heads=2, depth=2, depth_single=2,
                   axes_dim=(8, 8, 8, 8), guidance_embed=False)
H, W, T = 3, 4, 7


def randomize_(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g) if p.dim() == 1 else p.shape[1] ** -0.5 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(our Flux2 and diffusers' Flux2Transformer2DModel with the same weights, a folder)."""
    root = tmp_path_factory.mktemp("flux2_lora")
    reference = Flux2Transformer2DModel(**{k: v for k, v in diffusers_config(TINY).items() if not k.startswith("_")})
    randomize_(reference, seed=1)
    reference.save_pretrained(root / "transformer")
    return load_flux2(str(root)), Flux2Transformer2DModel.from_pretrained(root / "transformer").eval(), root


def outputs(ours, theirs):
    g = torch.Generator().manual_seed(2)
    img, txt, sigma = torch.randn(1, H * W, 128, generator=g), torch.randn(1, T, 96, generator=g), torch.tensor([0.4])
    with torch.no_grad():
        mine = ours(img, make_img_ids(1, H, W), txt, make_txt_ids(1, T), sigma)
        reference = theirs(hidden_states=img, encoder_hidden_states=txt, timestep=sigma, guidance=None,
                           img_ids=Flux2KleinPipeline._prepare_latent_ids(torch.zeros(1, 128, H, W)),
                           txt_ids=Flux2KleinPipeline._prepare_text_ids(txt), return_dict=False)[0]  # fmt: skip
    return mine, reference


def random_lora(model) -> LoRANetwork:
    """rank 4, alpha 2, up ~ N(0, 1): a delta as large as the weights, so any mistake shows."""
    torch.manual_seed(3)
    net = LoRANetwork(model, "flux2", rank=4, alpha=2)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 1.0)
    return net


@pytest.fixture(scope="module")
def files(pair) -> LoRANetwork:
    """A random LoRA on our model (not applied), saved as kohya, ai-toolkit and (converted) diffusers files."""
    ours, _, root = pair
    net = random_lora(ours)
    assert len(net.lora_modules()) == 2 * 8 + 2 * 2  # per double block: 2 x (qkv, proj, mlp.0, mlp.2); single: 2
    net.save(str(root / "kohya.safetensors"), metadata={"ss_base_model_version": "flux2-klein"})
    lf.write_peft(net.lora_weights(), str(root / "ai_toolkit.safetensors"), prefix="diffusion_model")
    assert convert_lora.main([str(root / "kohya.safetensors"), str(root / "diffusers.safetensors"), "--to", "diffusers"]) == 0
    return net


def test_flux2_lora_files_load_in_diffusers_with_our_output(pair, files):
    ours, theirs, root = pair
    base, base_reference = outputs(ours, theirs)
    assert (base - base_reference).abs().max() <= TOLERANCE

    net = files
    expected = len(bfl_to_diffusers(net.lora_weights(), flux2_diffusers_module_map(2, 2, 64, 192)))
    assert expected == 2 * 12 + 2 * 2  # qkv split into to_q/to_k/to_v (add_*_proj for text)
    net.apply()
    with_lora, _ = outputs(ours, theirs)
    net.remove()  # our model back to the base for the other tests
    assert (with_lora - base).abs().max() > 0.5  # the LoRA changes the output a lot

    pipe = Flux2KleinPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, transformer=theirs)
    diffs = {}
    for name in ("kohya", "diffusers", "ai_toolkit"):
        pipe.load_lora_weights(str(root / f"{name}.safetensors"))
        assert sum(isinstance(m, LoraLayer) for m in theirs.modules()) == expected, name
        diffs[name] = (with_lora - outputs(ours, theirs)[1]).abs().max().item()
        pipe.unload_lora_weights()
    print("FLUX.2 LoRA in diffusers, max abs diff:", {k: f"{v:.3g}" for k, v in diffs.items()})
    assert max(diffs.values()) <= TOLERANCE, diffs


@pytest.mark.parametrize("name", ["diffusers", "ai_toolkit"])
def test_flux2_converted_files_load_back_into_our_network(pair, files, name):
    """diffusers names (split qkv) are joined back; the ai-toolkit / ComfyUI file is read as it is."""
    ours, _, root = pair
    loaded = LoRANetwork(ours, "flux2", rank=4, alpha=2)
    assert loaded.load_weights(str(root / f"{name}.safetensors"))["loaded"] == 20
    a, b = files.lora_weights(), loaded.lora_weights()
    worst = max((a[p].delta() - b[p].delta()).abs().max().item() for p in a)
    assert worst <= 1e-5, worst


def test_flux2_is_told_from_flux1_by_names_metadata_and_mlp_widths(pair, files, tmp_path):
    ours, _, root = pair
    net = random_lora(ours)
    net.save(str(tmp_path / "plain.safetensors"))  # no metadata: the MLP widths decide
    for path in (tmp_path / "plain.safetensors", root / "diffusers.safetensors"):
        tensors, metadata, _ = lf.read_lora_tensors(str(path))
        assert convert_lora.detect_arch(tensors, metadata) == "flux2"
    done = convert_lora.convert_lora(str(root / "diffusers.safetensors"), str(tmp_path / "back.safetensors"), "kohya")
    assert done["model_type"] == "flux2" and done["modules"] == 20


def test_lora_info_names_flux2_in_both_namings(pair, files, tmp_path):
    from tools import lora_info

    _, _, root = pair
    files.save(str(tmp_path / "plain.safetensors"))  # no metadata: BFL names, the SwiGLU widths tell
    for name, naming in (("plain", "bfl"), ("diffusers", "diffusers")):
        folder = tmp_path if name == "plain" else root
        info = lora_info.read_info(str(folder / f"{name}.safetensors"))
        assert (info["arch"], info["naming"], info["width"]) == ("flux2", naming, 64), info
        assert info["blocks"] == {"double": 2, "single": 2} and "a FLUX.2 model of width 64" in info["fits"]
