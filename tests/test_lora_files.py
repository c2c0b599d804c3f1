"""LoRA files: the network's kohya save and load, format detection, kohya <-> PEFT / diffusers conversion, alphas
read from headers and the metadata written."""

import json

import pytest
import torch
from safetensors import safe_open

from library.io import CheckpointError
from networks import lora_files as lf
from networks.lora_module_map import bfl_to_diffusers, diffusers_to_bfl
from networks.lora import LoRANetwork
from tests.test_lora import StandIn, assert_same_deltas, flux_names, llm_names, qwen_names, randomize


def test_kohya_save_load_round_trip_is_bytes_equal(tmp_path):
    model = StandIn(flux_names(2, 2))
    net = LoRANetwork(model, "flux", rank=4, alpha=1, network_args={"attn_dim": 8})
    randomize(net)
    path = str(tmp_path / "lora.safetensors")
    metadata = lf.build_metadata(steps=10, max_steps=12, base_model="/abs/dir/flux1-dev.safetensors")
    net.save(path, dtype=torch.bfloat16, metadata=metadata)
    with safe_open(path, "pt") as f:
        keys, meta = set(f.keys()), f.metadata()
        stored = {k: f.get_tensor(k) for k in keys}
    assert keys == set(net.state_dict())
    assert "lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight" in keys
    assert stored["lora_unet_single_blocks_1_linear2.alpha"].dtype == torch.float32
    assert stored["lora_unet_single_blocks_1_linear2.lora_up.weight"].dtype == torch.bfloat16
    assert meta["ss_network_dim"] == "4" and meta["ss_network_alpha"] == "1.0"
    assert (meta["ss_steps"], meta["ss_max_train_steps"]) == ("10", "12")
    assert meta["ss_sd_model_name"] == "flux1-dev.safetensors"
    assert json.loads(meta["ss_network_args"]) == {"attn_dim": 8}
    assert meta["sshs_model_hash"] == lf.tensor_hash(stored)

    fresh = LoRANetwork(StandIn(flux_names(2, 2)), "flux", rank=4, alpha=3, network_args={"attn_dim": 8})
    fresh.load_weights(path)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value.to(stored[key].dtype), stored[key]), key
    assert fresh.lora_modules()[0].scale == 1 / 8  # alpha comes from the file

    net.save(path)  # float32: bitwise equal to the live parameters
    fresh.load_weights(path)
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), net.state_dict().values()))


def test_a_rank_0_module_is_one_line_naming_it_not_a_division_by_zero(tmp_path, capsys):
    """A pruned file's empty down / up pair: convert_lora (and every reader) ended in a ZeroDivisionError
    traceback (alpha / rank); lora_info said "ranks: 0"."""
    from safetensors.torch import save_file

    from tools import convert_lora

    name = "lora_unet_double_blocks_0_img_attn_proj"
    path = tmp_path / "r0.safetensors"
    save_file({f"{name}.lora_down.weight": torch.zeros(0, 64), f"{name}.lora_up.weight": torch.zeros(64, 0),
               f"{name}.alpha": torch.tensor(1.0)}, str(path))
    assert convert_lora.main([str(path), str(tmp_path / "out.safetensors"), "--to", "diffusers",
                              "--model_type", "flux"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: {path}: module '{name}' has rank 0 (down (0, 64), up (64, 0)): no LoRA there; drop its tensors "
        f"from the file"]
    assert not (tmp_path / "out.safetensors").exists()


def test_load_weights_rejects_foreign_or_misshapen_modules(tmp_path):
    net = LoRANetwork(StandIn(llm_names(1)), "llm", rank=2)
    wrong_in = {k: (torch.zeros(2, 9) if k.endswith("lora_down.weight") else v) for k, v in net.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"model.layers.0.self_attn.q_proj' has down \(2, 9\)"):
        net.load_weights(wrong_in)
    wrong_rank = {k: (torch.zeros(3, 8) if k.endswith("lora_down.weight") else v) for k, v in net.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"'lora_te_model_layers_0_self_attn_q_proj' down \(3, 8\) / up \(6, 2\)"):
        net.load_weights(wrong_rank)
    foreign = dict(net.state_dict())
    # an LLM name (the reader knows them), no tensors
    foreign["lora_te_model_layers_7_mlp_up_proj.alpha"] = torch.tensor(1.0)
    with pytest.raises(CheckpointError, match="module 'lora_te_model_layers_7_mlp_up_proj' has no down weight"):
        net.load_weights(foreign)
    foreign.update({"lora_te_model_layers_7_mlp_up_proj.lora_down.weight": torch.zeros(2, 8),
                    "lora_te_model_layers_7_mlp_up_proj.lora_up.weight": torch.zeros(8, 2)})
    with pytest.raises(CheckpointError, match="module 'model.layers.7.mlp.up_proj' is not a Linear of this llm model"):
        net.load_weights(foreign)  # a layer this model lacks
    foreign = {**net.state_dict(), "lora_te_vision_proj.lora_down.weight": torch.zeros(2, 8),
               "lora_te_vision_proj.lora_up.weight": torch.zeros(8, 2)}
    with pytest.raises(CheckpointError, match="'lora_te_vision_proj' matches no module"):
        net.load_weights(foreign)  # a name of no LLM


def test_resolve_kohya_names_uses_module_paths():
    paths = ["double_blocks.0.img_attn.qkv", "transformer_blocks.1.attn.to_out.0", "model.layers.0.mlp.up_proj"]
    names = [lf.kohya_name(p) for p in paths[:2]] + ["lora_te_model_layers_0_mlp_up_proj"]
    assert lf.resolve_kohya_names(names, paths) == dict(zip(names, paths))
    with pytest.raises(CheckpointError, match="lora_unet_double_blocks_0_img_attn_proj"):
        lf.resolve_kohya_names(["lora_unet_double_blocks_0_img_attn_proj"], paths)


def test_detect_format():
    assert lf.detect_format(["lora_unet_a_b.lora_down.weight", "lora_unet_a_b.alpha"]) == "kohya"
    assert lf.detect_format(["transformer.a.b.lora_A.weight", "transformer.a.b.lora_B.weight"]) == "peft"
    assert lf.detect_format(["diffusion_model.a.b.lora_down.weight", "diffusion_model.a.b.alpha"]) == "comfy"
    with pytest.raises(CheckpointError, match="'x.lora_magnitude'"):
        lf.detect_format(["x.lora_magnitude"])


def random_weights(paths_and_shapes, rank=4, alpha=2.0):
    return {p: lf.LoRAWeights(torch.randn(rank, i), torch.randn(o, rank), alpha)
            for p, (i, o) in paths_and_shapes.items()}


def test_kohya_to_peft_to_kohya_round_trip_flux(tmp_path):
    from library.models.flux1.checkpoint import flux_diffusers_module_map

    h, m = 8, 32
    module_map = flux_diffusers_module_map(1, 1, h, m)
    bfl = random_weights({"double_blocks.0.img_attn.qkv": (h, 3 * h), "double_blocks.0.txt_mlp.0": (h, m),
                          "single_blocks.0.linear1": (h, 3 * h + m), "single_blocks.0.linear2": (h + m, h)}, alpha=4.0)
    lf.write_kohya(bfl, str(tmp_path / "k.safetensors"))
    read, _, fmt = lf.read_lora(str(tmp_path / "k.safetensors"), module_paths=module_map)
    assert fmt == "kohya"
    diffusers = bfl_to_diffusers(read, module_map)
    assert set(diffusers) >= {"transformer_blocks.0.attn.to_k", "single_transformer_blocks.0.proj_mlp",
                              "transformer_blocks.0.ff_context.net.0.proj"}
    assert torch.equal(diffusers["single_transformer_blocks.0.proj_mlp"].up, bfl["single_blocks.0.linear1"].up[3 * h :])
    lf.write_peft(diffusers, str(tmp_path / "p.safetensors"))
    peft, _, fmt = lf.read_lora(str(tmp_path / "p.safetensors"))
    assert fmt == "peft" and "transformer_blocks.0.attn.to_q" in peft
    back = diffusers_to_bfl(peft, module_map)
    assert_same_deltas(bfl, back, tol=1e-6)
    # alpha == rank: nothing is folded, and the round trip is exact
    exact = diffusers_to_bfl(lf.parse_lora(lf.peft_state_dict(bfl_to_diffusers(
        {k: lf.LoRAWeights(w.down, w.up, 4.0) for k, w in bfl.items()}, module_map)))[0], module_map)
    assert all(torch.equal(exact[k].down, bfl[k].down) and torch.equal(exact[k].up, bfl[k].up) for k in bfl)


def test_flux_diffusers_to_bfl_with_separate_downs_is_block_diagonal():
    h = 4
    module_map = {"double_blocks.0.img_attn.qkv": [("q", 0, h), ("k", h, 2 * h), ("v", 2 * h, 3 * h)]}
    parts = {"q": lf.LoRAWeights(torch.randn(2, h), torch.randn(h, 2), 1.0),
             "v": lf.LoRAWeights(torch.randn(3, h), torch.randn(h, 3), 6.0)}  # no LoRA on k
    fused = diffusers_to_bfl(parts, module_map)["double_blocks.0.img_attn.qkv"]
    assert fused.rank == 5 and fused.scale == 1.0
    delta = fused.delta()
    assert (delta[:h] - parts["q"].delta()).abs().max() < 1e-6
    assert delta[h : 2 * h].abs().max() == 0
    assert (delta[2 * h :] - parts["v"].delta()).abs().max() < 1e-6


def test_kohya_to_peft_to_kohya_round_trip_qwen(tmp_path):
    model = StandIn(qwen_names(1))
    net = LoRANetwork(model, "qwen_image", rank=4, alpha=1)
    randomize(net)
    lf.write_peft(net.lora_weights(), str(tmp_path / "p.safetensors"), dtype=torch.float32)
    peft, _, _ = lf.read_lora(str(tmp_path / "p.safetensors"))
    lf.write_kohya(peft, str(tmp_path / "k.safetensors"))
    back, _, _ = lf.read_lora(str(tmp_path / "k.safetensors"), module_paths=[n for n, _ in model.named_modules()])
    assert_same_deltas(net.lora_weights(), back, tol=1e-6)
    again = LoRANetwork(StandIn(qwen_names(1)), "qwen_image", rank=4)
    again.load_weights(str(tmp_path / "p.safetensors"))  # PEFT with the model's own names loads too
    assert_same_deltas(net.lora_weights(), again.lora_weights(), tol=1e-6)


def test_peft_alpha_from_diffusers_adapter_metadata():
    tensors = {"transformer.a.lora_A.weight": torch.randn(4, 8), "transformer.a.lora_B.weight": torch.randn(6, 4),
               "transformer.b.to_q.lora_A.weight": torch.randn(4, 8),
               "transformer.b.to_q.lora_B.weight": torch.randn(6, 4)}
    config = {"transformer.r": 4, "transformer.lora_alpha": 2, "transformer.alpha_pattern": {"to_q": 8}}
    weights, _ = lf.parse_lora(tensors, {lf.ADAPTER_METADATA_KEY: json.dumps(config)})
    assert weights["a"].alpha == 2 and weights["b.to_q"].alpha == 8
    assert lf.parse_lora(tensors)[0]["a"].alpha == 4  # no metadata: alpha = rank


def test_a_pipeline_saves_transformer_and_text_encoder_alphas_are_each_its_own():
    """diffusers' pipeline save_lora_weights with a text encoder's LoRA: keys under transformer. and text_encoder.,
    each component's config under its name. Old: no common prefix, so no header key was found: every module read
    PEFT's default 8 (resize_lora and combine_loras wrote half the delta, lora_info said alpha 8)."""
    r = 4
    tensors = {f"{m}.lora_{ab}.weight": torch.randn(*((r, 8) if ab == "A" else (6, r)))
               for m in ("transformer.a.to_q", "transformer.b", "text_encoder.q_proj") for ab in "AB"}
    config = {"transformer.r": r, "transformer.lora_alpha": 16, "transformer.alpha_pattern": {"to_q": 2},
              "text_encoder.r": r, "text_encoder.lora_alpha": 32, "text_encoder.use_rslora": True}
    weights, fmt = lf.parse_lora(tensors, {lf.ADAPTER_METADATA_KEY: json.dumps(config)})
    alphas = {m: w.alpha for m, w in weights.items()}
    assert fmt == "peft"
    assert alphas == {"transformer.a.to_q": 2, "transformer.b": 16, "text_encoder.q_proj": 32 * r**0.5}


def test_a_stored_alpha_of_zero_reads_as_the_rank(tmp_path):
    """sd-scripts' LoRAModule (networks/lora.py, lora_flux.py) reads alpha 0 as alpha = rank (scale 1);
    ComfyUI (weight_adapter/lora.py) takes it literally (scale 0). We follow sd-scripts: the old reader
    applied alpha 0, so such a LoRA's delta was 0 (scale 0 / 4) in generate, network_weights and merges."""
    tensors = {"lora_unet_a.lora_down.weight": torch.randn(4, 8), "lora_unet_a.lora_up.weight": torch.randn(6, 4),
               "lora_unet_a.alpha": torch.tensor(0.0)}
    assert lf.parse_lora(tensors)[0]["lora_unet_a"].scale == 1.0
    model = StandIn(flux_names(1, 1))
    net = LoRANetwork(model, "flux", rank=4, alpha=2, select=False)
    name = lf.kohya_name("double_blocks.0.img_attn.qkv")
    net.load_weights({f"{name}.lora_down.weight": torch.randn(4, 8), f"{name}.lora_up.weight": torch.randn(6, 4),
                      f"{name}.alpha": torch.tensor(0.0)}, strict=False)
    assert [m.scale for m in net.lora_modules()] == [1.0]


def test_build_metadata_is_all_strings_without_absolute_paths():
    meta = lf.build_metadata(network_dim=16, lr=1e-4, resolution=(1024, 768), base_precision="fp8_scaled",
                             dataset={"image_dir": "/home/me/secret/images", "repeats": 2}, shift=3.1, optimizer=None)
    assert all(isinstance(v, str) for v in meta.values()) and "ss_optimizer" not in meta
    assert meta["ss_resolution"] == "[1024, 768]" and meta["ss_learning_rate"] == "0.0001"
    assert json.loads(meta["ss_datasets"]) == {"image_dir": "images", "repeats": 2}
    with pytest.raises(ValueError, match="unknown field 'lr_warmup'"):
        lf.build_metadata(lr_warmup=3)


def test_build_metadata_cuts_a_relative_model_path_to_its_name_and_keeps_a_hub_id(tmp_path, monkeypatch):
    """ss_sd_model_name held a relative pretrained_model_name_or_path whole ('learned/flux/...', '../x/...'):
    only absolute paths were cut. sd-scripts writes the basename of any path that exists; a hub id stays."""
    (tmp_path / "models" / "flux").mkdir(parents=True)
    (tmp_path / "models" / "flux" / "flux1-tiny.safetensors").write_bytes(b"")
    monkeypatch.chdir(tmp_path / "models")
    for given in ("flux/flux1-tiny.safetensors", "../models/flux/flux1-tiny.safetensors", "flux/"):
        expected = "flux" if given == "flux/" else "flux1-tiny.safetensors"
        assert lf.build_metadata(base_model=given)["ss_sd_model_name"] == expected, given
    for kept in ("black-forest-labs/FLUX.1-dev", "flux1-dev.safetensors"):
        assert lf.build_metadata(base_model=kept)["ss_sd_model_name"] == kept
    meta = lf.build_metadata(network_args=["train_blocks=single", "flux"], optimizer="AdamW (betas=0.9,0.99)")
    assert (json.loads(meta["ss_network_args"]), meta["ss_optimizer"]) == (["train_blocks=single", "flux"],
                                                                             "AdamW (betas=0.9,0.99)")
