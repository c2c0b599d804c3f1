"""Z-Image as a trainable family on the tiny models: train_lora.py trains and saves a LoRA; the LoRA
converted with tools/convert_lora.py --to diffusers loads in diffusers' ZImagePipeline
(load_lora_weights) and gives our runtime output; generate.py renders; base_loras trains as on a
base merged beforehand with tools/merge_lora.py, and the saved LoRA records it."""

import csv
import json
import os

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.zimage.family import ZImageFamily
from networks.lora import LoRANetwork
from tests.test_train_lora import sample_png


def read_losses(out, name):
    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


def train_args(tiny_set, out, name, model=None, steps=2, extra=()):
    return [
        "--model_type", "zimage", "--pretrained_model_name_or_path", model or tiny_set["zimage_diffusers"],
        "--ae", tiny_set["flux_vae"], "--text_encoder", tiny_set["zimage_text_encoder"],
        "--dataset_config", tiny_set["dataset_config"], "--output_dir", str(out), "--output_name", name,
        "--max_train_steps", str(steps), "--mixed_precision", "no", "--network_dim", "4", "--network_alpha", "4",
        "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0", *extra,
    ]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Six steps from zimage's defaults (its own timestep_sampling), samples at the end: the output folder."""
    out = tmp_path_factory.mktemp("zimage_run")
    args = train_args(tiny_set, out, "zimage", steps=6, extra=("--sample_prompts", tiny_set["sample_prompts"]))
    assert train_lora.main(args) == 0
    return out


def test_zimage_lora_trains_saves_and_samples(trained):
    losses = read_losses(trained, "zimage")
    print("zimage tiny losses", losses)
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    tensors = load_file(trained / "zimage.safetensors")
    assert any(k.startswith("lora_unet_layers_0_attention_to_q.") for k in tensors)
    assert any(k.startswith("lora_unet_layers_1_feed_forward_w2.") for k in tensors)
    # refiners and the adaLN modulation are off by default
    assert not any("refiner" in k or "adaLN" in k for k in tensors)
    with safe_open(str(trained / "zimage.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_model_version"] == "zimage-turbo" and meta["ss_timestep_sampling"] == "zimage_shift"
    assert meta["modelspec.architecture"] == "Z-Image/lora"  # musubi-tuner's
    assert sample_png(trained, "zimage", "final").stat().st_size > 0


@torch.no_grad()
@pytest.mark.parametrize("converted_to", ["diffusers", None])
def test_converted_lora_loads_in_zimage_pipeline_and_matches_runtime(tiny_set, trained, tmp_path, converted_to):
    """convert_lora --to diffusers (or the kohya file as saved) -> ZImagePipeline.load_lora_weights on
    diffusers' transformer with the same weights: its velocity equals ours with the runtime (unmerged)
    LoRA, called as the pipeline calls it (one [C, 1, H, W] latent per prompt, t = 1 - sigma, the output
    negated)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    from library.models.latents import pack_latents, unpack_latents
    from tools import convert_lora

    lora = trained / "zimage.safetensors"
    converted = tmp_path / "diffusers.safetensors" if converted_to else lora
    if converted_to:
        assert convert_lora.main([str(lora), str(converted), "--to", converted_to]) == 0

    g = torch.Generator().manual_seed(0)
    latents, txt, sigma = torch.randn(1, 16, 6, 8, generator=g), torch.randn(1, 5, 32, generator=g), torch.tensor([0.4])
    model = ZImageFamily(tiny_set["zimage_diffusers"]).load_transformer(torch.float32)
    base = unpack_latents(model(pack_latents(latents), txt, sigma, 3, 4), 6, 8)
    LoRANetwork.from_weights(model, "zimage", str(lora)).apply()
    ours = unpack_latents(model(pack_latents(latents), txt, sigma, 3, 4), 6, 8)

    reference = ZImageTransformer2DModel.from_pretrained(tiny_set["zimage_diffusers"]).eval()
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                          transformer=reference)
    pipe.load_lora_weights(str(converted))
    theirs = -torch.stack(reference([latents[0][:, None]], 1 - sigma, [txt[0]], return_dict=False)[0]).squeeze(2)
    rel = ((theirs - ours).norm() / ours.norm()).item()
    effect = ((ours - base).norm() / base.norm()).item()
    print(f"load_lora_weights: relative error {rel:.2e}, LoRA effect {effect:.2e}")
    assert effect > 1e-4, effect  # the LoRA does something, so the comparison means something
    assert rel < 1e-5, rel


def test_generate_renders_with_the_tiny_model(tiny_set, trained, tmp_path):
    from tools import generate

    out = tmp_path / "gen"
    code = generate.main(["--model_type", "zimage", "--model", tiny_set["zimage"], "--ae", tiny_set["flux_vae"],
                          "--text_encoder", tiny_set["zimage_text_encoder"], "--prompt", "a red square",
                          "--width", "64", "--height", "48", "--dtype", "fp32", "--out", str(out),
                          "--lora", f"{trained / 'zimage.safetensors'}:0.8"])
    assert code == 0
    pngs = [p for p in os.listdir(out) if p.endswith(".png")]
    assert len(pngs) == 1 and (out / pngs[0]).stat().st_size > 0


def test_base_loras_train_as_a_base_merged_beforehand(tiny_set, trained, tmp_path):
    """Two steps with base_loras = [the trained LoRA at 0.7] on the tiny base give the same losses and
    the same saved LoRA tensors as two steps on the base merged by tools/merge_lora.py (fp32: bitwise,
    one merge math);
    the saved LoRA holds only the new network and names the merged file in its metadata."""
    from tools import merge_lora

    adapter = trained / "zimage.safetensors"
    merged = tmp_path / "merged"  # a diffusers folder: the model's own names, so the same addmm per weight
    assert merge_lora.main(["--model", tiny_set["zimage_diffusers"], "--lora", f"{adapter}:0.7", "--save_to", str(merged)]) == 0
    with_base_loras = tmp_path / "a"
    assert train_lora.main(train_args(tiny_set, with_base_loras, "a",
                                      extra=("--base_loras", f"{adapter}:0.7"))) == 0
    beforehand = tmp_path / "b"
    assert train_lora.main(train_args(tiny_set, beforehand, "b", model=str(merged))) == 0
    assert read_losses(with_base_loras, "a") == read_losses(beforehand, "b")
    a, b = load_file(with_base_loras / "a.safetensors"), load_file(beforehand / "b.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with safe_open(str(with_base_loras / "a.safetensors"), "pt") as f:
        recorded = json.loads(f.metadata()["ss_base_loras"])
    assert recorded == [{"file": "zimage.safetensors", "ratio": 0.7}]


def test_samples_render_base_loras_on_both_bases_and_generate_reproduces_them(tiny_set, trained, tmp_path, capsys,
                                                                             monkeypatch):
    """An fp8 run with base_loras: its bf16 reference panel was rendered on the bf16 base without them, so it
    differed from the fp8 panel by the adapter, not by precision. Now both panels render base + base_loras + LoRA:
    generate.py on the bf16 base with --lora <base_lora> <lora> gives the bf16 panel; given the LoRA alone (the
    deployed image, without the adapter) it says in one note line which base_loras the samples had."""
    from library.data import images
    from tools import generate

    panels = {}  # the sample's panels as rendered, by label
    real = images.save_side_by_side
    monkeypatch.setattr(images, "save_side_by_side", lambda shown, *a, **k: (panels.update(shown), real(shown, *a, **k))[1])
    adapter = f"{trained / 'zimage.safetensors'}:30"  # a large ratio: another image, as a de-distillation adapter
    (tmp_path / "p.txt").write_text("a red circle --w 64 --h 48 --s 2 --d 7\n")
    out = tmp_path / "run"
    assert train_lora.main(train_args(tiny_set, out, "l", model=tiny_set["zimage"], extra=(
        "--base_loras", adapter, "--fp8_base", "true", "--sample_prompts", str(tmp_path / "p.txt")))) == 0
    assert set(panels) == {"bf16", "fp8_scaled"}
    bf16_panel = np.asarray(images.to_pil(panels["bf16"])).astype(int)

    def render(name, *loras):
        """generate.py's image minus the bf16 panel (max abs, of 255) and its note lines."""
        capsys.readouterr()
        assert generate.main(["--model_type", "zimage", "--model", tiny_set["zimage"], "--ae", tiny_set["flux_vae"],
                              "--text_encoder", tiny_set["zimage_text_encoder"], "--prompt_file", str(tmp_path / "p.txt"),
                              "--dtype", "fp32", "--out", str(tmp_path / name), "--lora", *loras]) == 0
        (png,) = (tmp_path / name).glob("*.png")
        notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
        return np.abs(np.asarray(Image.open(png).convert("RGB")).astype(int) - bf16_panel).max(), notes

    lora = str(out / "l.safetensors")
    with_adapter, notes = render("with_adapter", adapter, lora)
    assert with_adapter <= 1 and notes == []  # old: 88
    alone, notes = render("alone", lora)
    assert alone > 20 and notes == [f"note: {lora} was trained with base_loras zimage.safetensors:30 merged into its "
                                    f"base, which its training samples include: give them to --lora too to render those"]


@pytest.mark.parametrize("layout", ["plain", "block64"])
def test_fp8_merge_of_the_single_file_keeps_what_the_folder_keeps(tiny_set, trained, tmp_path, layout):
    """merge_lora --save_precision fp8 keeps the fp8 keep rules' modules (written in the model's diffusers
    names: all_x_embedder, all_final_layer) bf16 in the single file too, under its own names (x_embedder,
    final_layer). Old: the rules were matched against the single file's names and missed them: e4m3."""
    from library.models.zimage.checkpoint import diffusers_key
    from tools import merge_lora

    def bf16_linears(path):
        with safe_open(str(path), "pt") as f:
            return {k for k in f.keys() if k.endswith(".weight") and len(f.get_slice(k).get_shape()) == 2
                    and f.get_slice(k).get_dtype() == "BF16"}

    args = ["--lora", str(trained / "zimage.safetensors"), "--save_precision", "fp8", "--fp8_layout", layout]
    assert merge_lora.main(["--model", tiny_set["zimage"], "--save_to", str(tmp_path / "f.safetensors"), *args]) == 0
    assert merge_lora.main(["--model", tiny_set["zimage_diffusers"], "--save_to", str(tmp_path / "d"), *args]) == 0
    single_file = {diffusers_key(k) for k in bf16_linears(tmp_path / "f.safetensors")}
    folder = bf16_linears(tmp_path / "d" / "diffusion_pytorch_model.safetensors")
    assert "all_x_embedder.2-1.weight" in folder and "all_final_layer.2-1.linear.weight" in folder
    assert single_file == folder


def test_base_loras_merge_before_fp8_quantization(tiny_set, trained):
    """An fp8 base with base_loras: merged in float32, then quantized (a delta merged into fp8 weights
    would round away): the quantized weight equals quantizing the float32-merged one."""
    from library.precision.fp8 import FP8Linear, quantize_weight
    from library.training.base_loras import load_merged_base, merge_base_loras
    from library.lora_spec import LoRASpec

    family = ZImageFamily(tiny_set["zimage"])
    spec = [LoRASpec(str(trained / "zimage.safetensors"), 1.0)]
    model = load_merged_base(family, torch.float32, "fp8_scaled", spec)
    layer = model.layers[0].attention.to_q
    assert isinstance(layer, FP8Linear)
    reference = family.load_transformer(torch.float32)
    assert merge_base_loras(reference, "zimage", spec) > 0
    q, scale = quantize_weight(reference.layers[0].attention.to_q.weight, "fp8_scaled")
    assert torch.equal(layer.weight.view(torch.uint8), q.view(torch.uint8)) and torch.equal(layer.weight_scale, scale)


@pytest.mark.parametrize("precision", ["nf4", "int8"])
def test_base_loras_merge_before_bitsandbytes_quantization(tiny_set, trained, precision):
    """Old: a bitsandbytes base precision with base_loras went to fp8's quantizer and stopped after
    caching ("fp8 mode must be one of ..., got 'nf4'"). Now merged in float32, then quantized as
    bitsandbytes quantizes the float32-merged weight."""
    from library.lora_spec import LoRASpec
    from library.precision.bnb_weights import quantize
    from library.training.base_loras import load_merged_base, merge_base_loras

    family = ZImageFamily(tiny_set["zimage"])
    spec = [LoRASpec(str(trained / "zimage.safetensors"), 1.0)]
    layer = load_merged_base(family, torch.float32, precision, spec).layers[0].attention.to_q
    assert layer.mode == precision
    reference = family.load_transformer(torch.float32)
    assert merge_base_loras(reference, "zimage", spec) > 0
    expected = quantize(reference.layers[0].attention.to_q.weight, precision)
    assert set(layer.stored_names) == set(expected)
    assert all(torch.equal(getattr(layer, k), v) for k, v in expected.items())


@pytest.mark.parametrize("version,shift", [("zimage-turbo", 3.0), ("zimage-base", 6.0)])
def test_sample_schedule_is_the_release_schedulers(tiny_set, version, shift):
    """Turbo / Base: FlowMatchEulerDiscreteScheduler with use_dynamic_shifting false and the release's
    static shift, on the pipeline's linspace(1, 1/n, n) sigmas."""
    import numpy as np
    from diffusers import FlowMatchEulerDiscreteScheduler

    from library.models import flow_matching as fm

    family = ZImageFamily(tiny_set["zimage"], model_version=version)
    ours = fm.inference_sigmas(8, 4096, family.arch, sampling=family.inference_sampling())
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=shift, use_dynamic_shifting=False)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / 8, 8))
    assert float((ours - scheduler.sigmas).abs().max()) < 1e-6
    assert family.model_version(None) == version


def test_memory_planner_plans_the_released_sizes_on_meta(capsys):
    """The planner's forward runs on meta (no caption mask to read there). One preset and one base
    precision: zimage-base plans the same transformer and text encoder (it differs in its sampling
    schedule only), and each base's rows take seconds at full size on 2 cores."""
    from tools import plan_memory

    assert plan_memory.main(["--preset", "zimage-turbo", "--vram", "16", "--base_precision", "fp8_scaled"]) == 0
    assert "fits with blocks_to_swap" in capsys.readouterr().out


@pytest.mark.parametrize("version", ["zimage-turbo", "zimage-base"])
def test_sample_defaults_are_the_release_pipeline_calls(tiny_set, tmp_path, version):
    """Base samples as ZImagePipeline's defaults (guidance 5, 50 steps), Turbo as its own card (0, 8);
    a Base repository folder says so by its scheduler's shift 6. Base's defaults were Turbo's (0, 8):
    no CFG at all."""
    import inspect
    import json
    import shutil

    from diffusers import ZImagePipeline

    defaults = inspect.signature(ZImagePipeline.__call__).parameters
    expected = {"zimage-turbo": (0.0, 8),
                "zimage-base": (defaults["guidance_scale"].default, defaults["num_inference_steps"].default)}[version]
    assert expected in ((0.0, 8), (5.0, 50))
    family = ZImageFamily(tiny_set["zimage"], model_version=version)
    assert (family.sample_guidance, family.sample_steps) == expected
    repo = tmp_path / "repo"
    shutil.copytree(tiny_set["zimage_diffusers"], repo / "transformer")
    (repo / "scheduler").mkdir()
    (repo / "scheduler" / "scheduler_config.json").write_text(json.dumps({"shift": {"zimage-turbo": 3.0, "zimage-base": 6.0}[version]}))
    folder = ZImageFamily(str(repo / "transformer"))
    assert (folder.version, folder.sample_guidance, folder.sample_steps) == (version, *expected)


def test_base_sampling_matches_zimage_pipeline_with_cfg(tiny_set):
    """sample_latents for Base (its scheduler's shift 6, CFG 5: pos + 5 (pos - neg), 3 steps, 64 x 48)
    equals ZImagePipeline.__call__ on the same weights, seed and embeddings."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline, ZImageTransformer2DModel

    family = ZImageFamily(tiny_set["zimage"], model_version="zimage-base")
    model = family.load_transformer(torch.float32)
    reference = ZImageTransformer2DModel.from_pretrained(tiny_set["zimage_diffusers"]).eval()
    g = torch.Generator().manual_seed(1)
    text, negative = ({"embeds": torch.randn(1, 9, reference.config.cap_feat_dim, generator=g),
                       "mask": torch.ones(1, 9, dtype=torch.bool)} for _ in range(2))
    ours = family.sample_latents(model, text, 64, 48, 3, 7, 5.0, negative)
    pipe = ZImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=6.0), vae=None, text_encoder=None, tokenizer=None,
                          transformer=reference)
    with torch.no_grad():
        theirs = pipe(prompt_embeds=[text["embeds"][0]], negative_prompt_embeds=[negative["embeds"][0]], height=48, width=64,
                      num_inference_steps=3, guidance_scale=5.0, generator=torch.Generator().manual_seed(7),
                      output_type="latent", return_dict=False)[0]
    relative = ((ours - theirs).norm() / theirs.norm()).item()
    print(f"Z-Image Base sampling vs ZImagePipeline: relative {relative:.3g}")
    assert relative <= 1e-5


OVER = "over the largest image the model takes, 8192 wide by 8192 high (the positions its RoPE was built for)"


def test_zimage_largest_image_is_its_rope_positions_times_16_pixels(tiny_set):
    """axes_lens (1536, 512, 512): 512 patch rows and columns of 16 pixels; the omni forward refuses none."""
    from library.models.zimage.omni_family import ZImageOmniFamily

    assert ZImageFamily(tiny_set["zimage_diffusers"]).largest_image() == (8192, 8192)
    assert ZImageOmniFamily(tiny_set["zimage_diffusers"]).largest_image() is None


def test_a_sample_prompt_over_zimages_positions_is_refused_before_caching(tiny_set, tmp_path, capsys):
    """--w 8224 (514 patch columns, RoPE built for 512) failed only when the sample rendered, a warning at every
    sample round minutes into training."""
    from tests.test_reliability import copy_dataset, files_under, one_error_line

    toml = copy_dataset(tiny_set, tmp_path / "data")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle --s 1\na red circle --w 8224 --h 16 --s 1 --d 5\n")
    out = tmp_path / "out"
    code = train_lora.main(train_args(tiny_set, out, "z", extra=(
        "--dataset_config", toml, "--cache_latents_to_disk", "true", "--sample_prompts", str(prompts),
        "--sample_every_n_steps", "1")))
    assert one_error_line(capsys, code) == f"error: {prompts}:2: size 8224x16 is {OVER}"
    assert files_under(out) == [] and all(f.endswith((".png", ".txt")) for f in files_under(tmp_path / "data" / "images"))


@pytest.mark.parametrize("general", [
    "resolution = [8224, 16]",  # no buckets: every image trains at the resolution
    "resolution = [8224, 16]\nenable_bucket = true\nmin_bucket_reso = 16\nmax_bucket_reso = 8224\nbucket_reso_steps = 16",
])
def test_a_training_bucket_over_zimages_positions_is_refused_before_caching(tiny_set, tmp_path, capsys, general):
    """A bucket wider than 8192 pixels (no buckets: the resolution; buckets: max_bucket_reso lets a wide image's
    be) failed at the first step, after caching."""
    from tests.test_reliability import files_under, one_error_line

    images = tmp_path / "images"
    images.mkdir()
    Image.new("RGB", (8224, 16), "red").save(images / "wide.png")
    (images / "wide.txt").write_text("a red stripe")
    toml = tmp_path / "dataset.toml"
    toml.write_text(f'[general]\n{general}\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{images}"\n')
    out = tmp_path / "out"
    code = train_lora.main(train_args(tiny_set, out, "z", extra=("--dataset_config", str(toml),
                                                                 "--cache_latents_to_disk", "true")))
    assert one_error_line(capsys, code) == (f"error: {images / 'wide.png'}: its bucket 8224x16 is {OVER}; {toml}'s "
                                            f"resolution, max_bucket_reso or bucket_no_upscale set it")
    assert files_under(out) == [] and sorted(os.listdir(images)) == ["wide.png", "wide.txt"]


def test_generate_refuses_a_size_over_zimages_positions_before_loading_models(tiny_set, tmp_path, capsys, monkeypatch):
    """generate.py failed the same way only after loading the text encoder and the transformer."""
    from tools import generate

    def loaded(*args, **kwargs):
        raise ValueError("text encoder loaded")

    monkeypatch.setattr(ZImageFamily, "load_text_encoder", loaded)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red square\na red square --w 16 --h 8208\n")
    args = ["--model_type", "zimage", "--model", tiny_set["zimage"], "--ae", tiny_set["flux_vae"],
            "--text_encoder", tiny_set["zimage_text_encoder"], "--out", str(tmp_path / "out"), "--device", "cpu"]
    assert generate.main([*args, "--prompt_file", str(prompts)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {prompts}:2: size 16x8208 is {OVER}"
    assert generate.main([*args, "--prompt", "a red square", "--width", "8224", "--height", "16"]) == 2
    assert capsys.readouterr().err.strip() == f"error: --prompt: size 8224x16 is {OVER}"
