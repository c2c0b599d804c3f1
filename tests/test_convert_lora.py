"""tools/convert_lora.py on tiny real models: kohya <-> diffusers / comfy round trips, the layout a converted
file says it came from, refusals (LyCORIS, names of no module, fp16 overflow) and overwrites."""

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from library.models.flux1.model import Flux
from library.models.flux1.checkpoint import flux_diffusers_module_map, load_flux
from library.models.qwen_image.model import QwenImage
from networks import lora_files as lf
from networks.lora_module_map import bfl_to_diffusers
from networks.lora import LoRANetwork
from tools import convert_lora
from tests.test_merge_convert import (  # noqa: F401 (flux_bfl: the module's fixture, shared)
    FLUX_CFG, QWEN_CFG, _foreign_lora, flux_bfl, flux_inputs, lora, merge, only_line, read_all, run,
    runtime_output)


def convert(*argv) -> int:
    return convert_lora.main([str(a) for a in argv])


def deltas_match(a: dict, b: dict, tol=1e-6):
    assert set(a) == set(b)
    for p in a:
        ref = a[p].delta()
        assert (b[p].delta() - ref).abs().max() <= tol * ref.abs().max(), p


def test_flux_kohya_to_diffusers_to_kohya_round_trip(flux_bfl, tmp_path):
    root, _, _, b = flux_bfl  # rank 2, alpha 8, attention, MLP, single and modulation Linears
    assert convert(root / "b.safetensors", tmp_path / "d.safetensors", "--to", "diffusers") == 0
    diffusers, meta, fmt = lf.read_lora(str(tmp_path / "d.safetensors"))
    assert fmt == "peft" and meta[convert_lora.FOLDED_MARK] == "true" and meta["ss_network_dim"] == "2"
    assert {"transformer_blocks.0.attn.to_k", "transformer_blocks.0.norm1_context.linear", "single_transformer_blocks.0.proj_mlp"} <= set(diffusers)
    module_map = flux_diffusers_module_map(1, 1, 64, 256)
    deltas_match(bfl_to_diffusers(b.lora_weights(), module_map), diffusers)
    assert convert(tmp_path / "d.safetensors", tmp_path / "k.safetensors", "--to", "kohya", "--alpha", "8") == 0
    back, _, fmt = lf.read_lora(str(tmp_path / "k.safetensors"), module_paths=module_map)
    assert fmt == "kohya" and all(w.alpha == 8.0 and w.rank == 2 for w in back.values())
    deltas_match(b.lora_weights(), back)
    fresh = LoRANetwork(Flux(FLUX_CFG), "flux", rank=2, network_args={"train_modulation": True})
    fresh.load_weights(str(tmp_path / "k.safetensors"))  # the converted file loads into the trainer's network
    deltas_match(b.lora_weights(), fresh.lora_weights())


def test_qwen_kohya_to_diffusers_to_kohya_round_trip(tmp_path):
    net = lora(QwenImage(QWEN_CFG), "qwen_image", rank=4, alpha=2.0, seed=10, mod_dim=2)
    net.save(str(tmp_path / "q.safetensors"))
    assert convert(tmp_path / "q.safetensors", tmp_path / "d.safetensors", "--to", "diffusers") == 0
    with safe_open(str(tmp_path / "d.safetensors"), framework="pt") as f:
        assert "transformer.transformer_blocks.0.img_mod.1.lora_A.weight" in f.keys()
    assert convert(tmp_path / "d.safetensors", tmp_path / "k.safetensors", "--to", "kohya") == 0
    back, _, _ = lf.read_lora(str(tmp_path / "k.safetensors"), module_paths=[m.name for m in net.lora_modules()])
    assert all(w.alpha == w.rank for w in back.values())  # alpha was folded into up on the way
    deltas_match(net.lora_weights(), back)


def test_peft_file_without_alpha_converts_as_scale_one_with_a_warning(tmp_path, capsys):
    # block 3: Nucleus-Image's dense blocks 0-2 have Qwen-Image's img_mlp.net names (its markers leave them out)
    weights = {"transformer_blocks.3.img_mlp.net.2": lf.LoRAWeights(torch.randn(4, 128), torch.randn(32, 4), 8.0)}
    save_file(lf.peft_state_dict({p: lf.LoRAWeights(w.down, w.up, 4.0) for p, w in weights.items()}), str(tmp_path / "p.safetensors"))
    capsys.readouterr()
    assert convert(tmp_path / "p.safetensors", tmp_path / "k.safetensors", "--to", "kohya") == 0
    assert "scale is unknown" in capsys.readouterr().err
    unscaled, _, _ = lf.read_lora(str(tmp_path / "k.safetensors"), module_paths=list(weights))
    assert unscaled["transformer_blocks.3.img_mlp.net.2"].alpha == 4.0  # alpha = rank
    # the same tensors with diffusers' adapter config in the header: alpha 8 is read, no warning
    config = {"r": 4, "lora_alpha": 8, "target_modules": ["net.2"]}
    tensors = dict(read_all(tmp_path / "p.safetensors"))
    save_file(tensors, str(tmp_path / "m.safetensors"), metadata={lf.ADAPTER_METADATA_KEY: json.dumps(config)})
    assert convert(tmp_path / "m.safetensors", tmp_path / "k2.safetensors", "--to", "kohya", "--model_type", "qwen_image") == 0
    assert "unknown" not in capsys.readouterr().err
    scaled, _, _ = lf.read_lora(str(tmp_path / "k2.safetensors"), module_paths=list(weights))
    deltas_match(weights, scaled)


def test_a_converted_file_says_the_layout_it_came_from(tmp_path, capsys):
    """A ComfyUI file (lora_A / lora_B under diffusion_model., as --to comfy writes it) converted to kohya was
    stamped lora_converted_from = "peft" and printed "peft -> kohya"; a diffusers file's said "peft" too."""
    from tools import lora_info

    m = "lora_unet_double_blocks_0_img_attn_proj"
    save_file({f"{m}.lora_down.weight": torch.randn(2, 64), f"{m}.lora_up.weight": torch.randn(64, 2),
               f"{m}.alpha": torch.tensor(1.0)}, str(tmp_path / "k.safetensors"))
    for layout in ("comfy", "diffusers"):
        assert convert(tmp_path / "k.safetensors", tmp_path / f"{layout}.safetensors", "--to", layout) == 0
        assert lora_info.read_info(str(tmp_path / f"{layout}.safetensors"))["format"] == layout
        capsys.readouterr()
        back = (tmp_path / f"{layout}.safetensors", tmp_path / f"{layout}_k.safetensors")
        assert convert(*back, "--to", "kohya", "--model_type", "flux") == 0  # attention alone: no arch by the names
        assert f"flux LoRA: {layout} -> kohya, 1 modules" in capsys.readouterr().out
        with safe_open(str(tmp_path / f"{layout}_k.safetensors"), "pt") as f:
            assert f.metadata()["lora_converted_from"] == layout


def test_convert_errors_are_one_line_exit_2(tmp_path, capsys):
    attn_only = {"transformer.transformer_blocks.0.attn.to_q.lora_A.weight": torch.randn(2, 8),
                 "transformer.transformer_blocks.0.attn.to_q.lora_B.weight": torch.randn(8, 2)}  # fmt: skip
    save_file(attn_only, str(tmp_path / "attn.safetensors"))
    capsys.readouterr()
    assert convert(tmp_path / "attn.safetensors", tmp_path / "o.safetensors", "--to", "kohya") == 2
    assert "pass --model_type" in only_line(capsys.readouterr().err)
    assert convert(tmp_path / "nope.safetensors", tmp_path / "o.safetensors", "--to", "kohya") == 2
    assert "no such file" in only_line(capsys.readouterr().err)
    assert convert(tmp_path / "attn.safetensors", tmp_path / "o.safetensors", "--to", "diffusers", "--alpha", "4") == 2
    assert "--alpha" in only_line(capsys.readouterr().err)
    # Old: inf rescaled every lora_up to 0 and 1e-45 to inf, both written with exit status 0
    for alpha, said in (("inf", "must be a finite number > 0"), ("1e-45", "overflows float32")):
        assert convert(tmp_path / "attn.safetensors", tmp_path / "o.safetensors", "--to", "kohya", "--model_type",
                       "qwen_image", "--alpha", alpha) == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]  # after the warning that the file's alpha is unknown
        assert last.startswith("error: ") and said in last, last
    assert not os.path.exists(tmp_path / "o.safetensors")


def test_a_lycoris_refusal_names_the_files_own_kind_and_keys(tmp_path, capsys):
    """A LoHa file's refusal named LoKr's lokr_w1 as its keys (the line was one text for every LyCORIS kind)."""
    m = "lora_unet_double_blocks_0_img_attn_qkv"
    loha = {f"{m}.hada_w{i}_{ab}": torch.randn(8, 2) if ab == "a" else torch.randn(2, 8) for i in (1, 2) for ab in "ab"}
    lokr = {f"{m}.lokr_w1": torch.randn(2, 2), f"{m}.lokr_w2": torch.randn(4, 4)}
    for name, tensors, said, kind in (("loha", loha, "hada_w1_a", "LoHa"), ("lokr", lokr, "lokr_w1", "LoKr")):
        save_file({**tensors, f"{m}.alpha": torch.tensor(2.0)}, str(tmp_path / f"{name}.safetensors"))
        capsys.readouterr()
        assert convert(tmp_path / f"{name}.safetensors", tmp_path / "o.safetensors", "--to", "diffusers") == 2
        line = only_line(capsys.readouterr().err)
        assert f"a LyCORIS file ({kind}) has no kohya/diffusers LoRA form: its own keys (lora_unet_*.{said} ...)" in line
    assert not os.path.exists(tmp_path / "o.safetensors")


def test_convert_never_overwrites_its_input_and_writes_safetensors_names_only(flux_bfl, tmp_path, capsys):
    import shutil

    root, *_ = flux_bfl
    src = tmp_path / "a.safetensors"
    shutil.copy(root / "a.safetensors", src)
    before = src.read_bytes()
    llm = _foreign_lora(tmp_path)  # a kohya LLM LoRA: converts to a PEFT folder
    cases = [
        ([src, src, "--to", "diffusers"], f"output {src}: is one of the inputs; write the result elsewhere"),
        ([src, tmp_path / "a.txt", "--to", "comfy"], f"output {tmp_path / 'a.txt'}: expected a .safetensors file"),
        ([llm, tmp_path / "p.safetensors", "--to", "peft"], "--to peft writes a PEFT adapter folder; expected a folder name"),
        ([llm, tmp_path, "--to", "peft"], f"output {tmp_path}: is or holds the input {llm}"),
    ]
    for argv, message in cases:
        capsys.readouterr()
        assert convert(*argv) == 2
        line = only_line(capsys.readouterr().err)
        assert line.startswith("error: ") and message in line, line
    assert src.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["a.safetensors", "llm_lora.safetensors"]
    assert convert(llm, tmp_path / "adapter", "--to", "peft") == 0
    capsys.readouterr()
    assert convert(tmp_path / "adapter", tmp_path / "adapter" / "adapter_model.safetensors", "--to", "kohya") == 2
    assert "is one of the inputs" in only_line(capsys.readouterr().err)
    assert convert(llm, tmp_path / "adapter", "--to", "peft") == 0  # a PEFT folder: replaced by the new one
    # A folder of other files was replaced whole, its files deleted (os.replace of atomic_folder).
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "base.safetensors").write_bytes(b"keep")
    capsys.readouterr()
    assert convert(llm, tmp_path / "models", "--to", "peft") == 2
    assert "a folder of other files (no adapter_config.json)" in only_line(capsys.readouterr().err)
    assert os.listdir(tmp_path / "models") == ["base.safetensors"]


def test_a_lora_under_model_diffusion_model_is_a_lora_not_a_lycoris_full_file(flux_bfl, tmp_path):
    """`.diffusion_model` starts with `.diff`, LyCORIS' full-weight key: a ComfyUI-layout LoRA under
    `model.diffusion_model.` reads as a LoRA in every tool (it was taken for a LyCORIS file)."""
    from tools import lora_info, resize_lora

    root, _, a, _ = flux_bfl
    tensors = {f"model.diffusion_model.{p}.{part}": t for p, w in a.lora_weights().items()
               for part, t in (("lora_down.weight", w.down), ("lora_up.weight", w.up), ("alpha", torch.tensor(w.alpha)))}
    src = tmp_path / "mdm.safetensors"
    save_file(tensors, str(src))
    got = lora_info.read_info(str(src))
    assert (got["format"], got["network"], got["arch"]) == ("comfy", "LoRA", "flux")
    assert convert(src, tmp_path / "k.safetensors", "--to", "kohya") == 0
    deltas_match(a.lora_weights(), lf.read_lora(str(tmp_path / "k.safetensors"), module_paths=list(a.lora_weights()))[0])
    assert resize_lora.main(["--lora", str(src), "--save_to", str(tmp_path / "r.safetensors"), "--new_rank", "4"]) == 0
    deltas_match(a.lora_weights(), lf.read_lora(str(tmp_path / "r.safetensors"))[0], tol=1e-5)
    assert merge("--model", root / "base.safetensors", "--lora", src, "--save_to", tmp_path / "m.safetensors") == 0
    assert merge("--model", root / "base.safetensors", "--lora", root / "a.safetensors", "--save_to", tmp_path / "n.safetensors") == 0
    assert all(torch.equal(t, read_all(tmp_path / "n.safetensors")[k]) for k, t in read_all(tmp_path / "m.safetensors").items())


def _with_text_encoders(root, tmp_path, prefixes=("lora_te1_", "lora_te3_")):
    """a.safetensors plus sd-scripts' FLUX.1 text-encoder modules (lora_flux.py: lora_te1_ CLIP-L, lora_te3_ T5-XXL)."""
    tensors = read_all(root / "a.safetensors")
    names = {"lora_te1_": "lora_te1_text_model_encoder_layers_0_self_attn_q_proj",
             "lora_te3_": "lora_te3_encoder_block_0_layer_0_SelfAttention_q"}
    for p in prefixes:
        tensors.update({f"{names[p]}.lora_down.weight": torch.randn(4, 32), f"{names[p]}.lora_up.weight": torch.randn(32, 4),
                        f"{names[p]}.alpha": torch.tensor(2.0)})
    path = tmp_path / f"te{len(prefixes)}.safetensors"
    save_file(tensors, str(path))
    return path


def test_sd_scripts_text_encoder_modules_are_named_kept_by_kohya_and_skipped_by_merge(flux_bfl, tmp_path, capsys):
    from tools import lora_info

    root, model, a, _ = flux_bfl
    both, clip_only = _with_text_encoders(root, tmp_path), _with_text_encoders(root, tmp_path, ("lora_te1_",))
    got = lora_info.read_info(str(both))
    assert got["arch"] == "flux" and got["text_encoders"] == "2 text-encoder modules (CLIP-L lora_te1_ x1, T5-XXL lora_te3_ x1)"
    capsys.readouterr()
    assert convert(clip_only, tmp_path / "d.safetensors", "--to", "diffusers") == 0  # CLIP-L is no LLM module
    assert "left out 1 text-encoder modules (CLIP-L lora_te1_ x1)" in only_line(capsys.readouterr().err)
    assert convert(both, tmp_path / "k.safetensors", "--to", "kohya") == 0
    kept = read_all(tmp_path / "k.safetensors")
    assert torch.equal(kept["lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_up.weight"],
                       read_all(both)["lora_te3_encoder_block_0_layer_0_SelfAttention_q.lora_up.weight"])
    assert merge("--model", root / "base.safetensors", "--lora", both, "--save_to", tmp_path / "m.safetensors") == 0
    assert "skipped 2 text-encoder modules (CLIP-L lora_te1_ x1, T5-XXL lora_te3_ x1)" in only_line(capsys.readouterr().err)
    assert (run(load_flux(str(tmp_path / "m.safetensors")), flux_inputs()) - runtime_output(model, [(a, 1.0)], flux_inputs())).abs().max() <= 1e-5
    with pytest.warns(UserWarning, match="left out 2 text-encoder modules"):
        net = LoRANetwork.from_weights(Flux(FLUX_CFG), "flux", str(both))
    deltas_match(a.lora_weights(), net.lora_weights())
    tensors = read_all(both)
    tensors["lora_te9_x.lora_down.weight"], tensors["lora_te9_x.lora_up.weight"] = torch.randn(1, 4), torch.randn(4, 1)
    save_file(tensors, str(tmp_path / "odd.safetensors"))
    assert convert(tmp_path / "odd.safetensors", tmp_path / "o.safetensors", "--to", "kohya") == 2
    assert "LoRA module 'lora_te9_x' is neither kohya" in only_line(capsys.readouterr().err)


def test_the_runtime_reader_reads_other_trainers_names(flux_bfl, tmp_path):
    """OneTrainer / SimpleTuner name FLUX.1 modules `lora_transformer_<diffusers path>`: the network's reader
    (generate, network_weights) reads them as convert_lora does (networks/lora_reader.py). The old reader
    refused them and said to convert the file first."""
    root, _, a, _ = flux_bfl
    diffusers = bfl_to_diffusers(a.lora_weights(), flux_diffusers_module_map(1, 1, 64, 256))
    lf.write_kohya(diffusers, str(tmp_path / "ot.safetensors"), prefix="lora_transformer")
    deltas_match(a.lora_weights(), LoRANetwork.from_weights(Flux(FLUX_CFG), "flux", str(tmp_path / "ot.safetensors")).lora_weights())


def modules_of(path) -> list[str]:
    return sorted({k.rsplit(".lora_", 1)[0] for k in read_all(path)})


def test_a_headerless_ai_toolkit_ideogram4_lora_converts_its_attention_o_to_to_out(tmp_path, capsys):
    """ai-toolkit's Ideogram 4 LoRAs name the blocks' attention `qkv` (Z-Image's ComfyUI name too) and `o` (Ideogram
    4's only). Without a header the file read as Z-Image: --to diffusers wrote `transformer.layers.0.attention.o`,
    which Ideogram4Pipeline.load_lora_weights drops as unexpected (exit 0), the kohya-named form matched no module,
    and lora_info said 'arch: unknown'. Now `o` tells Ideogram 4; Z-Image's `attention.out` still reads as Z-Image."""
    from tools import lora_info

    d, r, g = 64, 2, torch.Generator().manual_seed(0)
    rows = {"attention.qkv": 3 * d, "attention.o": d, "attention.out": d}

    def lora_of(names, key):  # key(module) -> the module's name in the file
        return {f"{key(m)}.{part}.weight": torch.randn(*shape, generator=g) for m in names
                for part, shape in (("lora_A", (r, d)), ("lora_B", (rows[m.split(".", 2)[2]], r)))}

    ideogram = [f"layers.{i}.attention.{m}" for i in range(2) for m in ("qkv", "o")]
    save_file(lora_of(ideogram, lambda m: f"diffusion_model.{m}"), str(tmp_path / "aitk.safetensors"))
    kohya = {k.replace(".lora_A.", ".lora_down.").replace(".lora_B.", ".lora_up."): v
             for k, v in lora_of(ideogram, lambda m: "lora_unet_" + m.replace(".", "_")).items()}
    save_file(kohya, str(tmp_path / "aitk_kohya.safetensors"))
    want = [f"transformer.layers.{i}.attention.{m}" for i in range(2) for m in ("to_k", "to_out.0", "to_q", "to_v")]
    for name in ("aitk", "aitk_kohya"):
        assert convert(tmp_path / f"{name}.safetensors", tmp_path / f"{name}_d.safetensors", "--to", "diffusers") == 0
        assert capsys.readouterr().out.startswith("ideogram4 LoRA:")
        assert modules_of(tmp_path / f"{name}_d.safetensors") == want
        got = lora_info.read_info(str(tmp_path / f"{name}.safetensors"))
        assert (got["arch"], got["naming"], got["width"]) == ("ideogram4", "original", d)
    zimage = [f"layers.{i}.attention.{m}" for i in range(2) for m in ("qkv", "out")]  # ComfyUI's Z-Image names
    save_file(lora_of(zimage, lambda m: f"diffusion_model.{m}"), str(tmp_path / "zimage.safetensors"))
    assert convert(tmp_path / "zimage.safetensors", tmp_path / "zimage_d.safetensors", "--to", "diffusers") == 0
    assert capsys.readouterr().out.startswith("zimage LoRA:")
    assert modules_of(tmp_path / "zimage_d.safetensors") == want


@pytest.mark.parametrize("to", ["diffusers", "comfy"])
def test_a_dotted_name_of_no_module_is_refused_as_its_kohya_name_is(tmp_path, capsys, to):
    """A diffusers-layout file naming `layers.0.attention.bogus_proj` converted with exit 0 and wrote the bogus
    name (only kohya names were checked against the model's modules); now it is one line naming the module."""
    tensors = {f"transformer.layers.0.attention.{m}.lora_{p}.weight": torch.randn(*s)
               for m in ("to_q", "bogus_proj") for p, s in (("A", (4, 64)), ("B", (64, 4)))}
    save_file(tensors, str(tmp_path / "bogus.safetensors"))
    capsys.readouterr()
    assert convert(tmp_path / "bogus.safetensors", tmp_path / "o.safetensors", "--to", to, "--model_type", "zimage") == 2
    line = only_line(capsys.readouterr().err)
    assert "'transformer.layers.0.attention.bogus_proj' matches no module of the model" in line, line
    assert not os.path.exists(tmp_path / "o.safetensors")


@pytest.mark.parametrize("to", ["diffusers", "comfy"])
def test_an_fp16_lora_b_that_folding_alpha_overflows_is_refused(tmp_path, capsys, to):
    """alpha / rank folded into an fp16 lora_B (256 / 2 times ~1000) was written as inf with exit 0; now one line,
    as --alpha refuses the same overflow."""
    g = torch.Generator().manual_seed(0)
    save_file({"lora_unet_layers_0_attention_to_q.lora_down.weight": torch.randn(2, 64, generator=g).half(),
               "lora_unet_layers_0_attention_to_q.lora_up.weight": (torch.randn(64, 2, generator=g) * 1000).half(),
               "lora_unet_layers_0_attention_to_q.alpha": torch.tensor(256.0)}, str(tmp_path / "fp16.safetensors"))
    capsys.readouterr()
    assert convert(tmp_path / "fp16.safetensors", tmp_path / "o.safetensors", "--to", to, "--model_type", "zimage") == 2
    line = only_line(capsys.readouterr().err)
    assert line.startswith(f"error: {tmp_path / 'fp16.safetensors'}: module layers.0.attention.to_q") and "overflows float16" in line
    assert not os.path.exists(tmp_path / "o.safetensors")
