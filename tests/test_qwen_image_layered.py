"""Qwen-Image-Layered: the transformer (3-D layer RoPE + additional_t_cond) against diffusers'
QwenImageTransformer2DModel(use_layer3d_rope=True) on the same weights, in float32."""

import os

import pytest
import torch
from diffusers import QwenImageTransformer2DModel

from library.models.qwen_image.model import QwenImageConfig, joint_positions, load_qwen_image
from tests.test_qwen_image import randomize_
from tests.test_train_lora import sample_png

TEXT = 7


def layered_reference(tmp_path) -> QwenImageTransformer2DModel:
    config = QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                             axes_dims_rope=(8, 12, 12), use_additional_t_cond=True, use_layer3d_rope=True)
    ref = QwenImageTransformer2DModel(**{k: v for k, v in config.to_diffusers().items() if not k.startswith("_")})
    randomize_(ref, torch.Generator().manual_seed(4))
    ref.save_pretrained(tmp_path)
    return ref


@pytest.mark.parametrize("frames, h, w", [(3, 4, 6), (6, 2, 2)])  # (6, 2, 2): the text starts after the layer count
def test_layered_transformer_matches_diffusers(tmp_path, frames, h, w):
    """frames noisy layers (the composite first) then the condition image, as the pipeline lays them out."""
    ref = layered_reference(tmp_path)
    ours = load_qwen_image(str(tmp_path))
    assert ours.config.use_layer3d_rope and ours.config.use_additional_t_cond
    g = torch.Generator().manual_seed(6)
    tokens = (frames + 1) * h * w
    img, txt = torch.randn(2, tokens, 64, generator=g), torch.randn(2, TEXT, 32, generator=g)
    mask = torch.arange(TEXT)[None] < torch.tensor([[TEXT], [4]])
    shapes, sigma, cond = [[(1, h, w)] * (frames + 1)] * 2, torch.tensor([0.3, 0.7]), torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        expected = ref(hidden_states=img, encoder_hidden_states=txt, encoder_hidden_states_mask=mask, timestep=sigma,
                       img_shapes=shapes, additional_t_cond=cond, return_dict=False)[0]
        got = ours(img, txt, mask, sigma, shapes, additional_t_cond=cond)
    assert (got - expected).abs().max().item() <= 1e-5


def test_layered_positions():
    """The condition image (last) sits at frame -1; text starts at max(h//2, w//2, images - 1)."""
    ids = joint_positions([[(1, 2, 2)] * 4], text_len=2, layer3d=True)[0]
    text, img = ids[:2], ids[2:]
    assert img[:, 0].tolist() == [0] * 4 + [1] * 4 + [2] * 4 + [-1] * 4
    assert text[:, 0].tolist() == [3, 4]  # 4 images: max(1, 3)
    plain = joint_positions([[(1, 2, 2)] * 4], text_len=2)[0]
    assert plain[2:, 0].tolist()[-4:] == [3] * 4 and plain[:2, 0].tolist() == [1, 2]


class _Dtype(torch.nn.Module):
    """Stands in for the pipeline's text encoder: the prompt embeddings are given, it only reads .dtype."""

    dtype = torch.float32


def layered_pipeline(tiny_set):
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageLayeredPipeline

    from library.models.qwen_image.spec import SAMPLING  # Qwen-Image's scheduler_config.json

    line = SAMPLING.mu
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, time_shift_type="exponential", shift_terminal=SAMPLING.shift_terminal,
        base_image_seq_len=line.base_seq_len, max_image_seq_len=line.max_seq_len, base_shift=line.base_shift,
        max_shift=line.max_shift)
    return QwenImageLayeredPipeline(
        scheduler=scheduler, vae=AutoencoderKLQwenImage.from_pretrained(tiny_set["qwen_image_layered_vae"]).eval(),
        text_encoder=_Dtype(), tokenizer=None, processor=None,
        transformer=QwenImageTransformer2DModel.from_pretrained(tiny_set["qwen_image_layered"]).eval())


def family_of(tiny_set, layers=3):
    from library.models.qwen_image.layered import QwenImageLayeredFamily

    return QwenImageLayeredFamily(tiny_set["qwen_image_layered"], tiny_set["qwen_image_layered_vae"], layers,
                                  text_encoder=tiny_set["qwen_image_text_encoder"])


@torch.no_grad()
def test_sampling_equals_the_pipeline(tiny_set, monkeypatch):
    """QwenImageLayeredPipeline at 64 x 64 (its size rule patched down from 640^2), 3 layers, true CFG 4 with
    cfg_normalize (the release's example), 3 steps: our latents, composite first, equal its packed output."""
    import numpy as np
    from diffusers.pipelines.qwenimage import pipeline_qwenimage_layered as layered_pipe
    from PIL import Image

    from library.models.qwen_image.layered import pack_frames

    monkeypatch.setattr(layered_pipe, "calculate_dimensions", lambda area, ratio: (64, 64))
    # Its text encoder is a stand-in (the embeddings are given): the device is the CPU's.
    monkeypatch.setattr(layered_pipe.QwenImageLayeredPipeline, "_execution_device", property(lambda _: torch.device("cpu")))
    image = Image.fromarray(np.random.default_rng(1).integers(0, 255, (64, 64, 4), dtype=np.uint8), "RGBA")
    g = torch.Generator().manual_seed(2)
    text = {"embeds": torch.randn(1, TEXT, 32, generator=g), "mask": torch.ones(1, TEXT, dtype=torch.bool)}
    negative = {"embeds": torch.randn(1, 4, 32, generator=g), "mask": torch.ones(1, 4, dtype=torch.bool)}
    family = family_of(tiny_set)
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1)[None].float() / 255 * 2 - 1
    vae = family.load_vae()
    condition = vae.encode(pixels)
    ours = family.sample_latents(family.load_transformer(torch.float32), text, 64, 64, 3, 5, 4.0,
                                 negative_text=negative, control=[condition])
    assert ours.shape == (1, 16, 4, 8, 8)

    pipe = layered_pipeline(tiny_set)
    expected_condition = pipe._encode_vae_image(pipe.image_processor.preprocess(image, 64, 64)[:, :, None], None)
    assert (condition - expected_condition[:, :, 0]).abs().max().item() <= 1e-6
    final = {}

    def keep_latents(pipe, step, t, tensors):  # its output_type="latent" return fails (diffusers 0.42.1: `images` unset)
        final["latents"] = tensors["latents"]
        return {}

    pipe(image=image, prompt="x", prompt_embeds=text["embeds"], negative_prompt_embeds=negative["embeds"],
         true_cfg_scale=4.0, layers=3, num_inference_steps=3, generator=torch.Generator().manual_seed(5),
         output_type="pil", cfg_normalize=True, callback_on_step_end=keep_latents)
    theirs = final["latents"]
    rel = ((pack_frames(ours) - theirs).norm() / theirs.norm()).item()
    print(f"Qwen-Image-Layered sampling vs QwenImageLayeredPipeline: relative error {rel:.2e}")
    assert rel < 1e-5


@pytest.fixture(scope="module")
def layered_set(tiny_set, tmp_path_factory):
    from tools.make_tiny_dataset import make_tiny_layered_dataset

    return {**tiny_set, **make_tiny_layered_dataset(str(tmp_path_factory.mktemp("layered")), count=4, size=64)}


def train_args(layered_set, out) -> list[str]:
    return ["--model_type", "qwen_image_layered", "--pretrained_model_name_or_path", layered_set["qwen_image_layered"],
            "--ae", layered_set["qwen_image_layered_vae"], "--text_encoder", layered_set["qwen_image_text_encoder"],
            "--layers", "2", "--dataset_config", layered_set["layered_dataset_config"],
            "--sample_prompts", layered_set["layered_sample_prompts"], "--output_dir", str(out), "--output_name", "lay",
            "--max_train_steps", "2", "--mixed_precision", "no", "--network_dim", "4", "--network_alpha", "4",
            "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0"]


@pytest.fixture(scope="module")
def trained(layered_set, tmp_path_factory):
    """Two steps on multiple_target data, a sample at the end: the output folder."""
    import train_lora

    out = tmp_path_factory.mktemp("layered_run")
    assert train_lora.main(train_args(layered_set, out)) == 0
    return out


def test_trains_on_layered_targets_and_decomposes_a_sample(trained):
    """multiple_target data: each composite's latents are 3 frames (composite, background, shape), its
    reference the composite itself; the sample decomposes --ci into layers=2 frames beside the composite."""
    from PIL import Image
    from safetensors import safe_open

    with safe_open(str(trained / "lay.safetensors"), "pt") as f:
        meta, names = f.metadata(), {k.split(".")[0] for k in f.keys()}
    assert meta["ss_base_model_version"] == "qwen-image-layered"
    assert meta["modelspec.architecture"] == "Qwen-Image-Layered/lora"  # musubi-tuner's
    assert "lora_unet_transformer_blocks_0_attn_to_q" in names  # Qwen-Image's names: its LoRA files and tools
    with Image.open(sample_png(trained, "lay", "final")) as sample:  # 3 frames then the reference, 64 px each
        assert sample.width == 4 * 64


def test_plan_memory_plans_a_layered_dataset_with_its_composite_and_its_layers(layered_set, tmp_path, capsys,
                                                                              monkeypatch):
    """plan_memory --config_file on multiple_target data: the composite is each image's reference (the planner
    counted control_directory's only and refused every config: "0 reference image(s), but qwen_image_layered takes
    1 to 1"), and the target is planned as the dataset's 1 + 2 frames, not the family's default 1 + 4."""
    from library.models.qwen_image.layered import QwenImageLayeredFamily
    from tools import plan_memory

    config = tmp_path / "layered.toml"
    config.write_text("\n".join(f'{k} = "{v}"' for k, v in (
        ("model_type", "qwen_image_layered"), ("pretrained_model_name_or_path", layered_set["qwen_image_layered"]),
        ("ae", layered_set["qwen_image_layered_vae"]), ("text_encoder", layered_set["qwen_image_text_encoder"]),
        ("dataset_config", layered_set["layered_dataset_config"]), ("output_dir", str(tmp_path / "out")))))
    frames, real = [], QwenImageLayeredFamily.target_on_meta

    def recording(self, *args):
        latents = real(self, *args)
        frames.append(latents.shape[2])
        return latents

    monkeypatch.setattr(QwenImageLayeredFamily, "target_on_meta", recording)
    assert plan_memory.main(["--config_file", str(config), "--vram", "24", "--base_precision", "bf16"]) == 0
    assert "64x64, batch 2, 1 reference(s) per image" in capsys.readouterr().out
    assert frames and set(frames) == {3}, frames


def test_a_run_on_a_card_plans_its_layered_step_before_caching(layered_set, tmp_path, planned_on_a_card):
    """train_lora on a CUDA card plans the keeping keys from the memory plan of its largest step (run here with
    the card's size answered on the CPU): the step's composite reference was planned as none, and the run
    stopped before caching ("predict needs the image to decompose") unless checkpoint_saves_* were set. Now
    each step is planned with the composite and the dataset's 2 layers."""
    import train_lora
    planned = planned_on_a_card  # each step train_lora plans: (references, the largest one's size, layers)
    args = train_args(layered_set, tmp_path)
    args[args.index("--max_train_steps") + 1] = "1"
    assert train_lora.main(args + ["--gradient_checkpointing", "true"]) == 0
    assert planned and set(planned) == {(1, None, 2)}, planned


@torch.no_grad()
def test_converted_lora_loads_in_the_layered_pipeline_and_matches_runtime(layered_set, trained, tmp_path):
    """convert_lora --to diffusers -> QwenImageLayeredPipeline.load_lora_weights: diffusers' transformer
    on layered inputs (3 frames + the condition, is_rgb 0) equals ours with the runtime LoRA."""
    from networks.lora import LoRANetwork
    from tools import convert_lora

    lora, converted = trained / "lay.safetensors", tmp_path / "diffusers.safetensors"
    assert convert_lora.main([str(lora), str(converted), "--to", "diffusers"]) == 0
    g = torch.Generator().manual_seed(0)
    shapes = [[(1, 2, 3)] * 4]
    img, txt = torch.randn(1, 24, 64, generator=g), torch.randn(1, 5, 32, generator=g)
    sigma, rgba = torch.tensor([0.4]), torch.zeros(1, dtype=torch.long)
    model = family_of(layered_set).load_transformer(torch.float32)
    base = model(img, txt, None, sigma, shapes, additional_t_cond=rgba)
    LoRANetwork.from_weights(model, "qwen_image", str(lora)).apply()
    ours = model(img, txt, None, sigma, shapes, additional_t_cond=rgba)

    pipe = layered_pipeline(layered_set)
    pipe.load_lora_weights(str(converted))
    theirs = pipe.transformer(hidden_states=img, encoder_hidden_states=txt, timestep=sigma, img_shapes=shapes,
                              additional_t_cond=rgba, return_dict=False)[0]
    rel = ((theirs - ours).norm() / ours.norm()).item()
    effect = ((ours - base).norm() / base.norm()).item()
    print(f"Qwen-Image-Layered load_lora_weights: relative error {rel:.2e}, LoRA effect {effect:.2e}")
    assert effect > 1e-4, effect
    assert rel < 1e-5, rel


def test_layer_files_are_found_beside_their_composite_and_checked(tmp_path):
    from library.data.layers import check_layers, split_layers

    names = ["a.png", "a_1.png", "a_2.png", "a_10.png", "b_0.png", "b.png", "c_1.png", "lone_x.png"]
    composites, layers = split_layers([str(tmp_path / n) for n in names])
    assert sorted(os.path.basename(p) for p in composites) == ["a.png", "b.png", "c_1.png", "lone_x.png"]
    assert [os.path.basename(p) for p in layers[str(tmp_path / "a.png")]] == ["a_1.png", "a_2.png", "a_10.png"]
    assert [os.path.basename(p) for p in layers[str(tmp_path / "b.png")]] == ["b_0.png"]
    with pytest.raises(ValueError, match="c_1.png: no layer images beside it .*'c_1_1.png'"):
        check_layers(str(tmp_path / "c_1.png"), layers.get(str(tmp_path / "c_1.png")), None)
    with pytest.raises(ValueError, match="b.png: 1 layer image.*a.png of the same dataset has 3"):
        check_layers(str(tmp_path / "b.png"), layers[str(tmp_path / "b.png")], (str(tmp_path / "a.png"), 3))


def test_cached_latents_are_the_frames_encoded_one_by_one(layered_set):
    """Each frame is encoded alone as RGBA (the transparent shape layer keeps its alpha); the composite is
    also the reference (control_0), encoded the same way."""
    from library.data.caches import cache_latents, read_cache
    from library.data.dataset_config import load_dataset_config
    from library.data.image_folders import scan_images
    from library.data.images import load_image

    family = family_of(layered_set)
    vae = family.load_vae()
    items = scan_images(load_dataset_config(layered_set["layered_dataset_config"]), control_mode=family.reference_mode)
    assert len(items) == 4 and all(len(it.layer_paths) == 2 and it.control_paths == [it.image_path] for it in items)
    assert cache_latents(items, vae.encode, "layered", to_disk=False) == 4
    cached = read_cache(items[0].latent_cache)
    assert cached["latents"].shape == (16, 3, 8, 8)
    shape_layer = load_image(items[0].layer_paths[1], items[0].bucket, mode="RGBA")
    assert shape_layer.shape[0] == 4 and shape_layer[3].min() == -1  # transparent around the shape
    alone = vae.encode(shape_layer[None])[0].to(cached["latents"].dtype)
    assert torch.equal(cached["latents"][:, 2], alone)
    assert torch.equal(cached["control_0"], cached["latents"][:, 0])


def test_generate_decomposes_an_image_into_rgba_layers(layered_set, trained, tmp_path):
    """generate.py --ci composite --layers 2: the preview strip and each layer as an RGBA PNG."""
    from PIL import Image

    from tools import generate

    out = tmp_path / "gen"
    composite = os.path.join(layered_set["layered_image_dir"], "000.png")
    code = generate.main(["--model_type", "qwen_image_layered", "--model", layered_set["qwen_image_layered"],
                          "--ae", layered_set["qwen_image_layered_vae"], "--text_encoder",
                          layered_set["qwen_image_text_encoder"], "--layers", "2", "--prompt",
                          f"a shape on a background --ci {composite} --s 3 --w 64 --h 64", "--dtype", "fp32",
                          "--out", str(out), "--lora", f"{trained / 'lay.safetensors'}:0.8"])
    assert code == 0
    pngs = sorted(p for p in os.listdir(out) if p.endswith(".png"))
    assert len(pngs) == 4, pngs  # the strip, then the composite and 2 layers
    with Image.open(out / pngs[0]) as strip:
        assert strip.size == (3 * 64, 64)
    with Image.open(out / [p for p in pngs if p.endswith("_layer2.png")][0]) as layer:
        assert layer.mode == "RGBA" and layer.size == (64, 64)


@torch.no_grad()
def test_single_file_and_merged_folder_load_as_layered(layered_set, trained, tmp_path):
    """A ComfyUI-style single file (prefixed keys, no config.json) gets the Layered flags from the model_type;
    merge_lora into the diffusers folder keeps them (its config.json) and equals the runtime LoRA."""
    from library.io import save_safetensors
    from library.models.qwen_image.layered import QwenImageLayeredFamily
    from networks.lora import LoRANetwork
    from tools import merge_lora

    # A single file's config comes from its shapes: head dim 128 (the release's RoPE axes 16, 56, 56).
    from library.models.qwen_image.layered import LAYERED_FLAGS
    from library.models.qwen_image.model import QwenImage, QwenImageConfig, load_qwen_image

    config = QwenImageConfig(num_layers=1, num_attention_heads=1, joint_attention_dim=32, **LAYERED_FLAGS)
    single = tmp_path / "qwen_image_layered_bf16.safetensors"
    save_safetensors({"model.diffusion_model." + k: v for k, v in QwenImage(config).state_dict().items()}, str(single))
    g = torch.Generator().manual_seed(3)
    img, txt, sigma = torch.randn(1, 16, 64, generator=g), torch.randn(1, 5, 32, generator=g), torch.tensor([0.6])
    rgba = torch.zeros(1, dtype=torch.long)

    def velocity(model):
        return model(img, txt, None, sigma, [[(1, 2, 2)] * 4], additional_t_cond=rgba)

    from_file = QwenImageLayeredFamily(str(single), text_encoder="unused").load_transformer(torch.float32)
    assert from_file.config == config
    assert torch.equal(velocity(from_file), velocity(load_qwen_image(str(single), config=config)))

    folder = layered_set["qwen_image_layered"]
    lora = trained / "lay.safetensors"
    runtime = family_of(layered_set).load_transformer(torch.float32)
    LoRANetwork.from_weights(runtime, "qwen_image", str(lora), multiplier=0.8).apply()
    merged = tmp_path / "merged"
    assert merge_lora.main(["--model", folder, "--lora", f"{lora}:0.8", "--save_to", str(merged)]) == 0
    got = velocity(QwenImageLayeredFamily(str(merged), text_encoder="unused").load_transformer(torch.float32))
    ref = velocity(runtime)
    assert ((got - ref).norm() / ref.norm()).item() < 1e-5


def test_a_layered_transformer_given_as_qwen_image_or_an_edit_model_is_refused_naming_its_type(layered_set, tmp_path,
                                                                                                 capsys):
    """model_type qwen_image (or qwen_image_edit) on a Qwen-Image-Layered folder loaded, cached every latent and
    caption, and stopped at step 1 asking for additional_t_cond: now one line before caching, naming the type."""
    import train_lora

    from library.models.qwen_image.edit_family import QwenImageEditFamily
    from tests.test_reliability import one_error_line

    folder = layered_set["qwen_image_layered"]
    args = ["--model_type", "qwen_image", "--pretrained_model_name_or_path", folder,
            "--ae", layered_set["qwen_image_vae"], "--text_encoder", layered_set["qwen_image_text_encoder"],
            "--dataset_config", layered_set["dataset_config"],
            "--output_dir", str(tmp_path / "out"), "--max_train_steps", "1", "--mixed_precision", "no",
            "--save_every_n_steps", "0"]
    line = one_error_line(capsys, train_lora.main(args))
    assert line == (f"error: {folder}: use_additional_t_cond is true: a Qwen-Image-Layered transformer; set "
                    f"model_type = \"qwen_image_layered\""), line
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())
    with pytest.raises(ValueError, match=r"config\.json: use_additional_t_cond is true: a Qwen-Image-Layered"):
        QwenImageEditFamily(folder, text_encoder="unused").load_transformer(torch.float32, read_weights=False)


def test_a_plain_qwen_image_folder_is_refused(tiny_set):
    from library.models.qwen_image.layered import QwenImageLayeredFamily

    with pytest.raises(ValueError, match="use_layer3d_rope is False; a Qwen-Image-Layered transformer"):
        QwenImageLayeredFamily(tiny_set["qwen_image"], text_encoder="unused").load_transformer(torch.float32)


def half_transparent(path, width: int, height: int) -> None:
    """An RGBA composite: red, its right half transparent."""
    import numpy as np
    from PIL import Image

    pixels = np.zeros((height, width, 4), np.uint8)
    pixels[...] = (200, 40, 40, 255)
    pixels[:, width // 2:, 3] = 0
    Image.fromarray(pixels, "RGBA").save(path)


def test_a_sample_takes_the_ci_images_aspect_and_alpha_as_the_pipeline(layered_set, tmp_path):
    """QwenImageLayeredPipeline sizes its output from the image to decompose (calculate_dimensions(resolution^2,
    w / h)) and resizes the RGBA image to it. A 96 x 64 half-transparent --ci at --w 128 --h 128: 160 x 96, the
    pipeline's pixels, alpha kept. Old: 128 x 128, the sides cropped, loaded as RGB (alpha +1: the transparent
    composite rendered as its RGB copy)."""
    from diffusers.image_processor import VaeImageProcessor
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_layered import calculate_dimensions
    from PIL import Image

    path = tmp_path / "wide.png"
    half_transparent(path, 96, 64)
    width, height, (ours,) = family_of(layered_set).sample_references([str(path)], 128, 128)
    assert (width, height) == calculate_dimensions(128 * 128, 96 / 64) == (160, 96)
    processor = VaeImageProcessor(vae_scale_factor=16)  # the pipeline's (vae_scale_factor * 2)
    with Image.open(path) as image:
        theirs = processor.preprocess(processor.resize(image, height, width), height, width)
    assert ours.shape == theirs.shape == (1, 4, 96, 160)
    assert (ours - theirs).abs().max().item() <= 1e-6
    assert ours[0, 3, :, -1].max().item() == -1  # the transparent half


def test_training_samples_and_generate_render_a_wide_ci_alike(layered_set, tmp_path, monkeypatch):
    """A wide --ci in a training run's sample prompts and in generate.py with that run's LoRA: both render the
    image's aspect ratio (160 x 96 from --w 128 --h 128), and the same composite and layers."""
    import numpy as np
    from PIL import Image

    import train_lora
    from library.data import images
    from tools import generate

    panels = {}  # the training sample's panels as rendered, by label
    real = images.save_side_by_side
    monkeypatch.setattr(images, "save_side_by_side", lambda shown, *a, **k: (panels.update(shown), real(shown, *a, **k))[1])
    half_transparent(tmp_path / "wide.png", 96, 64)
    prompt = f"a shape --ci {tmp_path / 'wide.png'} --w 128 --h 128 --s 2 --d 7"
    (tmp_path / "p.txt").write_text(prompt + "\n")
    args = train_args(layered_set, tmp_path / "run")
    args[args.index("--sample_prompts") + 1] = str(tmp_path / "p.txt")
    args[args.index("--max_train_steps") + 1] = "1"
    assert train_lora.main(args) == 0
    strip = panels.pop(next(k for k in panels if not k.startswith("reference")))  # composite | 2 layers
    assert strip.shape == (3, 96, 3 * 160) and panels["reference"].shape == (4, 96, 160)
    out = tmp_path / "gen"
    assert generate.main(["--model_type", "qwen_image_layered", "--model", layered_set["qwen_image_layered"],
                          "--ae", layered_set["qwen_image_layered_vae"], "--text_encoder",
                          layered_set["qwen_image_text_encoder"], "--layers", "2", "--prompt", prompt, "--dtype", "fp32",
                          "--out", str(out), "--lora", str(tmp_path / "run" / "lay.safetensors")]) == 0
    (png,) = (p for p in out.glob("*.png") if "_layer" not in p.name)
    with Image.open(png) as image:
        rendered = np.asarray(image.convert("RGB")).astype(int)
    assert rendered.shape == (96, 3 * 160, 3)
    assert np.abs(rendered - np.asarray(images.to_pil(strip)).astype(int)).max() <= 1
