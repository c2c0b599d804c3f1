"""tools/make_tiny_models.py: the tiny set is complete, small, deterministic, in the real on-disk
formats (our loaders and the diffusers/transformers reference loaders both read it) and its
dimensions fit together (VAE -> packed latents -> transformer <- text encoders)."""

import json
import os

import pytest
import torch

from library.models.flux1.model import make_img_ids, make_txt_ids
from library.models.flux1.checkpoint import load_flux
from library.io import CheckpointReader
from library.models.llm import load_llm
from library.models.qwen_image.model import load_qwen_image
from library.models.flux1.text_encoder import encode_flux_prompts
from library.models.flux1.vae import load_flux_vae
from library.models.qwen_image.text_encoder import load_qwen_image_text_encoder
from library.models.qwen_image.vae import load_qwen_image_vae
from library.models.text_encoders import load_clip_l, load_t5
from library.models.latents import pack_latents, unpack_latents
from library.models.flux1.tiny import write_flux_vae
from tools import make_tiny_models as tiny

PROMPTS = ["a cat", "a painting of a house by the sea"]


@pytest.fixture(scope="session")
def tiny_set(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("tiny"))
    return out, tiny.make_tiny_models(out, seed=0)


def _images(batch=2, size=32):
    return torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(2)) * 2 - 1


def test_tool_writes_every_component_small_with_manifest(tiny_set):
    out, paths = tiny_set
    expected = {
        "flux_bfl": "flux/flux1-tiny.safetensors", "flux_diffusers": "flux/diffusers/transformer", "flux_vae": "flux/ae",
        "flux_vae_single": "flux/ae.safetensors", "clip_l": "flux/clip_l", "t5xxl": "flux/t5xxl",
        "qwen_image": "qwen_image/transformer", "qwen_image_vae": "qwen_image/vae",
        "qwen_image_text_encoder": "qwen_image/text_encoder", "qwen_image_tokenizer": "qwen_image/tokenizer", "llm": "llm",
        "flux2_text_encoder": "flux2/text_encoder", "flux2_tokenizer": "flux2/tokenizer",
        "flux2_tiny": "flux2/flux2-tiny.safetensors", "flux2_diffusers": "flux2/transformer",
        "flux2_dev_tiny": "flux2/flux2-dev-tiny.safetensors", "flux2_vae": "flux2/vae",
        "qwen_image_edit": "qwen_image_edit/transformer", "qwen_image_edit_2511": "qwen_image_edit_2511/transformer",
        "qwen_image_layered": "qwen_image_layered/transformer", "qwen_image_layered_vae": "qwen_image_layered/vae",
        "qwen_image_edit_text_encoder": "qwen_image_edit/text_encoder", "qwen_image_edit_processor": "qwen_image_edit/processor",
        "flux2_dev_text_encoder": "flux2/dev/text_encoder", "flux2_dev_tokenizer": "flux2/dev/tokenizer",
        "zimage": "zimage/zimage-tiny.safetensors", "zimage_diffusers": "zimage/transformer",
        "zimage_text_encoder": "zimage/text_encoder", "zimage_tokenizer": "zimage/tokenizer",
        "chroma_bfl": "chroma/chroma-tiny.safetensors", "chroma_diffusers": "chroma/diffusers/transformer",
        "chroma_t5xxl": "chroma/t5xxl", "zimage_omni": "zimage_omni",
        "krea2": "krea2/krea2-tiny.safetensors", "krea2_diffusers": "krea2/transformer",
        "krea2_text_encoder": "krea2/text_encoder", "krea2_tokenizer": "krea2/tokenizer",
        "ideogram4": "ideogram4/transformer", "ideogram4_unconditional": "ideogram4/unconditional_transformer",
        "ideogram4_text_encoder": "ideogram4/text_encoder", "ideogram4_tokenizer": "ideogram4/tokenizer",
        "qwen_image21": "qwen_image21/transformer", "qwen_image21_comfy": "qwen_image21/qwen_image21-tiny.safetensors",
        "qwen_image21_vae": "qwen_image21/vae", "qwen_image21_text_encoder": "qwen_image21/text_encoder",
        "qwen_image21_processor": "qwen_image21/processor",
    }
    with open(os.path.join(out, "manifest.json")) as f:
        manifest = json.load(f)
    # a family added later writes its own folder (docs/adding_a_family.md): its files are its tests'
    folders = {path.split("/")[0] for path in expected.values()}
    known = {k: v for k, v in manifest["paths"].items() if v.split("/")[0] in folders}
    assert known == expected and manifest["seed"] == 0
    assert all(os.path.exists(p) for p in paths.values())
    total = sum(manifest["bytes"][k] for k in known)
    # a few MB (about 14 with FLUX.2, 17.6 with Qwen-Image-Edit, 19.4 with [dev]'s Mistral3, 25.4 with Z-Image: its
    # timestep MLP is 1024 wide at any model width, 2.8 MB per transformer copy, written in two layouts; 28.1 with Chroma;
    # 31.7 with the Z-Image Omni repo: its transformer, SigLIP and Qwen3; 33.7 with Krea 2; 35.2 with Ideogram 4: nvfp4 + fp8r transformers, Qwen3-VL;
    # 37.2 with Qwen-Image-2.1: its transformer in two layouts, the RGBA VAE, Qwen3-VL with its vision tower;
    # 39.6 with Qwen-Image-Layered: its transformer and RGBA VAE)
    assert 1_000_000 < total < 41_000_000, total
    # Real layouts: BFL keys in the single file, diffusers keys in the folder.
    assert "double_blocks.0.img_attn.qkv.weight" in CheckpointReader(paths["flux_bfl"])
    assert "transformer_blocks.0.attn.to_q.weight" in CheckpointReader(paths["flux_diffusers"])
    assert "encoder.down.0.block.0.conv1.weight" in CheckpointReader(paths["flux_vae_single"])
    assert "text_model.encoder.layers.0.self_attn.q_proj.weight" in CheckpointReader(paths["clip_l"])
    assert "model.layers.0.self_attn.q_proj.bias" in CheckpointReader(paths["llm"])
    assert "model.layers.27.self_attn.k_norm.weight" in CheckpointReader(paths["flux2_text_encoder"])
    assert "single_stream_modulation.lin.weight" in CheckpointReader(paths["flux2_tiny"])
    assert "single_stream_modulation.linear.weight" in CheckpointReader(paths["flux2_diffusers"])
    assert "guidance_in.in_layer.weight" in CheckpointReader(paths["flux2_dev_tiny"])
    assert "language_model.model.layers.30.self_attn.q_proj.weight" in CheckpointReader(paths["flux2_dev_text_encoder"])
    assert "distilled_guidance_layer.in_proj.weight" in CheckpointReader(paths["chroma_bfl"])
    assert "bn.running_var" in CheckpointReader(paths["flux2_vae"])  # AutoencoderKLFlux2's BatchNorm statistics


def test_tool_is_deterministic_from_seed(tmp_path):
    a = write_flux_vae(str(tmp_path / "a"), 0)["flux_vae"]
    b = write_flux_vae(str(tmp_path / "b"), 0)["flux_vae"]
    c = write_flux_vae(str(tmp_path / "c"), 1)["flux_vae"]
    ra, rb, rc = CheckpointReader(a), CheckpointReader(b), CheckpointReader(c)
    key = "encoder.conv_in.weight"
    assert all(torch.equal(ra.get(k), rb.get(k)) for k in ra.keys())
    assert not torch.equal(ra.get(key), rc.get(key))


def test_tokenizers_load_offline_with_real_special_tokens(tiny_set):
    from transformers import AutoTokenizer

    _, paths = tiny_set
    clip = AutoTokenizer.from_pretrained(paths["clip_l"], local_files_only=True)
    ids = clip("a cat").input_ids
    assert ids[0] == clip.bos_token_id and ids[-1] == clip.eos_token_id == len(clip) - 1  # EOT is the top id
    t5 = AutoTokenizer.from_pretrained(paths["t5xxl"], local_files_only=True)
    assert t5.pad_token_id == 0 and t5("a cat").input_ids[-1] == t5.eos_token_id == 1
    qwen = AutoTokenizer.from_pretrained(paths["qwen_image_tokenizer"], local_files_only=True)
    chat = qwen("<|im_start|>user\nhi<|im_end|>").input_ids
    assert chat[0] == qwen.convert_tokens_to_ids("<|im_start|>") and chat[-1] == qwen.convert_tokens_to_ids("<|im_end|>")


def test_flux_bfl_file_and_diffusers_folder_give_identical_outputs(tiny_set):
    from diffusers import FluxTransformer2DModel

    _, paths = tiny_set
    bfl, folder = load_flux(paths["flux_bfl"]), load_flux(paths["flux_diffusers"])
    g = torch.Generator().manual_seed(0)
    img, txt, y = torch.randn(2, 4, 64, generator=g), torch.randn(2, 5, 32, generator=g), torch.randn(2, 32, generator=g)
    args = (img, make_img_ids(2, 2, 2), txt, make_txt_ids(2, 5), torch.tensor([0.3, 0.9]), y)
    with torch.no_grad():
        a, b = bfl(*args, guidance=torch.tensor([1.0, 3.5])), folder(*args, guidance=torch.tensor([1.0, 3.5]))
    assert a.shape == (2, 4, 64)
    assert (a - b).abs().max().item() == 0.0
    # The reference client reads the folder with no missing or unexpected keys.
    _, info = FluxTransformer2DModel.from_pretrained(paths["flux_diffusers"], output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_flux_set_dims_fit_from_image_and_prompt_to_prediction(tiny_set):
    _, paths = tiny_set
    vae, model = load_flux_vae(paths["flux_vae"]), load_flux(paths["flux_bfl"])
    clip, t5 = load_clip_l(paths["clip_l"]), load_t5(paths["t5xxl"])
    latents = vae.encode(_images())  # [2, 16, 4, 4] float32
    txt, pooled = encode_flux_prompts(PROMPTS, clip, t5, max_length=256)
    with torch.no_grad():
        pred = model(pack_latents(latents), make_img_ids(2, 2, 2), txt, make_txt_ids(2, 256), torch.tensor([0.5, 0.5]),
                     pooled, guidance=torch.ones(2))
    images = vae.decode(unpack_latents(pred, 4, 4))
    assert pred.shape == (2, 4, 64) and images.shape == (2, 3, 32, 32)
    assert torch.isfinite(images).all() and images.abs().max().item() <= 1.0


def test_qwen_image_set_dims_fit_and_diffusers_reads_it(tiny_set):
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    _, paths = tiny_set
    vae, model = load_qwen_image_vae(paths["qwen_image_vae"]), load_qwen_image(paths["qwen_image"])
    encoder = load_qwen_image_text_encoder(paths["qwen_image_text_encoder"])  # finds ../tokenizer
    latents = vae.encode(_images(size=16))  # [2, 16, 2, 2]
    txt, mask = encoder.encode(PROMPTS)
    with torch.no_grad():
        pred = model(pack_latents(latents), txt, mask, torch.tensor([0.5, 0.5]), [(1, 1, 1)] * 2)
    assert pred.shape == (2, 1, 64) and txt.shape[-1] == 32 and torch.isfinite(pred).all()
    for cls, path in ((QwenImageTransformer2DModel, paths["qwen_image"]), (AutoencoderKLQwenImage, paths["qwen_image_vae"])):
        _, info = cls.from_pretrained(path, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"], cls.__name__


def test_llm_folder_loads_and_matches_transformers(tiny_set):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, paths = tiny_set
    ours = load_llm(paths["llm"])
    ref = AutoModelForCausalLM.from_pretrained(paths["llm"]).eval()
    ids = AutoTokenizer.from_pretrained(paths["llm"])(PROMPTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        a = ours(ids.input_ids, ids.attention_mask)
        b = ref(input_ids=ids.input_ids, attention_mask=ids.attention_mask).logits
    valid = ids.attention_mask.bool()  # right padding: compare real tokens
    assert a.shape == b.shape and a.shape[-1] % 16 == 0
    assert (a[valid] - b[valid]).abs().max().item() <= 1e-5


def test_qwen_image_edit_set_fits_from_images_and_prompt_to_prediction(tiny_set):
    """Edit-2511 (zero_cond_t) and the edit text encoder: condition latents appended to the target's,
    img_shapes listing both; diffusers reads both transformers with their flags."""
    from diffusers import QwenImageTransformer2DModel
    from PIL import Image

    from library.models.qwen_image.edit import EDIT_2511
    from library.models.qwen_image.edit_encoder import load_qwen_image_edit_text_encoder

    _, paths = tiny_set
    encoder = load_qwen_image_edit_text_encoder(paths["qwen_image_edit_text_encoder"], EDIT_2511)  # finds ../processor
    condition = Image.fromarray((_images(1, 56)[0].permute(1, 2, 0).numpy() * 127.5 + 127.5).astype("uint8"))
    txt, mask = encoder.encode(["make it red"], [[condition]])
    vae, model = load_qwen_image_vae(paths["qwen_image_vae"]), load_qwen_image(paths["qwen_image_edit_2511"])
    assert model.config.zero_cond_t
    target, cond = pack_latents(torch.randn(1, 16, 2, 2)), pack_latents(vae.encode(_images(1, 16)))
    with torch.no_grad():
        pred = model(torch.cat([target, cond], 1), txt, mask, torch.tensor([0.5]), [[(1, 1, 1), (1, 1, 1)]])
    assert pred.shape == (1, 2, 64) and txt.shape[-1] == 32 and torch.isfinite(pred).all()
    for name, flag in (("qwen_image_edit", False), ("qwen_image_edit_2511", True)):
        ref, info = QwenImageTransformer2DModel.from_pretrained(paths[name], output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and ref.config.zero_cond_t is flag
