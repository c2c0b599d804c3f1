"""networks/lora_reader.py, the one LoRA reader: every tool that applies a LoRA (generate's --lora, the
trainer's network_weights and base_loras, merge_lora into either naming of a checkpoint, the precision
tools) reads every layout convert_lora reads, and applies the same deltas. Tiny FLUX.1 and Z-Image files
in each layout are built once per session (tests/conftest.py: flux_loras, zimage_loras; tests/lora_layouts.py);
each consumer's dense deltas are compared with the LoRA's own (float32 math on both sides). Another family's
LoRA: tests/test_lora_refusals.py."""

import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.io import CheckpointError
from networks import lora_files as lf
from networks.factory import network_from_file
from networks.lora import LoRANetwork
from tests.lora_layouts import (CONSUMERS, TOL, assert_same_deltas, dense, expected_in, generate_reads, merge_reads,
                                random_lora, randomized)
from tools import convert_lora, merge_lora
from tools.precision_doctor import read_lora_for


FLUX_CASES = ["kohya (ours)", "diffusers", "comfy", "kohya + text encoder (sd-scripts)", "PEFT base_model.model.",
              "ComfyUI dotted lora_down", "OneTrainer lora_transformer_ (diffusers names)", "lora_unet_ in diffusers names",
              "diffusers q / k / v with their own downs", "ComfyUI extraction (.diff_b beside)",
              "diffusers + text_encoder (diffusers pipeline)", "PEFT adapter name (raw state_dict)"]  # fmt: skip
ZIMAGE_CASES = ["kohya (ours)", "diffusers", "comfy", "kohya + text encoder (sd-scripts)", "PEFT base_model.model.",
                "ComfyUI dotted lora_down", "ComfyUI's own names (fused qkv, musubi-tuner)"]  # fmt: skip


def checkpoint_of(consumer: str):
    return {"merge_lora": "base.safetensors", "merge_lora into the other naming": "diffusers"}.get(consumer)


@pytest.mark.filterwarnings("ignore:.*text-encoder", "ignore:.*tensors beside the LoRA")
@pytest.mark.parametrize("arch, layout", [("flux", c) for c in FLUX_CASES] + [("zimage", c) for c in ZIMAGE_CASES])
@pytest.mark.parametrize("consumer", CONSUMERS)
def test_every_consumer_applies_every_layout_exactly(request, consumer, arch, layout):
    built = request.getfixturevalue(f"{arch}_loras")  # conftest.py: model, files and references
    path, reference = built["cases"][layout]
    got = CONSUMERS[consumer](built["model"], arch, path, built["root"])
    assert_same_deltas(got, expected_in(checkpoint_of(consumer), built["root"], reference))


def test_a_diffusers_lora_with_text_encoder_modules_loads_the_transformers(flux_loras, tmp_path):
    """diffusers' pipelines save a text encoder's LoRA under its component name (`text_encoder.text_model...`,
    CLIP-L for FLUX.1). The old reader took those for transformer modules: generate and network_weights stopped
    after the model loaded with "LoRA module 'text_encoder.text_model.encoder.layers.0.self_attn.q_proj' is not a
    Linear of this flux model". Now they are left out as sd-scripts' lora_te1_ are, with one warning; --to kohya
    leaves them out too (a kohya file holds sd-scripts' names only)."""
    from networks.lora_reader import check_lora_arch

    path, _ = flux_loras["cases"]["diffusers + text_encoder (diffusers pipeline)"]
    check_lora_arch(path, "flux")
    with pytest.warns(UserWarning) as said:
        network_from_file(flux_loras["model"], "flux", path)
    assert [str(w.message) for w in said] == [f"{path}: left out 1 text-encoder modules (diffusers text_encoder. x1): "
                                              f"they adapt the text encoders, not this network's model"]
    convert_lora.convert_lora(path, str(tmp_path / "k.safetensors"), "kohya")
    assert all(k.startswith("lora_unet_") for k in load_file(str(tmp_path / "k.safetensors")))


def test_peft_keys_with_an_adapter_name_read_without_it_and_two_adapters_are_one_line(flux_loras, tmp_path, capsys):
    """A raw model.state_dict() of a PEFT-wrapped model names each tensor `<module>.lora_A.default.weight`: every
    reader stopped with "LoRA key '...lora_A.default.weight': expected a name ending in .lora_down.weight ...".
    Now the adapter name is dropped where one name is on every lora_A / lora_B key (every consumer: FLUX_CASES),
    for a file, a state dict and lora_info alike; two adapters in one file are one line naming both."""
    from tools import lora_info

    path, reference = flux_loras["cases"]["PEFT adapter name (raw state_dict)"]
    tensors = load_file(path)
    assert (sum(".lora_A.default.weight" in k for k in tensors), len(reference)) == (20, 13)  # diffusers names: q / k / v split
    assert_same_deltas(dense(LoRANetwork.from_weights(flux_loras["model"], "flux", tensors).lora_weights()), reference)
    info = lora_info.read_info(path)
    plain = lora_info.read_info(flux_loras["cases"]["diffusers"][0])
    assert (info["format"], info["arch"], info["modules"]) == (plain["format"], "flux", plain["modules"]) == ("diffusers", "flux", 20)
    dora = ["x.lora_A.mine.weight", "x.lora_B.mine.weight", "x.lora_magnitude_vector.mine.weight"]  # peft's saved names
    assert lf.adapter_name_dropped(dora) == dict(zip(dora, ["x.lora_A.weight", "x.lora_B.weight", "x.lora_magnitude_vector"]))
    two = {**tensors, **{k.replace(".default.", ".style."): v.clone() for k, v in tensors.items() if "single_transformer_blocks" in k}}
    mixed = {**tensors, "transformer.proj_out.lora_A.weight": torch.ones(4, 64), "transformer.proj_out.lora_B.weight": torch.ones(64, 4)}
    for name, bad, line in (("two", two, "holds the PEFT adapters 'default', 'style' (keys like "),
                            ("mixed", mixed, "key 'transformer.proj_out.lora_A.weight' has no adapter name beside keys of "
                                             "the PEFT adapter 'default'")):
        save_file(bad, str(tmp_path / f"{name}.safetensors"))
        assert merge_lora.main(["--model", str(flux_loras["root"] / "base.safetensors"), "--lora", str(tmp_path / f"{name}.safetensors"),
                                "--save_to", str(tmp_path / "m.safetensors")]) == 2
        error = capsys.readouterr().err.strip()
        assert error.startswith(f"error: {tmp_path / name}.safetensors: {line}") and "\n" not in error, error
        with pytest.raises(CheckpointError, match="^" + re.escape(f"state dict: {line}")):
            LoRANetwork.from_weights(flux_loras["model"], "flux", bad)


def test_onetrainers_flux1_t5_lora_te2_is_called_t5_where_a_file_is_described(flux_loras, tmp_path, capsys):
    """OneTrainer writes FLUX.1's T5-XXL LoRA as lora_te2_ (its text_encoder_2; CLIP-L lora_te1_). Every line
    that said what a file holds called it CLIP-G (sd-scripts' SDXL name): lora_info, generate's and merge_lora's
    warnings, the refusal of text encoders alone. Now FLUX.1's and Chroma's say T5-XXL (the family's
    LoRAFiles.text_encoders); the modules stay left out, and the generic name stays for other files."""
    from networks.lora_reader import check_lora_arch
    from tools import lora_info

    te = {f"{m}.{part}": t for m, n in (("lora_te1_text_model_encoder_layers_0_mlp_fc1", 8), ("lora_te2_encoder_block_0_layer_0_SelfAttention_q", 32))
          for part, t in (("lora_down.weight", torch.ones(4, n)), ("lora_up.weight", torch.ones(n, 4)), ("alpha", torch.tensor(4.0)))}
    path, t5_only = str(tmp_path / "ot.safetensors"), str(tmp_path / "t5.safetensors")
    save_file({**load_file(flux_loras["cases"]["OneTrainer lora_transformer_ (diffusers names)"][0]), **te}, path)
    save_file({k: v for k, v in te.items() if k.startswith("lora_te2_")}, t5_only)
    note = "2 text-encoder modules (CLIP-L lora_te1_ x1, T5-XXL lora_te2_ x1)"
    assert lora_info.read_info(path)["text_encoders"] == note
    with pytest.warns(UserWarning) as said:
        network_from_file(flux_loras["model"], "flux", path)
    assert [str(w.message) for w in said] == [f"{path}: left out {note}: they adapt the text encoders, not this network's model"]
    assert merge_lora.main(["--model", str(flux_loras["root"] / "base.safetensors"), "--lora", path, "--save_to", str(tmp_path / "m.safetensors")]) == 0
    assert f"skipped {note}: they adapt the text encoders" in capsys.readouterr().err
    for arch in ("flux", "chroma"):
        with pytest.raises(CheckpointError, match=re.escape(f"{t5_only}: holds only 1 text-encoder modules (T5-XXL lora_te2_ x1)")):
            check_lora_arch(t5_only, arch)
    assert lf.text_encoder_note(te) == "2 text-encoder modules (CLIP-L lora_te1_ x1, CLIP-G lora_te2_ x1)"


def test_a_comfyui_extracted_lora_reads_its_down_up_and_says_what_it_leaves_out(flux_loras, tmp_path):
    """ComfyUI's Extract and Save Lora writes a `.diff_b` per bias (bias_diff, on by default) beside the down/up
    modules. The old readers took the file for LyCORIS' full type: generate said "LyCORIS module 'diffusion_model'
    names no module of this model", network_weights asked for network_module lycoris.kohya, lora_info said "full
    in lycoris layout". OneTrainer's embeddings bundled with a LoRA (`bundle_emb.<name>.t5`) stopped every reader
    with "LoRA key 'bundle_emb...': expected a name ending in .lora_down.weight ...". Now the LoRA loads and one
    line counts what is left out; lora_info says it too."""
    from tools import lora_info

    path, _ = flux_loras["cases"]["ComfyUI extraction (.diff_b beside)"]
    with pytest.warns(UserWarning) as said:
        network_from_file(flux_loras["model"], "flux", path)
    assert [str(w.message) for w in said] == [f"{path}: left out 13 tensors beside the LoRA (bias deltas .diff_b x13): "
                                              f"a LoRA network applies the down/up modules only (merge_lora, generate.py and "
                                              f"base_loras add them)"]
    info = lora_info.read_info(path)
    assert (info["format"], info["network"], info["beside_lora"]) == ("comfy", "LoRA", "13 tensors beside the LoRA (bias deltas .diff_b x13)")
    assert ("also in the file: 13 tensors beside the LoRA (bias deltas .diff_b x13) (merge_lora, generate.py and base_loras "
            "add .diff / .diff_b as ComfyUI does, resize_lora keeps them, combine_loras sums them; network_weights and "
            "convert_lora leave them out)") in lora_info.text_report(info).splitlines()
    bundled = str(tmp_path / "onetrainer.safetensors")
    save_file({**load_file(flux_loras["cases"]["OneTrainer lora_transformer_ (diffusers names)"][0]),
               "bundle_emb.mystyle.clip_l": torch.ones(2, 8), "bundle_emb.mystyle.t5": torch.ones(2, 32)}, bundled)
    with pytest.warns(UserWarning) as said:
        assert len(network_from_file(flux_loras["model"], "flux", bundled).lora_modules()) == 13
    assert [str(w.message) for w in said] == [f"{bundled}: left out 2 tensors beside the LoRA (OneTrainer's bundled "
                                              f"embeddings bundle_emb. x2): a LoRA network applies the down/up modules only"]


def test_a_lora_whose_names_tell_no_family_is_read_by_its_modules(flux_loras, tmp_path):
    """Attention projections alone (`transformer_blocks.0.attn.to_q`: FLUX.1 and Qwen-Image both have them)
    tell no architecture: the reader does not refuse them, the model's modules decide."""
    path, reference = flux_loras["cases"]["diffusers"]
    tensors = {k: v for k, v in load_file(path).items() if k.startswith(tuple(f"transformer.transformer_blocks.0.attn.to_{c}." for c in "qkv"))}
    save_file(tensors, str(tmp_path / "attn.safetensors"))
    got = generate_reads(flux_loras["model"], "flux", str(tmp_path / "attn.safetensors"), flux_loras["root"])
    assert list(got) == ["double_blocks.0.img_attn.qkv"]
    assert (got["double_blocks.0.img_attn.qkv"] - reference["double_blocks.0.img_attn.qkv"]).abs().max() <= TOL


def test_network_weights_rebuilds_a_fused_module_at_the_rank_of_its_split_parts(flux_loras):
    """q / k / v with their own downs (rank 4 each) are exactly one fused qkv LoRA of rank 12: the network
    (rank 4) rebuilds those modules at 12 and says so; the old reader stopped with "has down (12, 64) ...
    the network expects (4, 64)"."""
    path, _ = flux_loras["cases"]["diffusers q / k / v with their own downs"]
    net = LoRANetwork(flux_loras["model"], "flux", rank=4, alpha=2)
    net.apply()
    counts = net.load_weights(path, strict=False)
    ranks = {m.name: m.rank for m in net.lora_modules()}
    assert ranks["double_blocks.0.img_attn.qkv"] == 12 and ranks["double_blocks.0.img_attn.proj"] == 4
    assert ranks["single_blocks.0.linear1"] == 16  # q, k, v and proj_mlp
    assert "3 rebuilt at the rank of their fused / split form" in LoRANetwork.describe_loaded(counts)
    modules = dict(flux_loras["model"].named_modules())
    assert modules["double_blocks.0.img_attn.qkv"].forward.__self__ is next(m for m in net.lora_modules() if m.name == "double_blocks.0.img_attn.qkv")
    net.remove()


def test_precision_tools_refuse_a_dora_file_they_would_apply_as_plain_lora(flux_loras, tmp_path):
    """read_lora_for dropped the DoRA magnitude and applied up @ down as a plain LoRA (silently another
    weight: m * (W + dW) / ||W + dW|| is not W + dW); the runtime and merged columns add plain deltas, so it is refused."""
    net = random_lora(flux_loras["model"], "flux", dora=True)
    net.save(str(tmp_path / "dora.safetensors"))
    with pytest.raises(CheckpointError, match=r"dora.safetensors: LoRA module '.*' is DoRA; the precision tools apply "
                                              r"and merge plain LoRAs"):
        read_lora_for(flux_loras["model"], "flux", str(tmp_path / "dora.safetensors"))


def test_merge_reads_a_diffusers_named_lora_into_a_single_file_in_the_models_own_names(tmp_path):
    """Krea 2's single file has the model's own names and no module map of its own (merge_lora's Base): a
    diffusers-named LoRA (convert_lora --to diffusers of ours) found no weight ("no LoRA module matches a weight
    of the krea2 checkpoint"); the reader sizes the architecture's map from the LoRA, as convert_lora does."""
    from library.models.krea2.checkpoint import save_krea2_single_file
    from library.models.krea2.tiny import random_krea2, tiny_config

    model = random_krea2(tiny_config()).eval()
    save_krea2_single_file(model, str(tmp_path / "base.safetensors"), tiny_config())
    net = random_lora(model, "krea2")
    net.save(str(tmp_path / "ours.safetensors"))
    convert_lora.convert_lora(str(tmp_path / "ours.safetensors"), str(tmp_path / "d.safetensors"), "diffusers")
    got = merge_reads("base.safetensors")(model, "krea2", str(tmp_path / "d.safetensors"), tmp_path)
    assert_same_deltas(got, dense(net.lora_weights()))


@pytest.mark.parametrize("to", ["diffusers", "comfy"])
def test_a_dora_file_in_another_layout_loads_as_the_same_dora(flux_loras, tmp_path, to):
    """DoRA's magnitude is per output row: split into to_q / to_k / to_v by convert_lora --to diffusers and
    joined back by the reader, magnitude and down are the same tensors (bitwise) and (alpha / r) up the same
    within 1e-6 (the diffusers and ComfyUI layouts fold alpha into up)."""
    net = random_lora(flux_loras["model"], "flux", dora=True)
    net.save(str(tmp_path / "dora.safetensors"))
    convert_lora.convert_lora(str(tmp_path / "dora.safetensors"), str(tmp_path / f"{to}.safetensors"), to)
    path = str(tmp_path / f"{to}.safetensors")
    resumed = LoRANetwork(flux_loras["model"], "flux", rank=4, alpha=2, network_args={"dora": True})  # network_weights
    resumed.load_weights(path, strict=False)
    for loaded in (network_from_file(flux_loras["model"], "flux", path), resumed):  # generate, network_weights
        got = {m.name: m.weights() for m in loaded.lora_modules()}
        for module, want in net.lora_weights().items():
            w = got[module]
            assert torch.equal(w.magnitude, want.magnitude) and torch.equal(w.down, want.down), module
            assert (w.up.float() * w.scale - want.up.float() * want.scale).abs().max() <= 1e-6 * want.up.abs().max()


def test_network_weights_rebuilds_a_dora_qkv_joined_from_parts_with_their_own_downs(flux_loras, tmp_path):
    """DoRA normalises per output row, so diffusers' to_q / to_k / to_v DoRA with their own downs is exactly
    one fused DoRA of the summed rank: the merged qkv weight is the row-concatenation of each part's."""
    net = random_lora(flux_loras["model"], "flux", dora=True)
    net.save(str(tmp_path / "dora.safetensors"))
    convert_lora.convert_lora(str(tmp_path / "dora.safetensors"), str(tmp_path / "d.safetensors"), "diffusers")
    tensors, g = load_file(str(tmp_path / "d.safetensors")), torch.Generator().manual_seed(4)
    for c in "kv":  # to_q keeps the shared down, to_k and to_v get their own
        key = f"transformer.transformer_blocks.0.attn.to_{c}.lora_A.weight"
        tensors[key] = torch.randn(tensors[key].shape, generator=g)
    save_file(tensors, str(tmp_path / "own.safetensors"), metadata={lf.FOLDED_MARK: "true"})
    resumed = LoRANetwork(flux_loras["model"], "flux", rank=4, alpha=2, network_args={"dora": True})
    assert resumed.load_weights(str(tmp_path / "own.safetensors"), strict=False)["resized"] >= 1
    qkv = next(m for m in resumed.lora_modules() if m.name == "double_blocks.0.img_attn.qkv")
    weight = dict(flux_loras["model"].named_modules())["double_blocks.0.img_attn.qkv"].weight
    parts = lf.parse_lora({k: v for k, v in tensors.items() if ".transformer_blocks.0.attn.to_" in k and "add" not in k})[0]
    want = torch.cat([parts[f"transformer_blocks.0.attn.to_{c}"].merged(w) for c, w in zip("qkv", weight.chunk(3))])
    assert qkv.rank == 12 and (qkv.weights().merged(weight) - want).abs().max() <= 1e-5 * want.abs().max()


def test_a_lora_on_comfyuis_fused_gate_up_applies_by_rows_in_every_runtime_consumer(tmp_path):
    """Qwen-Image-2.1's released file fuses the SwiGLU gate_up (gate rows first); ComfyUI / ai-toolkit LoRAs
    name it so. convert_lora read it; generate and network_weights said "not a Linear of this model"."""
    from library.models.qwen_image21.model import QwenImage21
    from library.models.qwen_image21.tiny import tiny_config as qwen21_config

    model = randomized(QwenImage21(qwen21_config()), 3)
    gate = dict(model.named_modules())["transformer_blocks.1.img_mlp.gate_layer"]
    g = torch.Generator().manual_seed(5)
    down, up = torch.randn(4, gate.in_features, generator=g), torch.randn(2 * gate.out_features, 4, generator=g)
    save_file({"diffusion_model.transformer_blocks.1.img_mlp.gate_up.lora_A.weight": down,
               "diffusion_model.transformer_blocks.1.img_mlp.gate_up.lora_B.weight": up}, str(tmp_path / "c.safetensors"))
    half = gate.out_features
    want = {"transformer_blocks.1.img_mlp.gate_layer": up[:half] @ down, "transformer_blocks.1.img_mlp.proj": up[half:] @ down}
    for consumer in ("generate", "network_weights", "base_loras", "precision_tools"):
        assert_same_deltas(CONSUMERS[consumer](model, "qwen_image21", str(tmp_path / "c.safetensors"), tmp_path), want)


def test_split_downs_on_our_fused_flux_give_diffusers_output(flux_loras):
    """The oracle diffusers itself: its FluxTransformer2DModel (the same weights, split to_q / to_k / to_v)
    with the split-downs file loaded by load_lora_weights (its PEFT layers, alpha from the header) gives the
    output of our fused model with the file read by generate's reader (rank 12 qkv, 16 linear1). Most of its
    time alone is importing diffusers' pipelines (~15 s, once per session: test_merge_convert imports them too)."""
    from diffusers import FluxPipeline, FluxTransformer2DModel

    from library.models.flux1.model import make_img_ids, make_txt_ids

    path, _ = flux_loras["cases"]["diffusers q / k / v with their own downs"]
    theirs = FluxTransformer2DModel.from_pretrained(str(flux_loras["root"] / "diffusers")).eval()
    pipe = FluxPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
                        transformer=theirs)  # fmt: skip
    g = torch.Generator().manual_seed(2)
    img, txt, y = torch.randn(1, 16, 64, generator=g), torch.randn(1, 8, 32, generator=g), torch.randn(1, 16, generator=g)
    sigma, img_ids = torch.tensor([0.4]), make_img_ids(1, 4, 4)

    def outputs():
        with torch.no_grad():
            mine = flux_loras["model"](img, img_ids, txt, make_txt_ids(1, 8), sigma, y)
            reference = theirs(hidden_states=img, encoder_hidden_states=txt, pooled_projections=y, timestep=sigma,
                               img_ids=img_ids[0].float(), txt_ids=torch.zeros(8, 3), return_dict=False)[0]  # fmt: skip
        return mine, reference

    base, base_reference = outputs()
    assert (base - base_reference).abs().max() <= 1e-4
    net = network_from_file(flux_loras["model"], "flux", path)
    net.apply()
    pipe.load_lora_weights(path)
    try:
        mine, reference = outputs()
    finally:
        net.remove()
    assert (mine - base).abs().max() > 0.1  # the LoRA shows
    assert (mine - reference).abs().max() <= 1e-4 * reference.abs().max()


def test_a_module_in_the_file_twice_in_two_namings_is_refused_not_one_silently_kept(tmp_path):
    """Z-Image's ComfyUI fused qkv beside our split to_q: until 2026-11-27 the reader kept to_q cut from the
    qkv rows and dropped the file's own to_q without a word (and a FLUX.1 BFL qkv beside a diffusers to_q
    became a qkv of to_q alone)."""
    from library.models.zimage.model import ZImage
    from library.models.zimage.tiny import tiny_config
    from networks.lora_reader import read_for_model

    model = ZImage(tiny_config())
    paths = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    q = dict(model.named_modules())["layers.0.attention.to_q"]
    g = torch.Generator().manual_seed(0)

    def lora(rows):
        return lf.LoRAWeights(torch.randn(4, q.in_features, generator=g), torch.randn(rows, 4, generator=g), 4.0)

    lf.write_kohya({"layers.0.attention.to_q": lora(q.out_features), "layers.0.attention.qkv": lora(3 * q.out_features)},
                   str(tmp_path / "twice.safetensors"))
    with pytest.raises(CheckpointError, match=r"twice.safetensors: module 'layers.0.attention.to_q' is in the file "
                                              r"twice, in two namings"):
        read_for_model(str(tmp_path / "twice.safetensors"), "zimage", paths)
    lf.write_kohya({"layers.0.attention.to_k": lora(q.out_features), "layers.0.attention.qkv": lora(3 * q.out_features)},
                   str(tmp_path / "apart.safetensors"))
    with pytest.raises(CheckpointError, match="'layers.0.attention.to_k' is in the file twice"):
        read_for_model(str(tmp_path / "apart.safetensors"), "zimage", paths)
