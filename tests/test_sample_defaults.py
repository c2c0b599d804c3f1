"""Sample defaults against the reference pipelines: each family's default steps are its diffusers
pipeline's num_inference_steps default (read from the installed pipeline's signature)."""

import inspect
import re

import pytest

from library.models.family import family_class


def _pipeline_default(pipeline: str, argument: str = "num_inference_steps"):
    import diffusers

    return inspect.signature(getattr(diffusers, pipeline).__call__).parameters[argument].default


@pytest.mark.parametrize("model_type,pipeline", [
    ("qwen_image", "QwenImagePipeline"), ("qwen_image_edit", "QwenImageEditPlusPipeline"),
    ("qwen_image_layered", "QwenImageLayeredPipeline"), ("flux_kontext", "FluxKontextPipeline"),
    ("chroma", "ChromaPipeline"), ("zimage_omni", "ZImageOmniPipeline"), ("krea2", "Krea2Pipeline"),
    ("qwen_image21", "QwenImage21Pipeline"),
])
def test_default_steps_are_the_pipelines(model_type, pipeline):
    """Qwen-Image (and Edit, Layered) sampled 20 steps where the pipelines run 50, Kontext 20 for 28,
    Chroma 20 for 35."""
    assert family_class(model_type).sample_steps == _pipeline_default(pipeline)


def test_default_steps_of_flux_dev_and_flux2_dev_are_the_pipelines(tiny_set):
    """FLUX.1 [dev] 28 (FluxPipeline; 20 before), FLUX.2 [dev] 50 (Flux2Pipeline; 20 before): read from
    the checkpoint's guidance embedding."""
    assert family_class("flux")(tiny_set["flux_bfl"]).sample_steps == _pipeline_default("FluxPipeline") == 28
    assert family_class("flux2")(tiny_set["flux2_dev_tiny"]).sample_steps == _pipeline_default("Flux2Pipeline") == 50


def test_default_guidance_of_the_true_cfg_families_runs_cfg_with_the_empty_negative():
    """Qwen-Image samples with true CFG 4 and an empty negative by default, as musubi-tuner's
    qwen_image_generate_image (--guidance_scale 4.0, CFG wherever it is not 1) and its training samples
    (negative " ", cfg 4.0) do; QwenImagePipeline's true_cfg_scale default is the same 4 (it runs it only
    with a negative). The help says so."""
    from tools.generate import build_parser

    family = family_class("qwen_image")
    assert family.true_cfg and family.sample_guidance == _pipeline_default("QwenImagePipeline", "true_cfg_scale") == 4.0
    assert family("unused").unread_prompt_options("", family.sample_guidance) == {}
    help_text = " ".join(build_parser().format_help().split())
    assert "such a model runs CFG by default, with its model card's empty negative" in help_text
    assert "Qwen-Image: qwen-image 4, edit 4, layered 4" in help_text
    assert "Qwen-Image: qwen-image 50, edit 50, layered 50" in help_text


def test_qwen_image21_samples_without_cfg_as_its_pipeline():
    """QwenImage21Pipeline's true_cfg_scale default is 1.0 ("meant to be sampled without guidance"); samples ran
    CFG 4 against the empty negative (twice the transformer calls, another image)."""
    family = family_class("qwen_image21")
    assert family.sample_guidance == _pipeline_default("QwenImage21Pipeline", "true_cfg_scale") == 1.0
    assert set(family("unused").unread_prompt_options("blurry", family.sample_guidance)) == {"negative"}


def test_a_negative_that_no_cfg_reads_is_named_in_one_warning(tiny_set):
    """Z-Image Turbo (guidance 0: ZImagePipeline runs CFG only above 0) took --negative / --n and never
    read it, silently; Base reads it at its 5. Each unread option is one warning line naming the file."""
    from types import SimpleNamespace

    from library.models.family import warn_unread_prompt_options

    turbo = family_class("zimage")(tiny_set["zimage"], model_version="zimage-turbo")
    assert turbo.sample_guidance == 0.0
    assert set(turbo.unread_prompt_options("blurry", 0.0)) == {"negative"}
    assert turbo.unread_prompt_options("blurry", 5.0) == {} and turbo.unread_prompt_options("", 0.0) == {}
    qwen = family_class("qwen_image")("unused")  # CFG above 1, as QwenImagePipeline
    assert set(qwen.unread_prompt_options("blurry", 1.0)) == {"negative"} and qwen.unread_prompt_options("blurry", 4.0) == {}
    prompt = SimpleNamespace(prompt="a cat", negative="blurry", guidance=0.0, flow_shift=None)
    with pytest.warns(UserWarning) as caught:
        warn_unread_prompt_options(turbo, [prompt], "prompts.txt")
    (line,) = [str(w.message) for w in caught]
    assert line == ("prompts.txt: --n (--negative) is not read: model_type zimage runs CFG (the negative prompt) only at "
                    "guidance above 0, and this prompt's is 0")


def test_generate_warns_of_a_prompts_negative_and_guidance_the_model_does_not_read(tiny_set, tmp_path):
    """FLUX.1 dev has no CFG: a prompt's --n was dropped silently (the --negative flag is refused); a
    schnell checkpoint has no guidance input: a prompt's --g was dropped silently, and its --l (sd-scripts'
    CFG scale) is read by no model without CFG."""
    from tests.test_generate import generate_args, schnell_like
    from tools import generate

    with pytest.warns(UserWarning, match=r"--prompt: --n \(--negative\) is not read: model_type flux samples without"):
        assert generate.main(generate_args(tiny_set, tmp_path / "dev", "--prompt", "a red square --n blurry")) == 0
    schnell = schnell_like(tmp_path, tiny_set)[0][1]
    with pytest.warns(UserWarning) as caught:
        assert generate.main(generate_args(tiny_set, tmp_path / "schnell", "--model", schnell,
                                           "--prompt", "a red square --g 7 --l 7")) == 0
    said = [str(w.message) for w in caught]
    assert "--prompt: --l is not read: it is sd-scripts' CFG scale, and this model samples without CFG" in said
    assert any(re.match(r"--prompt: --g \(--guidance\) is not read: .*has no guidance embedding", m) for m in said)


def test_generate_samples_a_cfg_models_l_over_its_g(tiny_set, tmp_path):
    """sd-scripts' Chroma line '--l 4.0 --g 0.0' is CFG 4: the --g beside it was read (guidance 0, no CFG)."""
    from PIL import Image

    from tools import generate

    out = tmp_path / "gen"
    with pytest.warns(UserWarning, match=r"--prompt: --g is not read: --l is given and sets this model's guidance"):
        assert generate.main(["--model_type", "zimage", "--model", tiny_set["zimage"], "--ae", tiny_set["flux_vae"],
                              "--text_encoder", tiny_set["zimage_text_encoder"], "--prompt", "a red square --l 4 --g 0",
                              "--width", "32", "--height", "32", "--steps", "1", "--dtype", "fp32", "--out", str(out)]) == 0
    (png,) = out.glob("*.png")
    assert Image.open(png).text["guidance"] == "4.0"


def test_l_is_the_guidance_of_a_family_whose_guidance_is_a_cfg_scale(tiny_set):
    """sd-scripts' --l is the CFG scale, its --g FLUX.1's embedded guidance: a family reads --l where its one
    guidance is a CFG scale (true CFG; Ideogram 4's blend against its unconditional transformer), not where it
    is embedded (FLUX.1 dev, FLUX.2 dev) or unused (a step-distilled FLUX.2 [klein])."""
    cfg = ("qwen_image", "qwen_image_edit", "qwen_image_layered", "qwen_image21", "zimage", "zimage_omni", "chroma",
           "krea2", "krea2_edit", "ideogram4")
    assert [t for t in cfg if not family_class(t)("unused").guidance_is_cfg_scale()] == []
    assert not family_class("flux")(tiny_set["flux_bfl"]).guidance_is_cfg_scale()
    assert not family_class("flux_kontext")(tiny_set["flux_bfl"]).guidance_is_cfg_scale()
    assert not family_class("flux2")(tiny_set["flux2_dev_tiny"]).guidance_is_cfg_scale()
    assert family_class("flux2")(tiny_set["flux2_tiny"]).guidance_is_cfg_scale()  # [klein] base
