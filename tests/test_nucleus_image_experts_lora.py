"""Nucleus-Image's `experts` LoRA type: the routed experts' packed weights (img_mlp.experts.gate_up_proj / down_proj,
networks/lora_packed.py), off by default and on with experts_dim. PEFT itself (a LoraConfig with target_parameters
injected into diffusers' NucleusMoEImageTransformer2DModel, our factors under its keys) computes our output; a tiny
training run with experts_dim saves a file that loads back and that lora_info names; merge_lora adds each expert's
delta to the packed weights (into fp8 outputs and bases: tests/test_merge_experts_fp8.py); convert_lora writes
the expert modules in PEFT's layout."""

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import train_lora
from library.models.nucleus_image.family import NucleusImageFamily
from networks.lora import LoRANetwork
from networks.lora_packed import PackedLoRAModule
from networks.lora_files import PACKED_EXPERTS_KEY, LoRAWeights
from tests.test_nucleus_image_family import H, W, inputs, read_losses
from tests.test_nucleus_image_model import diffusers_forward, ours_from, tiny_config, tiny_diffusers
from tests.test_nucleus_image_model import inputs as model_inputs

LINEARS_OFF = {f"{t}_dim": 0 for t in ("attn", "context", "mod", "mlp", "router")}
GATE_UP = "transformer_blocks.3.img_mlp.experts.gate_up_proj"


def test_experts_are_off_by_default_and_on_with_experts_dim():
    """Six blocks, 3-5 MoE of 8 experts (dim 128, inner 48): no default module is an expert; experts_dim=2 with
    block_indices 4-5 gives both weights of those two blocks at rank 2 per expert; an include pattern reaching them
    without experts_dim, DoRA on them, and experts_dim on a model without experts are each one line."""
    from library.models.nucleus_image.model import NucleusImage

    model = ours_from(tiny_diffusers())
    assert not any(".experts." in m.name for m in LoRANetwork(model, "nucleus_image", 4).lora_modules())
    net = LoRANetwork(model, "nucleus_image", 4, network_args={"experts_dim": 2, "block_indices": "4-5"})
    packed = {m.name: m for m in net.lora_modules() if isinstance(m, PackedLoRAModule)}
    assert sorted(packed) == [f"transformer_blocks.{b}.img_mlp.experts.{w}" for b in (4, 5)
                              for w in ("down_proj", "gate_up_proj")]
    gate_up = packed["transformer_blocks.4.img_mlp.experts.gate_up_proj"]
    assert (gate_up.rank, gate_up.experts, float(gate_up.alpha)) == (2, 8, 2.0)
    assert (tuple(gate_up.lora_down.weight.shape), tuple(gate_up.lora_up.weight.shape)) == ((16, 96), (128, 16))
    assert len(net.lora_modules()) == 2 * 11 + 4  # the two MoE blocks' Linears at network_dim, the experts at 2
    with pytest.raises(ValueError, match="'experts_dim' gives experts rank 0"):
        LoRANetwork(model, "nucleus_image", 4, network_args={"include_patterns": [r".*\.experts\..*"]})
    with pytest.raises(ValueError, match="packed weight of 8 experts: DoRA is not supported"):
        LoRANetwork(model, "nucleus_image", 4, network_args={"experts_dim": 2, "dora": True})
    with torch.device("meta"):
        dense = NucleusImage(tiny_config(dense_moe_strategy="all_dense"))
    with pytest.raises(ValueError, match="'experts_dim': this nucleus_image model has no experts module"):
        LoRANetwork(dense, "nucleus_image", 4, network_args={"experts_dim": 2})


def peft_keys(model, tensors: dict) -> dict:
    """Our PEFT-layout tensors (`<block>.img_mlp.experts.<weight>.lora_A.weight`) under PEFT's own keys: its
    ParamWrappers of one module nest (`experts.base_layer.lora_A` wraps the first weight of target_parameters,
    `experts.lora_A` the second), each naming its parameter_name."""
    from peft.tuners.lora.layer import ParamWrapper

    where = {}
    for path, module in model.named_modules():
        if isinstance(module, ParamWrapper):
            owner = path
            while owner.endswith(".base_layer"):
                owner = owner[: -len(".base_layer")]
            where[f"{owner}.{module.parameter_name}"] = path
    out = {}
    for key, tensor in tensors.items():
        weight, part = key.rsplit(".lora_", 1)
        out[f"{where[weight]}.lora_{part}"] = tensor
    return out


@torch.no_grad()
def test_peft_injected_into_diffusers_computes_our_experts_lora():
    """The oracle: diffusers' model with PEFT's LoRA of the experts' parameters (LoraConfig target_parameters, rank 3,
    lora_alpha 3) loaded with our trained-like factors (convert_lora's PEFT layout: alpha / r folded into lora_B, only
    the keys renamed into PEFT's nesting) gives our output with the runtime LoRA; B's columns read expert-major (not
    PEFT's rank-major order) would not."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    from networks.lora_files import peft_state_dict

    reference = tiny_diffusers()
    ours = ours_from(reference)
    x = model_inputs()
    base = ours(**x)
    torch.manual_seed(0)
    net = LoRANetwork(ours, "nucleus_image", 4, alpha=2, network_args={"experts_dim": 3, **LINEARS_OFF})
    for m in net.lora_modules():
        m.lora_up.weight.normal_(0, 0.3)
    assert len(net.lora_modules()) == 6 and float(net.lora_modules()[0].alpha) == 2.0  # scale 2 / 3
    net.apply()
    want = ours(**x)
    config = LoraConfig(r=3, lora_alpha=3, target_modules=[],
                        target_parameters=["img_mlp.experts.gate_up_proj", "img_mlp.experts.down_proj"])
    theirs = inject_adapter_in_model(config, reference)
    tensors = peft_state_dict(net.lora_weights(), prefix="")
    loaded = set_peft_model_state_dict(theirs, peft_keys(theirs, tensors))
    assert not loaded.unexpected_keys and not [k for k in loaded.missing_keys if "lora_" in k]
    got = diffusers_forward(theirs, x)
    diff, effect = (got - want).abs().max().item(), (want - base).abs().max().item()
    print(f"experts LoRA vs PEFT in diffusers: max abs diff {diff:.2e} on an effect of {effect:.3f}")
    assert diff <= 1e-5 and effect > 0.5
    shuffled = {k: v.reshape(v.shape[0], 3, 8).transpose(1, 2).reshape(v.shape) if k.endswith("lora_B.weight") else v
                for k, v in tensors.items()}  # columns e r + i instead of i E + e
    set_peft_model_state_dict(theirs, peft_keys(theirs, shuffled))
    assert (diffusers_forward(theirs, x) - want).abs().max() > 0.1


@pytest.fixture(scope="module")
def trained(tiny_set, tmp_path_factory):
    """Three steps of configs/nucleus_image.toml's settings (checkpointing, the last 2 blocks, the MoE ones, swapped)
    with every default target at rank 4 and the experts at experts_dim 2: the output folder."""
    out = tmp_path_factory.mktemp("nucleus_experts_run")
    assert train_lora.main([
        "--model_type", "nucleus_image", "--pretrained_model_name_or_path", tiny_set["nucleus_image"],
        "--ae", tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["nucleus_image_text_encoder"],
        "--dataset_config", tiny_set["dataset_config"], "--output_dir", str(out), "--output_name", "experts",
        "--max_train_steps", "3", "--mixed_precision", "no", "--gradient_checkpointing", "true",
        "--blocks_to_swap", "2", "--network_dim", "4", "--network_alpha", "4", "--network_args", "experts_dim=2",
        "--optimizer_type", "AdamW", "--learning_rate", "3e-3", "--save_every_n_steps", "0",
    ]) == 0
    return out


def test_a_run_with_experts_dim_trains_them_and_its_file_loads_back(tiny_set, trained):
    """The file: the two MoE blocks' packed weights in PEFT's shapes (lora_down [2 x 8, N], lora_up [K, 2 x 8]) beside
    the 52 default modules, their expert count in the header, each expert's factors trained away from the zero up;
    a network built from it holds them at rank 2 of 8 experts with the file's factors and changes the output;
    lora_info names it Nucleus-Image's with its ranks per expert."""
    from tools import lora_info

    path = str(trained / "experts.safetensors")
    losses = read_losses(trained, "experts")
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    tensors = load_file(path)
    with safe_open(path, "pt") as f:
        header = f.metadata()
    assert json.loads(header[PACKED_EXPERTS_KEY]) == {f"transformer_blocks.{b}.img_mlp.experts.{w}": 8
                                                      for b in (3, 4) for w in ("gate_up_proj", "down_proj")}
    name = "lora_unet_" + GATE_UP.replace(".", "_")
    assert tensors[f"{name}.lora_down.weight"].shape == (16, 96) and tensors[f"{name}.lora_up.weight"].shape == (64, 16)
    assert len({k.split(".")[0] for k in tensors}) == 52 + 4
    ups = [tensors[k] for k in tensors if "_experts_" in k and k.endswith("lora_up.weight")]
    assert len(ups) == 4 and all(up.reshape(up.shape[0], 2, 8).abs().amax(dim=(0, 1)).min() > 0 for up in ups)

    family = NucleusImageFamily(tiny_set["nucleus_image"])
    model = family.load_transformer(torch.float32)
    x, text = inputs(1)
    base = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    net = LoRANetwork.from_weights(model, "nucleus_image", path)
    packed = [m for m in net.lora_modules() if isinstance(m, PackedLoRAModule)]
    assert len(packed) == 4 and {(m.rank, m.experts) for m in packed} == {(2, 8)}
    module = next(m for m in packed if m.name == GATE_UP)
    assert torch.equal(module.lora_up.weight, tensors[f"{name}.lora_up.weight"])
    net.apply()
    assert (family.predict(model, x, torch.tensor([0.3]), text, H, W, None) - base).abs().max() > 1e-4

    info = lora_info.read_info(path)
    assert (info["arch"], info["ranks"], info["metadata"][PACKED_EXPERTS_KEY]) == (
        "nucleus_image", {"2": 4, "4": 52}, header[PACKED_EXPERTS_KEY])
    assert lora_info.check_against(path, tiny_set["nucleus_image"]).startswith("fits")


@torch.no_grad()
def test_merge_lora_adds_each_experts_delta_to_the_packed_weights(tiny_set, trained, tmp_path):
    """Into the single file at ratio 0.7: the merged model's output is the runtime LoRA's, and so is the trainer's
    base_loras merge into the loaded model; with --save_precision bf16 each packed weight is W + 0.7 delta rounded
    once to bf16 (fp8 outputs and bases: tests/test_merge_experts_fp8.py)."""
    from library.lora_spec import LoRASpec
    from library.training.base_loras import merge_base_loras
    from tools import merge_lora

    lora = str(trained / "experts.safetensors")
    merged = str(tmp_path / "merged.safetensors")
    assert merge_lora.main(["--model", tiny_set["nucleus_image"], "--lora", f"{lora}:0.7", "--save_to", merged]) == 0
    family = NucleusImageFamily(tiny_set["nucleus_image"])
    model = family.load_transformer(torch.float32)
    x, text = inputs(1)
    base = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    LoRANetwork.from_weights(model, "nucleus_image", lora, multiplier=0.7).apply()
    want = family.predict(model, x, torch.tensor([0.3]), text, H, W, None)
    got = family.predict(NucleusImageFamily(merged).load_transformer(torch.float32), x, torch.tensor([0.3]), text,
                         H, W, None)
    assert (want - base).abs().max() > 1e-4 and (got - want).abs().max() <= 1e-5
    trained_on = family.load_transformer(torch.float32)  # base_loras: the trainer's merge into the loaded model
    assert merge_base_loras(trained_on, "nucleus_image", [LoRASpec(lora, 0.7)]) == 56
    assert (family.predict(trained_on, x, torch.tensor([0.3]), text, H, W, None) - want).abs().max() <= 1e-5

    bf16 = str(tmp_path / "merged_bf16.safetensors")
    assert merge_lora.main(["--model", tiny_set["nucleus_image"], "--lora", f"{lora}:0.7", "--save_to", bf16,
                            "--save_precision", "bf16"]) == 0
    tensors, base_tensors = load_file(lora), load_file(tiny_set["nucleus_image"])
    name = "lora_unet_" + GATE_UP.replace(".", "_")
    up, down = tensors[f"{name}.lora_up.weight"], tensors[f"{name}.lora_down.weight"]
    delta = torch.einsum("ore,eri->eoi", up.reshape(up.shape[0], 2, 8), down.reshape(8, 2, -1)) * (
        tensors[f"{name}.alpha"].item() / 2)  # PEFT's ParamWrapper formula, written out
    key = next(k for k in base_tensors if k.endswith(GATE_UP))
    reference = base_tensors[key].float() + 0.7 * delta
    stored = load_file(bf16)[key]
    within_rounding = lambda w: ((w.float() - reference).abs() <= reference.abs() * 2**-8).all()  # noqa: E731
    assert stored.dtype == torch.bfloat16 and within_rounding(stored)
    assert not within_rounding(base_tensors[key].to(torch.bfloat16))  # the delta (3 steps' worth) shows through


@torch.no_grad()
def test_convert_lora_writes_the_experts_in_peft_layout_and_reads_them_back(tiny_set, trained, tmp_path, capsys):
    """--to diffusers (transformer.*) and --to comfy (diffusion_model.*): each expert weight's lora_A is lora_down,
    lora_B lora_up times alpha / r (4 / 2: r per expert), the header keeps the expert counts, and ours reads either
    file back to the kohya file's output; a file whose header lost them is refused in one line."""
    from tools import convert_lora

    kohya = str(trained / "experts.safetensors")
    source = load_file(kohya)
    name = "lora_unet_" + GATE_UP.replace(".", "_")
    family = NucleusImageFamily(tiny_set["nucleus_image"])
    x, text = inputs(2)
    outputs = {}
    for layout, prefix in (("kohya", None), ("diffusers", "transformer"), ("comfy", "diffusion_model")):
        path = kohya if prefix is None else str(tmp_path / f"{layout}.safetensors")
        if prefix is not None:
            assert convert_lora.main([kohya, path, "--to", layout]) == 0
            tensors = load_file(path)
            assert torch.equal(tensors[f"{prefix}.{GATE_UP}.lora_A.weight"], source[f"{name}.lora_down.weight"])
            scale = source[f"{name}.alpha"].item() / 2  # network_alpha 4 over the experts' rank 2
            assert scale == 2 and torch.equal(tensors[f"{prefix}.{GATE_UP}.lora_B.weight"],
                                              source[f"{name}.lora_up.weight"] * scale)
            with safe_open(path, "pt") as f:
                assert json.loads(f.metadata()[PACKED_EXPERTS_KEY])[GATE_UP] == 8
        model = family.load_transformer(torch.float32)
        LoRANetwork.from_weights(model, "nucleus_image", path).apply()
        outputs[layout] = family.predict(model, x, torch.tensor([0.6]), text, H, W, None)
    assert max((outputs[k] - outputs["kohya"]).abs().max().item() for k in outputs) <= 1e-6

    with safe_open(kohya, "pt") as f:
        header = {k: v for k, v in f.metadata().items() if k != PACKED_EXPERTS_KEY}
    stripped = str(tmp_path / "no_count.safetensors")
    save_file(source, stripped, header)
    assert convert_lora.main([stripped, str(tmp_path / "out.safetensors"), "--to", "diffusers"]) == 2
    err = capsys.readouterr().err
    assert "is a packed weight's LoRA and the header names no expert count" in err and len(err.splitlines()) == 1
    # a network applies it still: the model says each weight's expert count
    model = family.load_transformer(torch.float32)
    LoRANetwork.from_weights(model, "nucleus_image", stripped).apply()
    assert (family.predict(model, x, torch.tensor([0.6]), text, H, W, None) - outputs["kohya"]).abs().max() <= 1e-6


def test_packed_weights_lora_weights_equal_the_delta_of_their_factors():
    """LoRAWeights of a packed weight: rank per expert, the weight's shape, the delta expert by expert."""
    down, up = torch.randn(6, 5), torch.randn(4, 6)
    w = LoRAWeights(down, up, 3.0, experts=3)
    assert (w.rank, w.scale, w.shape) == (2, 1.5, (3, 4, 5))
    for e in range(3):
        assert torch.allclose(w.delta()[e], 1.5 * up[:, e::3] @ down[2 * e : 2 * e + 2])
