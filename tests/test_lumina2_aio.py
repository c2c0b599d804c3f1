"""Neta Lumina's / NetaYume Lumina's all-in-one ComfyUI checkpoint (NetaYumev35_pretrained_all_in_one.safetensors) as
the transformer, the text encoder and the VAE at once: the tiny set's three files under the released file's prefixes
(the transformer under `model.diffusion_model.`, Gemma 2 under `text_encoders.gemma2_2b.transformer.` beside
`text_encoders.gemma2_2b.logit_scale` and `.spiece_model`, FLUX.1's VAE under `vae.` in BFL's names), Gemma's
tokenizer/ beside it. Each component loads from it bit-equal to its own file; train_lora.py trains with all three
paths = that file; merge_lora into it merges the transformer as into its own file and copies the other components'
tensors byte for byte, whatever --save_precision says."""

import shutil

import pytest
import torch
from safetensors import safe_open

import train_lora
from library.io import CheckpointError, CheckpointReader, save_safetensors
from library.models.flux1.vae import FluxVAE
from library.models.lumina2.checkpoint import load_lumina2
from library.models.lumina2.family import Lumina2Family
from library.models.lumina2.text_encoder import load_lumina2_text_encoder
from tests.test_train_lora import read_losses

TRANSFORMER, GEMMA, VAE = "model.diffusion_model.", "text_encoders.gemma2_2b.transformer.", "vae."
OTHERS = ("text_encoders.", VAE)  # the tensors merge_lora must copy as stored


@pytest.fixture(scope="module")
def all_in_one(tiny_set, tmp_path_factory) -> str:
    """The tiny all-in-one file (module docstring) with tokenizer/ beside it. Its metadata carries the tiny VAE's
    `diffusers_config` (the released file has none: FLUX.1's VAE config is the loader's default)."""
    folder = tmp_path_factory.mktemp("lumina2_aio")
    transformer = CheckpointReader(tiny_set["lumina2"])
    gemma = CheckpointReader(tiny_set["lumina2_gemma2_single_file"])
    vae = CheckpointReader(tiny_set["flux_vae_single"])
    tensors = {TRANSFORMER + k: v for k, v in transformer.items()}  # bf16, with the unused norm_final.weight
    tensors.update({GEMMA + k: v for k, v in gemma.items() if k != "spiece_model"})  # float32 `model.*`
    tensors["text_encoders.gemma2_2b.logit_scale"] = torch.tensor(4.6052)  # ComfyUI's ln(100)
    tensors["text_encoders.gemma2_2b.spiece_model"] = gemma.get("spiece_model")  # a uint8 stand-in
    tensors.update({VAE + k: v for k, v in vae.items()})  # float32, BFL's names (decoder.mid.block_1 ...)
    path = str(folder / "lumina2_all_in_one.safetensors")
    save_safetensors(tensors, path, metadata={"diffusers_config": vae.metadata["diffusers_config"]})
    shutil.copytree(tiny_set["lumina2_tokenizer"], folder / "tokenizer")
    return path


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_each_component_loads_from_the_all_in_one_file_as_from_its_own(tiny_set, all_in_one):
    transformer = load_lumina2(all_in_one, dtype=torch.float32)
    assert transformer.config == load_lumina2(tiny_set["lumina2"]).config
    assert same_tensors(transformer.state_dict(), load_lumina2(tiny_set["lumina2"]).state_dict())

    encoder = load_lumina2_text_encoder(all_in_one, dtype=torch.float32)  # tokenizer/ beside it
    own = load_lumina2_text_encoder(tiny_set["lumina2_gemma2_single_file"], dtype=torch.float32)
    assert encoder.llm.config == own.llm.config and len(encoder.llm.model.layers) == 2  # hidden_states[-2] of 3
    assert same_tensors(encoder.llm.state_dict(), own.llm.state_dict())
    hidden, mask = encoder.encode(["a red square"], "sys")
    want, want_mask = own.encode(["a red square"], "sys")
    assert torch.equal(mask, want_mask) and torch.equal(hidden, want) and hidden.abs().max() > 0.1

    vae = FluxVAE(all_in_one)
    assert same_tensors(vae.vae.state_dict(), FluxVAE(tiny_set["flux_vae_single"]).vae.state_dict())
    images = torch.rand(1, 3, 32, 32) * 2 - 1
    assert torch.equal(vae.encode(images), FluxVAE(tiny_set["flux_vae_single"]).encode(images))

    family = Lumina2Family(all_in_one, all_in_one, text_encoder=all_in_one)
    family.check_model_files()  # the markers found under the prefixes; Gemma's width 64 = the caption width
    assert family.text_encoder_weights()[0].params > 0


def test_the_all_in_one_file_without_a_tokenizer_beside_it_is_one_error(tiny_set, all_in_one, tmp_path):
    alone = tmp_path / "all_in_one.safetensors"
    shutil.copyfile(all_in_one, alone)
    with pytest.raises(CheckpointError, match="tokenizer"):
        load_lumina2_text_encoder(str(alone), dtype=torch.float32)


@pytest.fixture(scope="module")
def trained_on_all_in_one(tiny_set, all_in_one, tmp_path_factory):
    out = tmp_path_factory.mktemp("lumina2_aio_run")
    assert train_lora.main([
        "--model_type", "lumina2", "--pretrained_model_name_or_path", all_in_one, "--ae", all_in_one,
        "--text_encoder", all_in_one, "--dataset_config", tiny_set["dataset_config"], "--output_dir", str(out),
        "--output_name", "aio", "--max_train_steps", "2", "--mixed_precision", "no", "--network_dim", "4",
        "--network_alpha", "4", "--optimizer_type", "AdamW", "--learning_rate", "3e-2", "--save_every_n_steps", "0",
    ]) == 0
    return out


def test_lora_trains_with_the_all_in_one_file_as_all_three_paths(trained_on_all_in_one):
    losses = read_losses(trained_on_all_in_one, "aio")
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))


def read(path: str) -> dict[str, torch.Tensor]:
    with safe_open(path, "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


@pytest.mark.parametrize("precision", [None, "bf16", "fp8"])
def test_merge_into_the_all_in_one_file_keeps_the_other_components_as_stored(tiny_set, all_in_one,
                                                                             trained_on_all_in_one, tmp_path,
                                                                             precision):
    """The merged transformer equals the merge into its own file (fp8: ComfyUI's scaled layout, its scales and marker
    under `model.diffusion_model.`); Gemma and the VAE (float32), logit_scale and the uint8 spiece_model come out
    bit-equal, also where --save_precision bf16 / fp8 casts the transformer (they came out bf16 before)."""
    from tools import merge_lora

    lora = str(trained_on_all_in_one / "aio.safetensors")
    args = ["--save_precision", precision] if precision else []
    merged, own = str(tmp_path / "merged_aio.safetensors"), str(tmp_path / "merged_own.safetensors")
    assert merge_lora.main(["--model", all_in_one, "--lora", f"{lora}:0.7", "--save_to", merged, *args]) == 0
    assert merge_lora.main(["--model", tiny_set["lumina2"], "--lora", f"{lora}:0.7", "--save_to", own, *args]) == 0
    base, out, want = read(all_in_one), read(merged), read(own)
    others = {k for k in base if k.startswith(OTHERS)}
    assert len(others) == 36 + 1 + 176  # Gemma's tensors and logit_scale + spiece_model, the VAE's
    assert same_tensors({k: v for k, v in out.items() if k.startswith(OTHERS)}, {k: base[k] for k in others})
    assert same_tensors({k[len(TRANSFORMER) :]: v for k, v in out.items() if k.startswith(TRANSFORMER)}, want)
    if precision is None:  # the file's bf16 kept: only the merged weights differ from the base
        changed = [k for k in want if not torch.equal(want[k], base[TRANSFORMER + k])]
        assert len(changed) == 10  # the LoRA's qkv / out / w1-w3 of both layers


def test_bundled_prefixes_are_read_from_the_header_and_ambiguous_ones_refused():
    from library.models.llm import bundled_llm_prefix
    from library.models.vae import bundled_vae_prefix

    gemma = [GEMMA + "model.layers.0.mlp.up_proj.weight", "text_encoders.gemma2_2b.logit_scale"]
    assert bundled_llm_prefix(gemma) == GEMMA and bundled_llm_prefix(["model.layers.0.mlp.up_proj.weight"]) == ""
    t5 = "text_encoders.t5xxl.transformer.encoder.block.0.layer.0.SelfAttention.q.weight"
    assert bundled_llm_prefix(gemma + [t5]) == GEMMA  # a T5 beside it is no language model
    with pytest.raises(CheckpointError, match=r"ckpt: .*text_encoders.t5xxl.transformer.\) with no language model"):
        bundled_llm_prefix([t5], "ckpt")
    qwen = "text_encoders.qwen25_7b.transformer.model.layers.0.mlp.up_proj.weight"
    with pytest.raises(CheckpointError, match="more than one language model"):
        bundled_llm_prefix(gemma + [qwen], "ckpt")
    assert bundled_vae_prefix(["vae.encoder.conv_out.weight", "vae.decoder.conv_out.weight"]) == VAE
    assert bundled_vae_prefix(["encoder.conv_out.weight", "decoder.conv_out.weight"]) == ""
    with pytest.raises(CheckpointError, match="'first_stage_model.' and 'vae.': one VAE per file"):
        bundled_vae_prefix(["vae.encoder.conv_out.weight", "first_stage_model.encoder.conv_out.weight"], "ckpt")
