"""Each family's learned-base writers (spec.LearnedBase, its folder's learned.py) write files its own
loaders read back as trained: the VAE's latent normalisation as the pretrainer set it, the transformer's
weights (bf16, as released), the quickstart config pointing at the shipped files."""

import os

import pytest
import torch

from library.models.registry import spec_of
from library.models.spec import load_symbol
from library.training.config import load_config
from tools.learned_base import IMAGE_SIZE, encode_prompts, learned_families, learned_family, learned_paths, learned_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_learned_base_functions_default_to_its_modules_and_load():
    """A learned.py names its module once (module=__name__): family / write_text_encoders / new_transformer /
    save_transformer left out are that module's functions of those names; the VAE's come from a recipe. Every
    one of the six loads as a function."""
    for model_type in learned_families():
        learned = learned_spec(model_type)
        assert learned.module == spec_of(model_type).learned.partition(":")[0], model_type
        for name in ("family", "write_text_encoders", "new_vae", "save_vae", "new_transformer", "save_transformer"):
            assert callable(load_symbol(getattr(learned, name))), (model_type, name)
        assert learned.new_transformer == f"{learned.module}:new_transformer", model_type


@pytest.mark.parametrize("model_type", learned_families())
def test_saved_vae_normalises_latents_as_the_pretrainer_set_them(model_type, tmp_path):
    """The pretrainer sets latents = (z - shift) * scale (z: the posterior's mode); every family's
    saved VAE, loaded by the family, encodes to exactly that (Qwen-Image: as latents_mean / latents_std; a format
    without a shift, LearnedBase.latent_shift False, gets shift 0 from the pretrainer)."""
    learned, paths = learned_spec(model_type), learned_paths(model_type, str(tmp_path))
    torch.manual_seed(0)
    vae = load_symbol(learned.new_vae)(IMAGE_SIZE).eval()
    shift = 0.25 if learned.latent_shift else 0.0
    vae.register_to_config(shift_factor=shift, scaling_factor=2.5)
    load_symbol(learned.save_vae)(vae, paths, False)
    images = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE) * 2 - 1
    with torch.no_grad():
        expected = (vae.encode(images).latent_dist.mode() - shift) * 2.5
    latents = learned_family(model_type, str(tmp_path)).load_vae(torch.float32).encode(images)
    torch.testing.assert_close(latents, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_type", learned_families())
def test_saved_transformer_loads_with_its_trained_weights(model_type, tmp_path):
    learned, paths = learned_spec(model_type), learned_paths(model_type, str(tmp_path))
    family = learned_family(model_type, str(tmp_path))
    shipped = learned_family(model_type)  # new_transformer sizes the model from the text widths
    text = shipped.text_on_meta(shipped.load_transformer(torch.float32, read_weights=False), 1, 4)
    torch.manual_seed(0)
    model = load_symbol(learned.new_transformer)(text)
    load_symbol(learned.save_transformer)(model, paths, False)
    loaded = family.load_transformer(torch.float32).state_dict()
    for name, weight in model.state_dict().items():
        assert torch.equal(loaded[name], weight.to(torch.bfloat16).float()), name


@pytest.mark.parametrize("model_type", learned_families())
def test_quickstart_config_trains_the_shipped_base(model_type):
    args = load_config(["--config_file", os.path.join(ROOT, "configs", learned_spec(model_type).config)])
    assert args.model_type == model_type
    for key, path in learned_paths(model_type).items():
        assert os.path.normpath(os.path.join(ROOT, getattr(args, key))) == os.path.normpath(path), key
        assert os.path.exists(path), f"{path}: the learned base is shipped (tools/pretrain_tiny_base.py writes it)"


def test_pretrainer_asks_an_rgba_vae_for_opaque_alpha():
    """The scenes are RGB; an RGBA VAE (Qwen-Image-2.1's) decodes four planes, its alpha asked for +1 (opaque, as
    its pipeline feeds a picture and a diffusers user's comes back); the shape weights read the RGB planes only."""
    from tools.pretrain_tiny_base import shape_weighted_mse

    target = torch.full((1, 3, 4, 4), -1.0)  # a black background
    target[:, 0, :2] = 1.0  # a red shape's pixels
    alpha = torch.ones(1, 1, 4, 4)
    assert shape_weighted_mse(torch.cat((target, alpha), 1), target).item() == 0.0
    # alpha off by 2 everywhere: 4 in one of the four planes, under weights of mean 2.5 divided by their mean
    assert shape_weighted_mse(torch.cat((target, -alpha), 1), target).item() == pytest.approx(1.0)


def test_pretrainer_latent_factors_give_unit_latents_in_the_family_format():
    """train_vae's factors: (z - mean) / std where the format holds a shift; a scale-only format (latent_shift
    False: HunyuanImage-2.1's z * scaling_factor) gets shift 0 and a mean square of 1, not the std's scale applied to
    latents that keep z's mean."""
    from tools import pretrain_tiny_base as pretrainer

    pixels = torch.rand(4, 3, IMAGE_SIZE, IMAGE_SIZE) * 2 - 1
    for model_type in ("flux", "hunyuan_image"):
        learned = learned_spec(model_type)
        vae = pretrainer.train_vae(learned, pixels, 0, 2, 0)  # no step: the factors of the initial VAE
        with torch.no_grad():
            z = vae.encode(pixels).latent_dist.mode()
        shift, scale = vae.config.shift_factor, vae.config.scaling_factor
        latents = (z - shift) * scale
        assert learned.latent_shift == (model_type == "flux")
        if learned.latent_shift:
            assert abs(shift - z.mean().item()) < 1e-4 and abs(latents.std().item() - 1) < 1e-3
        else:
            assert shift == 0.0 and abs(latents.pow(2).mean().sqrt().item() - 1) < 1e-3


def test_pretrainer_compiles_the_transformer_blocks_and_the_vae_where_its_family_asks(monkeypatch, capsys):
    """tools/pretrain_tiny_base.py: the transformer's blocks under torch.compile, the VAE's loss only
    where the family's LearnedBase.compile_vae says (the compile repays itself there); --eager, or no C++
    compiler (one line said), trains eager. torch.compile is recorded here, not run (CI has no time
    for inductor)."""
    from tools import pretrain_tiny_base as pretrainer

    compiled = []  # what the pretrainer compiled: its VAE loss, blocks' forwards (libraries compile their own on import)
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: compiled.append(fn) or fn)
    ours = lambda: [f for f in compiled if f is pretrainer.vae_loss or isinstance(getattr(f, "__self__", None), torch.nn.Module)]  # noqa: E731
    model_type = next(t for t in learned_families() if learned_spec(t).compile_vae)
    learned, family = learned_spec(model_type), learned_family(model_type)
    pixels = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE) * 2 - 1
    pretrainer.train_vae(learned, pixels, 1, 2, 0, compile=True)
    assert ours() == [pretrainer.vae_loss]
    compiled.clear()
    for other in (t for t in learned_families() if not learned_spec(t).compile_vae):
        pretrainer.train_vae(learned_spec(other), pixels, 1, 2, 0, compile=True)
    assert ours() == []
    text = encode_prompts(family, ["a red circle", "a blue square"])
    latents = family.load_vae(torch.float32).encode(pixels)
    compiled.clear()
    model = pretrainer.train_transformer(family, learned, latents, text, torch.arange(2), 1, 2, 0, compile=True)
    assert [f.__self__ for f in ours()] == list(model.swappable_blocks())
    compiled.clear()
    pretrainer.train_transformer(family, learned, latents, text, torch.arange(2), 1, 2, 0, compile=False)
    assert ours() == []

    assert not pretrainer.use_compile(eager=True)
    monkeypatch.setattr(pretrainer, "cpp_compiler", lambda: None)
    assert not pretrainer.use_compile(eager=False)
    assert "no C++ compiler for torch.compile" in capsys.readouterr().out
    monkeypatch.setattr(pretrainer, "cpp_compiler", lambda: "g++")
    assert pretrainer.use_compile(eager=False)


def test_pretrainer_draws_sigmas_as_the_learned_base_says(monkeypatch):
    """LearnedBase.dit_sampling / dit_shift name the transformer's sigma draw (Nucleus-Image: "shift" by 3; its
    default unshifted draw left a base at 44 of 216 prompts right, the shifted one 189); "" = the family's draw. A
    resolution-dependent draw reads the scenes' tokens as training_loss counts them: 16, patch 1 (HunyuanImage-2.1,
    4 x 4 latents) as patch 2 (8 x 8), where the pretrainer counted 2 x 2 patches for every family."""
    from library.models import flow_matching as fm
    from library.models.flow_matching import sampling_of
    from tools import pretrain_tiny_base as pretrainer

    draws, real = [], fm.sample_sigmas
    monkeypatch.setattr(fm, "sample_sigmas", lambda batch, method, **kw: draws.append(
        (method, kw.get("shift"), kw.get("image_seq_len"))) or real(batch, method, **kw))
    pixels = torch.rand(2, 3, IMAGE_SIZE, IMAGE_SIZE) * 2 - 1
    for model_type in ("nucleus_image", "flux", "hunyuan_image"):
        learned, family = learned_spec(model_type), learned_family(model_type)
        latents = family.load_vae(torch.float32).encode(pixels)
        text = encode_prompts(family, ["a red circle", "a blue square"])
        pretrainer.train_transformer(family, learned, latents, text, torch.arange(2), 1, 2, 0)
    assert draws == [("shift", 3.0, 16), (sampling_of("flux").method, 3.0, 16),
                     (sampling_of(family.arch).method, 3.0, 16)]
    assert learned_spec("flux").dit_sampling == ""


def test_concept_demo_on_a_family_without_a_learned_base_is_one_line(tiny_set, tmp_path, capsys):
    """encode_prompts read the learned base's encoder settings from arch_spec(family.arch).learned, "" for
    Z-Image then (HiDream-O1 now): "error: Empty module name". Now learned_spec's line, naming the families
    that have one."""
    import json

    from tools import concept_demo
    from tools.make_tiny_models import tiny_config

    config = tmp_path / "hidream_o1.toml"
    config.write_text(tiny_config("hidream_o1", tiny_set, output_dir=str(tmp_path / "out")))
    concept = tmp_path / "concept.json"
    concept.write_text(json.dumps({"trigger": "zxq", "colour": "purple", "shape": "star", "unrelated_prompts": [],
                                   "trigger_prompts": ["a small zxq on the left, white background"]}))
    assert concept_demo.main(["--config_file", str(config), "--concept", str(concept),
                              "--lora", str(tmp_path / "lora.safetensors")]) == 2
    assert capsys.readouterr().err.strip() == ("error: model_type 'hidream_o1' has no learned tiny base: expected "
                                               f"one of {', '.join(learned_families())}")


def test_the_edit_text_encoder_built_on_the_learned_base_reads_text_as_the_base_does(tmp_path):
    """write_edit_text_encoder (Qwen-Image-Edit on the learned Qwen-Image base): the base's language model as a
    Qwen2.5-VL folder the edit loader reads with its vision tower; the base tokenizer's ids unchanged, the vision
    tokens on rows the embedding has, and on text (M-RoPE's three axes equal) the base encoder's states bit for bit."""
    from PIL import Image
    from transformers import AutoTokenizer

    from library.models.llm import load_llm
    from library.models.qwen_image.edit_encoder import load_qwen_image_edit_text_encoder
    from library.models.qwen_image.learned import write_edit_text_encoder

    base = learned_paths("qwen_image")["text_encoder"]
    encoder = load_qwen_image_edit_text_encoder(write_edit_text_encoder(base, str(tmp_path)), "qwen-image-edit-2509")
    text = "a red star at the top left on a black background"
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(base, "tokenizer"), local_files_only=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    assert torch.equal(encoder.tokenizer(text, return_tensors="pt").input_ids, ids)
    assert encoder.image_token_id < encoder.llm.config.vocab_size
    valid, positions = torch.ones_like(ids, dtype=torch.bool), torch.arange(ids.shape[1])[None]
    expected = load_llm(os.path.join(base, "text_encoder")).hidden_states(ids, valid, positions)
    assert torch.equal(encoder.llm.hidden_states(ids, valid, positions[..., None].expand(-1, -1, 3)), expected)
    embeds, mask = encoder.encode(["make the shape red"], [[Image.new("RGB", (56, 56), (128, 128, 128))]])
    assert embeds.shape[-1] == expected.shape[-1] and bool(mask.all())
