"""Ideogram 4 as a trainable family on the tiny models: train_lora.py trains a LoRA over the released
(BFL nvfp4) base from the family's defaults, records the stored layout in the LoRA's metadata, samples;
the LoRA converted with tools/convert_lora.py --to diffusers loads in Ideogram4Pipeline
(load_lora_weights) over diffusers' BFL-loaded transformer and gives our runtime output."""

import csv
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.models.ideogram4.family import Ideogram4Family
from library.models.ideogram4.vae import from_ideogram_tokens, to_ideogram_tokens
from library.models.latents import pack_latents
from networks.lora import LoRANetwork

from tests.test_ideogram4_files import reference


def read_losses(out, name):
    with open(os.path.join(out, f"{name}_log.csv")) as f:
        return [float(r["loss"]) for r in csv.DictReader(f)]


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Four steps from ideogram4's defaults (ideogram4_shift), samples at the end: the output folder."""
    out = tmp_path_factory.mktemp("ideogram4_run")
    prompts = out / "prompts.txt"  # 4 steps, not the pipeline's 48: each is two forwards (the guidance blend)
    prompts.write_text("a red square --s 4\n")
    args = ["--model_type", "ideogram4", "--pretrained_model_name_or_path", tiny_set["ideogram4"],
            "--ae", tiny_set["flux2_vae"], "--text_encoder", tiny_set["ideogram4_text_encoder"],
            "--dataset_config", tiny_set["dataset_config"], "--output_dir", str(out), "--output_name", "ideogram4",
            "--max_train_steps", "4", "--mixed_precision", "no", "--network_dim", "4", "--network_alpha", "4",
            "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0",
            "--sample_prompts", str(prompts)]
    assert train_lora.main(args) == 0
    return out


def test_ideogram4_lora_trains_over_nvfp4_and_records_the_layout(trained):
    losses = read_losses(trained, "ideogram4")
    print("ideogram4 tiny losses", losses)
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    names = {k.split(".")[0] for k in load_file(trained / "ideogram4.safetensors")}
    assert "lora_unet_layers_0_attention_to_q" in names and "lora_unet_layers_1_feed_forward_w2" in names
    assert len(names) == 2 * 7  # q, k, v, out, w1, w2, w3 per block
    with safe_open(str(trained / "ideogram4.safetensors"), "pt") as f:
        meta = f.metadata()
    assert meta["ss_base_precision"] == "bfl_nvfp4" and meta["ss_timestep_sampling"] == "ideogram4_shift"
    assert meta["modelspec.architecture"] == "Ideogram-4/lora"  # musubi-tuner's
    assert any(p.endswith(".png") for p in os.listdir(trained))


@torch.no_grad()
def test_converted_lora_loads_in_the_pipeline_and_matches_runtime(tiny_set, trained, tmp_path):
    from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline

    from tools import convert_lora

    from tests.test_ideogram4 import diffusers_velocity

    lora = trained / "ideogram4.safetensors"
    converted = tmp_path / "diffusers.safetensors"
    assert convert_lora.main([str(lora), str(converted), "--to", "diffusers"]) == 0
    assert all(k.startswith("transformer.") for k in load_file(converted))

    g = torch.Generator().manual_seed(0)
    latents, txt, sigma = torch.randn(1, 32, 4, 6, generator=g), torch.randn(1, 5, 64, generator=g), torch.tensor([0.4])
    family = Ideogram4Family(tiny_set["ideogram4"], tiny_set["flux2_vae"], text_encoder=tiny_set["ideogram4_text_encoder"])
    model = family.load_transformer(torch.float32)
    x = pack_latents(latents)
    base = family.predict(model, x, sigma, {"embeds": txt}, 2, 3, None)
    LoRANetwork.from_weights(model, "ideogram4", str(lora)).apply()
    ours = family.predict(model, x, sigma, {"embeds": txt}, 2, 3, None)

    theirs_model = reference(tiny_set["ideogram4"], "nvfp4")
    pipe = Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=None, text_encoder=None, tokenizer=None,
                             transformer=theirs_model, unconditional_transformer=None)
    pipe.load_lora_weights(str(converted))
    mask = torch.ones(1, 5, dtype=torch.bool)
    theirs = from_ideogram_tokens(diffusers_velocity(theirs_model, to_ideogram_tokens(x), txt, mask, sigma, 2, 3))
    rel = ((theirs - ours).norm() / ours.norm()).item()
    effect = ((ours - base).norm() / base.norm()).item()
    print(f"Ideogram 4 load_lora_weights: relative error {rel:.2e}, LoRA effect {effect:.2e}")
    assert effect > 1e-4, effect
    assert rel < 1e-5, rel


@torch.no_grad()
def test_family_sampler_is_the_pipelines(tiny_set, monkeypatch):
    """Ideogram4Family.sample_latents (text from our encoder, the released nvfp4 transformer and the fp8r
    unconditional one beside it) against Ideogram4Pipeline from the same seed: the same latents."""
    import diffusers.pipelines.ideogram4.pipeline_ideogram4 as module
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline
    from transformers import AutoTokenizer, Qwen3VLModel

    from library.models.latents import unpack_latents

    family = Ideogram4Family(tiny_set["ideogram4"], tiny_set["flux2_vae"], text_encoder=tiny_set["ideogram4_text_encoder"])
    model = family.load_transformer(torch.float32)
    encode = family.load_text_encoder("fp32")
    prompts = ["a red chair by the sea", "a dog"]
    per_caption = encode(prompts)
    length = max(c["embeds"].shape[0] for c in per_caption)
    embeds = torch.stack([torch.cat([c["embeds"], c["embeds"].new_zeros(length - len(c["embeds"]), 64)]) for c in per_caption])
    mask = torch.stack([torch.arange(length) < len(c["embeds"]) for c in per_caption])
    ours = family.sample_latents(model, {"embeds": embeds, "mask": mask}, 48, 32, 3, 11, 4.0)

    monkeypatch.setattr(module, "QWEN3_VL_ACTIVATION_LAYERS", family.taps(64))
    folder = os.path.dirname(tiny_set["ideogram4_text_encoder"])
    pipe = Ideogram4Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), vae=AutoencoderKLFlux2.from_pretrained(tiny_set["flux2_vae"]),
                             text_encoder=Qwen3VLModel.from_pretrained(os.path.join(folder, "text_encoder")).eval(),
                             tokenizer=AutoTokenizer.from_pretrained(os.path.join(folder, "tokenizer")),
                             transformer=reference(tiny_set["ideogram4"], "nvfp4"),
                             unconditional_transformer=reference(family.unconditional, "fp8r"))
    tokens = pipe(prompts, height=32, width=48, num_inference_steps=3, guidance_scale=None, guidance_schedule=[4.0] * 3,
                  max_sequence_length=40, generator=torch.Generator().manual_seed(11), output_type="latent").images
    theirs = unpack_latents(from_ideogram_tokens(tokens), 4, 6)
    diff = (ours - theirs).abs().max().item()
    print(f"Ideogram 4 family sampler vs pipeline: max abs diff {diff:.2e} (latents up to {theirs.abs().max():.1f})")
    assert diff <= 1e-5 * theirs.abs().max()


def test_generate_renders_with_the_tiny_model(tiny_set, trained, tmp_path):
    from tools import generate

    out = tmp_path / "gen"
    code = generate.main(["--model_type", "ideogram4", "--model", tiny_set["ideogram4"], "--ae", tiny_set["flux2_vae"],
                          "--text_encoder", tiny_set["ideogram4_text_encoder"], "--prompt", "a red square --s 3",
                          "--width", "64", "--height", "48", "--dtype", "fp32", "--out", str(out),
                          "--lora", f"{trained / 'ideogram4.safetensors'}:0.8"])
    assert code == 0
    pngs = [p for p in os.listdir(out) if p.endswith(".png")]
    assert len(pngs) == 1 and (out / pngs[0]).stat().st_size > 0


def test_merge_into_the_quantized_base_is_refused_in_one_line(tiny_set, trained, tmp_path, capsys):
    from tools import merge_lora

    code = merge_lora.main(["--model", tiny_set["ideogram4"], "--lora", str(trained / "ideogram4.safetensors"),
                            "--save_to", str(tmp_path / "merged")])
    assert code == 2 and "a BFL fp8r / nvfp4 base" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()


def test_ai_toolkit_lora_reads_as_diffusers_converter_reads_it(tmp_path):
    """An ai-toolkit LoRA (diffusion_model. prefix, q / k / v fused in attention.qkv, attention.o):
    convert_lora --to diffusers gives per module the delta diffusers' own converter
    (_convert_non_diffusers_ideogram4_lora_to_diffusers, what load_lora_weights runs) gives."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ideogram4_lora_to_diffusers
    from safetensors.torch import save_file

    from tools import convert_lora

    g, d, r = torch.Generator().manual_seed(3), 128, 4
    shapes = {"attention.qkv": (3 * d, d), "attention.o": (d, d), "feed_forward.w1": (96, d), "feed_forward.w2": (d, 96)}
    src = {}
    for i in range(2):
        for module, (rows, cols) in shapes.items():
            base = f"diffusion_model.layers.{i}.{module}"
            src[f"{base}.lora_A.weight"] = torch.randn(r, cols, generator=g)
            src[f"{base}.lora_B.weight"] = torch.randn(rows, r, generator=g)
    save_file(src, str(tmp_path / "aitk.safetensors"))
    assert convert_lora.main([str(tmp_path / "aitk.safetensors"), str(tmp_path / "ours.safetensors"), "--to", "diffusers",
                              "--model_type", "ideogram4"]) == 0
    ours = load_file(tmp_path / "ours.safetensors")
    theirs = _convert_non_diffusers_ideogram4_lora_to_diffusers(dict(src))

    def deltas(sd, prefix):
        mods = {k[len(prefix):].rsplit(".lora_A", 1)[0] for k in sd if ".lora_A" in k}
        return {m: sd[f"{prefix}{m}.lora_B.weight"].float() @ sd[f"{prefix}{m}.lora_A.weight"].float() for m in mods}

    a, b = deltas(ours, "transformer."), deltas(theirs, "transformer.")
    assert set(a) == set(b) and len(a) == 2 * 6  # q, k, v, out, w1, w2 (no w3 given) per block
    assert all(torch.allclose(a[m], b[m], rtol=1e-5, atol=1e-5) for m in a)


def test_comfy_layout_is_the_original_fused_names_diffusers_reads_as_the_trained_deltas(trained, tmp_path):
    """ComfyUI's Ideogram 4 has the original names (fused attention.qkv, attention.o), which its key map takes
    alone, as ai-toolkit's and musubi-tuner's LoRAs name them: --to comfy writes those (it was refused). diffusers'
    converter of that layout (_convert_non_diffusers_ideogram4_lora_to_diffusers) splits them back into each
    module's trained delta (alpha / rank folded)."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_ideogram4_lora_to_diffusers

    from tools import convert_lora

    src, dst = str(trained / "ideogram4.safetensors"), str(tmp_path / "comfy.safetensors")
    assert convert_lora.main([src, dst, "--to", "comfy"]) == 0
    comfy = load_file(dst)
    modules = {k.rsplit(".lora_", 1)[0] for k in comfy}
    assert {"diffusion_model.layers.0.attention.qkv", "diffusion_model.layers.1.attention.o",
            "diffusion_model.layers.0.feed_forward.w2"} <= modules and len(modules) == 2 * 5
    assert not any("to_q" in m or "to_out" in m for m in modules)
    ours = load_file(src)
    theirs = _convert_non_diffusers_ideogram4_lora_to_diffusers(dict(comfy))
    for module in ("attention.to_q", "attention.to_v", "attention.to_out.0", "feed_forward.w1"):
        kohya = "lora_unet_layers_1_" + module.replace(".", "_")
        scale = ours[f"{kohya}.alpha"].item() / ours[f"{kohya}.lora_down.weight"].shape[0]
        want = scale * ours[f"{kohya}.lora_up.weight"].float() @ ours[f"{kohya}.lora_down.weight"].float()
        got = (theirs[f"transformer.layers.1.{module}.lora_B.weight"].float()
               @ theirs[f"transformer.layers.1.{module}.lora_A.weight"].float())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_planner_reads_the_stored_layout_from_the_files(tiny_set, tmp_path, capsys):
    from tools import plan_memory

    config = tmp_path / "plan.toml"
    config.write_text(f'[model]\nmodel_type = "ideogram4"\npretrained_model_name_or_path = "{tiny_set["ideogram4"]}"\n'
                      f'ae = "{tiny_set["flux2_vae"]}"\ntext_encoder = "{tiny_set["ideogram4_text_encoder"]}"\n'
                      f'[data]\ndataset_config = "{tiny_set["dataset_config"]}"\n')
    assert plan_memory.main(["--config_file", str(config), "--vram", "1", "--resolution", "256"]) == 0
    assert "bfl_nvfp4  gradient_checkpointing=true : fits" in capsys.readouterr().out


def test_samples_unconditional_transformer_is_planned_and_released_after_each_round(tiny_set):
    """Until 2026-11-28 the unconditional transformer the first sample loaded stayed on the device through every
    training step after it (8.93 GiB at full size), and no phase of the plan counted it. Now the sampling phase
    counts it, and render_samples releases it after each round of samples, a failed one too."""
    import types

    from library.models.ideogram4.checkpoint import load_ideogram4
    from library.training.diffusion_task import DiffusionTask
    from library.training.memory_plan import module_bytes, sampling_phase
    from tools import plan_memory

    family = Ideogram4Family(tiny_set["ideogram4"], tiny_set["flux2_vae"], text_encoder=tiny_set["ideogram4_text_encoder"])
    args = plan_memory.default_args("ideogram4")
    with_it = sampling_phase(family, args, 64, 64, 8)
    uncond = module_bytes(load_ideogram4(family.unconditional, dtype=torch.bfloat16))  # (the plan's compute dtype)
    family.sample_model_bytes = lambda dtype: 0
    assert with_it.peak - sampling_phase(family, args, 64, 64, 8).peak == uncond > 0
    del family.sample_model_bytes

    model = family.load_transformer(torch.float32)
    loaded = []

    def render(out_dir, tag, stop, first=0):  # a round of samples that runs out of memory after its first image
        family.sample_latents(model, {"embeds": torch.randn(1, 5, 64)}, 32, 32, 1, 0, 4.0)
        loaded.append(family._uncond)
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError):
        DiffusionTask.render_samples(types.SimpleNamespace(family=family, _render_samples=render), "out", "step1")
    assert loaded[0] is not None and family._uncond is None


def test_a_caption_over_2048_tokens_is_an_error_in_the_check_and_refused_before_caching(tiny_set, tmp_path, capsys):
    """Ideogram4Pipeline refuses a prompt over 2048 chat tokens, and so does our encoder: such a caption
    was a warning ("the rest is cut"), then training stopped after the latents were cached, in a line
    naming no file."""
    from library.data import check
    from library.data.dataset_config import load_dataset_config
    from tests.test_reliability import copy_dataset, files_under, one_error_line

    long = ", ".join(f"word{i} tag{i}" for i in range(700))
    toml = copy_dataset(tiny_set, tmp_path / "data", lambda images: (images / "003.txt").write_text(long))
    family = Ideogram4Family(tiny_set["ideogram4"], tiny_set["flux2_vae"], text_encoder=tiny_set["ideogram4_text_encoder"])
    limit = family.caption_token_limit(None)
    n = limit.count(long)
    caption = tmp_path / "data" / "images" / "003.txt"
    message = f"{caption}: caption is {n} Qwen3-VL tokens; the encoder takes at most 2048 and refuses longer ones"
    report = check.check_dataset(load_dataset_config(toml), limit)
    assert n > 2048 and [(p.severity, p.message) for p in report.problems()] == [("error", message)]
    out = tmp_path / "out"
    code = train_lora.main(["--model_type", "ideogram4", "--pretrained_model_name_or_path", tiny_set["ideogram4"],
                            "--ae", tiny_set["flux2_vae"], "--text_encoder", tiny_set["ideogram4_text_encoder"],
                            "--dataset_config", toml, "--output_dir", str(out), "--max_train_steps", "1",
                            "--cache_latents_to_disk", "true"])
    assert one_error_line(capsys, code) == f"error: {message}"
    assert files_under(out) == [] and all(f.endswith((".png", ".txt")) for f in files_under(tmp_path / "data" / "images"))


LONG = ", ".join(f"word{i} tag{i}" for i in range(700))  # over Ideogram 4's 2048 chat tokens


@pytest.mark.parametrize("line,what", [(f"{LONG} --s 4", "prompt")])
def test_a_sample_prompt_over_2048_tokens_is_refused_before_caching(tiny_set, tmp_path, capsys, line, what):
    """A sample prompt the encoder refuses stopped training only after the latents and captions were cached:
    'prompt has 3609 tokens, exceeds max_sequence_length=2048', naming no file or line."""
    from tests.test_reliability import copy_dataset, files_under, one_error_line

    toml = copy_dataset(tiny_set, tmp_path / "data")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"# samples\na red square --s 4\n{line}\n")
    family = Ideogram4Family(tiny_set["ideogram4"], tiny_set["flux2_vae"], text_encoder=tiny_set["ideogram4_text_encoder"])
    n = family.caption_token_limit(None).count(LONG)
    out = tmp_path / "out"
    code = train_lora.main(["--model_type", "ideogram4", "--pretrained_model_name_or_path", tiny_set["ideogram4"],
                            "--ae", tiny_set["flux2_vae"], "--text_encoder", tiny_set["ideogram4_text_encoder"],
                            "--dataset_config", toml, "--output_dir", str(out), "--max_train_steps", "1",
                            "--cache_latents_to_disk", "true", "--cache_text_encoder_outputs_to_disk", "true",
                            "--sample_prompts", str(prompts), "--sample_at_first", "true"])
    assert n > 2048 and one_error_line(capsys, code) == (f"error: {prompts}:3: {what} is {n} Qwen3-VL tokens; the "
                                                         f"encoder takes at most 2048 and refuses longer ones")
    assert files_under(out) == [] and all(f.endswith((".png", ".txt")) for f in files_under(tmp_path / "data" / "images"))


def test_a_long_negative_that_no_cfg_reads_is_warned_not_refused_nor_encoded(tiny_set, tmp_path, monkeypatch):
    """Old: training refused a sample prompt's --n over 2048 tokens (and encoded a shorter one), which Ideogram 4
    never reads (no true CFG); generate.py warned that --n is not read and rendered the same file."""
    from library.training.diffusion_task import DiffusionTask
    from tests.test_reliability import copy_dataset

    class Settled(Exception):
        pass

    def settled(task):
        raise Settled([negative for _, negative in task.prompt_texts])

    monkeypatch.setattr(DiffusionTask, "_load_base", settled)  # right after the caches and prompts are encoded
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"a red square --s 4 --n {LONG}\na blue square --s 4 --n blurry\n")
    with pytest.warns(UserWarning, match=r"--n \(--negative\) is not read"), pytest.raises(Settled) as stop:
        train_lora.main(["--model_type", "ideogram4", "--pretrained_model_name_or_path", tiny_set["ideogram4"],
                         "--ae", tiny_set["flux2_vae"], "--text_encoder", tiny_set["ideogram4_text_encoder"],
                         "--dataset_config", copy_dataset(tiny_set, tmp_path / "data"), "--output_dir",
                         str(tmp_path / "out"), "--max_train_steps", "1", "--sample_prompts", str(prompts),
                         "--sample_at_first", "true"])
    assert stop.value.args[0] == [None, None]


def test_generate_refuses_a_prompt_over_2048_tokens_before_the_text_encoder_loads(tiny_set, tmp_path, capsys,
                                                                                  monkeypatch):
    """generate.py named no prompt either, after loading the text encoder; an unread --n (no true CFG: not
    encoded) is not refused."""
    from tools import generate

    def loaded(*args, **kwargs):
        raise ValueError("text encoder loaded")

    monkeypatch.setattr(Ideogram4Family, "load_text_encoder", loaded)
    prompts = tmp_path / "prompts.txt"
    args = ["--model_type", "ideogram4", "--model", tiny_set["ideogram4"], "--ae", tiny_set["flux2_vae"],
            "--text_encoder", tiny_set["ideogram4_text_encoder"], "--prompt_file", str(prompts),
            "--out", str(tmp_path / "out"), "--device", "cpu"]
    n = Ideogram4Family("unused", text_encoder=tiny_set["ideogram4_text_encoder"]).caption_token_limit(None).count(LONG)
    prompts.write_text(f"a red square\n{LONG}\n")
    assert generate.main(args) == 2
    assert capsys.readouterr().err.strip() == (f"error: {prompts}:2: prompt is {n} Qwen3-VL tokens; the encoder takes at "
                                               f"most 2048 and refuses longer ones")
    prompts.write_text(f"a red square --n {LONG}\n")
    assert generate.main(args) == 2
    assert capsys.readouterr().err.strip().endswith("text encoder loaded")
