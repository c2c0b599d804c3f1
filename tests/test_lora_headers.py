"""The header entries that name the model a LoRA was trained on, as each trainer spells them: ours and
sd-scripts' ss_base_model_version, modelspec.architecture (sd-scripts' and musubi-tuner's sai_model_spec,
written alone by musubi-tuner), ai-toolkit's ss_base_model_version (its get_base_model_version). Oracle:
the values those trainers' sources write, and merge_lora's answer to an ss_base_model_version header."""

import pytest

from networks.lora import LoRANetwork
from networks.lora_arch import header_arch
from tools import merge_lora
from tools.lora_common import load_model

WRITTEN = [  # (key, value as written, our architecture)
    ("modelspec.architecture", "flux-1-dev/lora", "flux"),  # sd-scripts
    ("modelspec.architecture", "chroma/lora", "chroma"),  # sd-scripts
    ("modelspec.architecture", "Flux.1-dev/lora", "flux"),  # musubi-tuner (Kontext)
    ("modelspec.architecture", "Flux.2-klein-4b/lora", "flux2"),
    ("modelspec.architecture", "Qwen-Image-Edit-2511/lora", "qwen_image"),
    ("modelspec.architecture", "Z-Image/lora", "zimage"),
    ("modelspec.architecture", "Krea-2/lora", "krea2"),
    ("modelspec.architecture", "Ideogram-4/lora", "ideogram4"),
    ("ss_base_model_version", "flux.1", "flux"),  # ai-toolkit
    ("ss_base_model_version", "flux2_klein_4b", "flux2"),
    ("ss_base_model_version", "qwen_image", "qwen_image"),
    ("ss_base_model_version", "zimage", "zimage"),
    ("ss_base_model_version", "krea2", "krea2"),
    ("ss_base_model_version", "ideogram4", "ideogram4"),
    ("ss_base_model_version", "zimage-turbo", "zimage"),  # ours
    ("ss_base_model_version", "krea2-raw", "krea2"),
]


@pytest.mark.parametrize("key, value, arch", WRITTEN)
def test_the_header_names_the_architecture_in_every_trainers_spelling(key, value, arch):
    """Z-Image's, Krea 2's headers (ours, ai-toolkit's, musubi-tuner's) and musubi-tuner's Ideogram-4 named
    no architecture: their specs listed no model_versions (Ideogram 4: its own spelling only)."""
    assert header_arch({key: value}) == arch


SPELLED = [  # (header value, our architecture): releases in spellings that no model_versions entry lists as such
    ("flux_1-dev", "flux"), ("FLUX-2-dev/lora", "flux2"), ("krea_2-raw", "krea2"), ("Z Image/lora", "zimage"),
    ("qwen_image_2.1", "qwen_image21"), ("Qwen-Image-2512/lora", "qwen_image"), ("qwen_image_2512", "qwen_image"),
]


@pytest.mark.parametrize("value, arch", SPELLED)
def test_the_header_names_the_architecture_by_the_merges_rule_of_spelling(value, arch):
    """header_arch compared the lower-cased header with the families' model_versions as listed, while the merge's
    version check (same_release) read every spelling alike: 'flux_1-dev' named no architecture, 'qwen_image_2.1'
    Qwen-Image's, and Qwen-Image-2.1's prefix 'qwen-image-2' took Qwen-Image-2512's LoRAs. Now both ask
    lora_arch.begins_release, and Qwen-Image-2.1's prefix is its release, qwen-image-2.1."""
    assert header_arch({"ss_base_model_version": value}) == arch


def _merge(tiny_set, tmp_path, capsys, header: dict) -> tuple[int, str]:
    model, family, _ = load_model(tiny_set["flux_bfl"])
    lora = tmp_path / "lora.safetensors"
    LoRANetwork(model, family, rank=2).save(str(lora), metadata=header)
    capsys.readouterr()
    code = merge_lora.main(["--model", tiny_set["flux_bfl"], "--lora", str(lora), "--save_to", str(tmp_path / "m.safetensors")])
    return code, capsys.readouterr().err.strip()


def test_merge_reads_modelspec_architecture_where_ss_base_model_version_is_absent(tiny_set, tmp_path, capsys):
    """merge_lora's version check read ss_base_model_version only: a FLUX.1-named LoRA whose modelspec.architecture
    said Qwen-Image merged silently (with ss_base_model_version 'qwen-image': merged, warned 'the same architecture,
    another release'), and 'flux-1-schnell/lora' into FLUX.1-dev said nothing. Now the header's architecture comes
    from the families' model_versions, either key refuses the first in the same line, and both warn for the second;
    ai-toolkit's 'flux.1' (a prefix of flux1-dev once spelled alike) warned 'another release' and now passes."""
    lines = {}
    for key, value in (("ss_base_model_version", "qwen-image"), ("modelspec.architecture", "Qwen-Image/lora")):
        code, err = _merge(tiny_set, tmp_path, capsys, {key: value})
        assert code == 2 and "\n" not in err, err
        lines[key] = err.replace(f"{key} '{value}'", "HEADER")
    assert lines["ss_base_model_version"] == lines["modelspec.architecture"]
    assert lines["modelspec.architecture"] == (
        f"error: {tmp_path / 'lora.safetensors'}: a Qwen-Image LoRA (HEADER) and the base {tiny_set['flux_bfl']} is "
        f"FLUX.1 ('flux1-dev'): its deltas were learned on other weights; merge it into a Qwen-Image checkpoint")
    for key, value in (("ss_base_model_version", "flux1-schnell"), ("modelspec.architecture", "flux-1-schnell/lora")):
        code, err = _merge(tiny_set, tmp_path, capsys, {key: value})
        said = f"warning: {tmp_path / 'lora.safetensors'}: trained on '{value}' ({key}), merged into 'flux1-dev'"
        assert code == 0 and said in err, err
    code, err = _merge(tiny_set, tmp_path, capsys, {"ss_base_model_version": "flux.1"})
    assert code == 0 and "warning" not in err, err
