"""network_module = "lycoris.kohya": LyCORIS' own LoKr/LoHa modules on our FLUX / Qwen-Image,
bf16/fp32 and fp8 bases, files in LyCORIS' key layout loaded back with equal outputs, training
end to end, and the one-line error for any other network_module."""

import hashlib
import importlib

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from library.precision.fp8 import FP8Linear, quantize_module
from library.training.config import ConfigError, load_config
from networks.factory import build_network
from networks.lora import LoRANetwork
from networks.lycoris_network import LycorisNetwork, read_lycoris_modules
from library.models.registry import arch_spec

flux = importlib.import_module("library.models.flux1.model")
qwen = importlib.import_module("library.models.qwen_image.model")


def tiny_flux():
    cfg = flux.FluxConfig(hidden_size=16, num_heads=1, depth=2, depth_single=3, axes_dim=(4, 6, 6),
                          context_in_dim=8, vec_in_dim=8, guidance_embed=False)
    return flux.Flux(cfg)


def flux_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(1, 4, 64, generator=g), flux.make_img_ids(1, 2, 2), torch.randn(1, 3, 8, generator=g),
            flux.make_txt_ids(1, 3), torch.tensor([0.5]), torch.randn(1, 8, generator=g))


def randomize(net, scale=0.1):
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


LOKR = {"algo": "lokr", "factor": 4}


def test_other_network_module_is_a_config_error_naming_the_supported_ones(tmp_path):
    cfg = tmp_path / "t.toml"
    cfg.write_text('model_type = "llm"\npretrained_model_name_or_path = "m"\ntrain_data = ["a.txt"]\n'
                   'network_module = "networks.lora_flux"\n')
    with pytest.raises(ConfigError, match=r"t\.toml: network_module 'networks.lora_flux' is not supported "
                                          r"\(supported: networks.lora, lycoris.kohya\)"):
        load_config(["--config_file", str(cfg)])
    args = load_config(["--config_file", str(cfg), "--network_module", "lycoris.kohya"])
    assert args.network_module == "lycoris.kohya"


def test_lokr_adapts_our_lora_targets_with_lycoris_keys():
    model = tiny_flux()
    net = build_network("lycoris.kohya", model, "flux", 4, 2.0, network_args=LOKR)
    lora = LoRANetwork(model, "flux", 4)
    assert isinstance(net, LycorisNetwork) and not net.training
    assert {m.lora_name for m in net.lycoris_modules()} == {n for n, _ in lora.named_children()}  # 29 modules
    assert len(net.lycoris_modules()) == 2 * 10 + 3 * 3
    keys = set(net.state_dict())
    assert "lora_unet_double_blocks_0_img_attn_qkv.lokr_w1" in keys
    assert "lora_unet_single_blocks_2_linear2.alpha" in keys
    with pytest.raises(ValueError, match="unknown key 'img_attn_dim' for lycoris.kohya"):
        LycorisNetwork(model, "flux", 4, network_args={"algo": "lokr", "img_attn_dim": 2})
    # our selection args pick the targets, as for our LoRA
    single_only = LycorisNetwork(model, "flux", 4, network_args={**LOKR, "train_blocks": "single"})
    assert {m.lora_name for m in single_only.lycoris_modules()} == {
        f"lora_unet_single_blocks_{i}_{n}" for i in range(3) for n in ("linear1", "linear2", "modulation_lin")}


@pytest.mark.parametrize("algo_args", [LOKR, {"algo": "loha"}])
def test_lycoris_dropout_trains_without_its_false_per_module_warning(algo_args, capsys):
    """LoHa's / LoKr's modules printed "haven't implemented normal dropout yet" once per module (29 lines here,
    hundreds at full size), though the bypass forward, the only one dropout is allowed with, applies it."""
    model = tiny_flux()
    net = LycorisNetwork(model, "flux", 4, 2.0, network_args={**algo_args, "dropout": 0.5})
    assert "dropout" not in capsys.readouterr().out
    randomize(net)
    net.apply()
    net.train()
    x = flux_inputs()
    with torch.no_grad():
        assert not torch.equal(model(*x), model(*x))  # dropout applied: two training forwards differ
    net.eval()
    with torch.no_grad():
        assert torch.equal(model(*x), model(*x))


def test_quiet_lycoris_passes_other_printed_lines_through(capsys):
    from networks.lycoris_network import _quiet_lycoris

    with _quiet_lycoris():
        print("[WARN]LoHa/LoKr haven't implemented normal dropout yet.")
        print("Unused state dict key: x")
    assert capsys.readouterr().out == "Unused state dict key: x\n"


@pytest.mark.parametrize("args", [{**LOKR, "dora_wd": True}, {"algo": "loha", "dora_wd": True}, {"algo": "full"}])
def test_a_lycoris_network_that_copies_target_weights_builds_on_a_meta_model(args):
    """dora_wd and algo=full copy each target weight to the CPU as LyCORIS builds: on the meta model of the
    memory planner (plan_memory, the web UI's plan, a CUDA run's plan before caching) that raised "Cannot copy out
    of meta tensor". The meta build has the real build's parameters, shape for shape."""
    real = build_network("lycoris.kohya", tiny_flux(), "flux", 4, 2.0, network_args=args)
    with torch.device("meta"):
        model = tiny_flux()
        meta = build_network("lycoris.kohya", model, "flux", 4, 2.0, network_args=args)
    assert {k: v.shape for k, v in meta.named_parameters()} == {k: v.shape for k, v in real.named_parameters()}
    assert all(p.is_meta for p in meta.parameters())
    meta.apply()  # algo=full: the weight it replaces copied to the CPU, here to meta


COPYING = [{**LOKR, "dora_wd": True}, {"algo": "loha", "dora_wd": True}]  # (the full type on fp8: the test below)


@pytest.mark.parametrize("args,base", [(a, "bf16") for a in [*COPYING, {"algo": "full"}]] + [(a, "fp8_scaled") for a in COPYING])
def test_a_lycoris_file_whose_modules_copy_target_weights_reads_onto_a_meta_model(args, base, tmp_path):
    """generate.py reads each --lora onto the transformer built on meta (at the render's base precision) before any
    model loads: a file of those algos failed there (LyCORIS' CPU copy of a meta weight, swallowed by its make_module
    as "LyCORIS does not recognise its keys"), so generate.py rendered no LyCORIS DoRA or full-type file until
    2026-11-30."""
    from library.precision.fp8 import prepare_fp8
    from networks.factory import network_from_file

    path = str(tmp_path / "lycoris.safetensors")
    real = LycorisNetwork(tiny_flux(), "flux", 4, 2.0, network_args=args)
    real.save(path)
    with torch.device("meta"):
        model = tiny_flux()
    if base == "fp8_scaled":
        prepare_fp8(model, base, arch_spec("flux").fp8)
    meta = network_from_file(model, "flux", path)
    assert {k: v.shape for k, v in meta.named_parameters()} == {k: v.shape for k, v in real.named_parameters()}


def test_a_full_type_file_on_an_fp8_model_says_what_to_do(tmp_path):
    """LyCORIS' full type on an fp8 base (precision_doctor, the tools that read a file as its network): LyCORIS' own
    "Quant Linear is not supported ... a file for another model" became a line saying what to do."""
    from library.io import CheckpointError
    from networks.factory import network_from_file

    path = str(tmp_path / "full.safetensors")
    LycorisNetwork(tiny_flux(), "flux", 4, 2.0, network_args={"algo": "full"}).save(path)
    model = quantize_module(tiny_flux(), "fp8_scaled", arch_spec("flux").fp8)
    with pytest.raises(CheckpointError, match=r"\(FullModule\): a whole delta of the weight, which an fp8 base's codes "
                                              r"cannot take: render on a bf16 base"):
        network_from_file(model, "flux", path)


def test_lycoris_selection_args_are_checked_for_the_arch_without_a_model():
    """The old line checked only the names of the selection args before caching: a block arg of
    another family or a bad index range failed when the network was built, after caching."""
    from networks.factory import check_network_args

    for args, message in (({**LOKR, "block_indices": "0-1"}, "unknown key 'block_indices' for family 'flux'"),
                          ({**LOKR, "train_double_block_indices": "x"}, "network_args 'train_double_block_indices': bad range")):
        with pytest.raises(ValueError, match=message):
            check_network_args("lycoris.kohya", "flux", args)
    check_network_args("lycoris.kohya", "qwen_image", {**LOKR, "block_indices": "0-1"})


@pytest.mark.parametrize("args, message", [
    ({"algo": "foo"}, "network_args 'algo': 'foo' is not a LyCORIS algo (allowed: "),
    ({**LOKR, "factor": "abc"}, "network_args 'factor': expected an integer, got 'abc'"),
    ({**LOKR, "dropout": "lots"}, "network_args 'dropout': expected a number, got 'lots'"),
    ({**LOKR, "use_tucker": "maybe"}, "network_args 'use_tucker': expected true/false, got 'maybe'"),
    ({"preset": "atn-mlp"}, "network_args 'preset': 'atn-mlp' is neither a LyCORIS preset (attn-mlp, "),
    # accepted and dropped before: create_network (lycoris-lora 4.1.3) never reads rank_dropout_scale,
    # and our exact-name preset of Linear targets holds no convolution or norm layer
    ({**LOKR, "rank_dropout_scale": True}, "unknown key 'rank_dropout_scale' for lycoris.kohya"),
    ({**LOKR, "conv_dim": 8}, "network_args 'conv_dim' acts on convolution layers, and without a LyCORIS 'preset'"),
    # LyCORIS' NormModule takes nn.LayerNorm / nn.GroupNorm only: no model here has one (a preset trained no norm)
    ({**LOKR, "preset": "full", "train_norm": "true"}, "network_args 'train_norm': LyCORIS trains only nn.LayerNorm"),
    ({**LOKR, "dropout": 1.5}, "network_args 'dropout': expected a probability in [0, 1), got 1.5"),  # F.dropout raised at step 1
    # LoKr's bypass forward never reads it: two training forwards were equal (LoHa / LoCon / our LoRA: 1e-2 apart)
    ({**LOKR, "rank_dropout": 0.5}, "LyCORIS' LoKr bypass forward (the default here) never reads it"),
    ({"algo": "boft", "rank_dropout": 0.5}, "LyCORIS' boft module never reads it"),  # as ia3, dylora, tlora (refused)
    # LyCORIS' weight-rebuild forward (bypass_mode=false; dora_wd's) never applies dropout: train == eval output
    ({"algo": "locon", "bypass_mode": False, "dropout": 0.5}, "LyCORIS' weight-rebuild forward (bypass_mode=false) "
                                                             "never applies it"),
    ({"algo": "locon", "dora_wd": True, "dropout": 0.5}, "dora_wd=true needs that forward, so leave dropout out"),
    ({**LOKR, "bypass_mode": False, "dropout": 0.5}, "set 'bypass_mode=true' or leave it out"),
    # accepted before, their files applied other than trained or unreadable by our tools (each trained and exited 0):
    # DyLoRA's random rank at alpha / (rank + 1) saved as a plain LoRA (1/4 to 1/16 of the trained delta)
    ({"algo": "dylora"}, "network_args 'algo=dylora' is refused: LyCORIS' DyLoRA trains a random rank"),
    ({"algo": "glora"}, "network_args 'algo=glora' is refused: its file (a1 / a2 / b1 / b2) reads as no LyCORIS file"),
    ({"algo": "tlora"}, "network_args 'algo=tlora' is refused"),
    ({"algo": "ia3"}, "network_args 'algo=ia3' is refused: LyCORIS' own loader cannot rebuild its modules"),
    # full-matrix LoKr trains at sqrt(rank), ComfyUI and LyCORIS' loader apply 1
    ({**LOKR, "full_matrix": True, "rs_lora": True}, "network_args 'rs_lora=true' with algo=lokr and full_matrix=true"),
    ({**LOKR, "unbalanced_factorization": True}, "network_args 'unbalanced_factorization=true': LyCORIS' loader"),
    ({"algo": "loha", "dora_wd": True, "wd_on_output": False}, "network_args 'wd_on_output=false' with dora_wd=true"),
    ({"algo": "full", "bypass_mode": True}, "network_args 'bypass_mode=true' with algo=full"),  # LyCORIS' own refusal at build
], ids=["algo", "factor", "dropout", "use_tucker", "preset", "rank_dropout_scale", "conv_dim", "train_norm", "dropout_range",
        "lokr_rank_dropout", "boft_rank_dropout", "rebuild_dropout", "dora_dropout", "lokr_rebuild_dropout", "dylora", "glora",
        "tlora", "ia3", "rs_lora_full_matrix", "unbalanced_factorization", "dora_wd_on_input", "full_bypass"])
def test_bad_lycoris_args_name_the_key_the_value_and_what_is_allowed(args, message):
    with pytest.raises(ValueError) as raised:
        LycorisNetwork(tiny_flux(), "flux", 4, network_args=args)
    assert message in str(raised.value), raised.value
    if "is not a LyCORIS algo" in message:
        assert "lokr, lora" in str(raised.value)


def test_algo_full_on_a_quantized_base_is_refused_before_caching_and_when_built():
    """algo=full on the quickstart's fp8_scaled base cached, built, then crashed as the network was applied
    (AttributeError: FP8LinearView's `weight` has no deleter): the config check names the key that stored it."""
    from networks.factory import check_network_args

    with pytest.raises(ValueError, match=r"'algo=full' .* high-precision base; 'fp8_base' stores it in fp8_scaled: "
                                         r"set fp8_base = false"):
        check_network_args("lycoris.kohya", "flux", {"algo": "full"}, "fp8_scaled", "fp8_base")
    with pytest.raises(ValueError, match=r"'base_precision' stores it in nf4: set base_precision = \"bf16\""):
        check_network_args("lycoris.kohya", "flux", {"algo": "full"}, "nf4", "base_precision")
    check_network_args("lycoris.kohya", "flux", {"algo": "full"}, "bf16", "base_precision")
    model = tiny_flux()  # a base stored quantized whatever the config said (GGUF): refused as it is built
    quantize_module(model, "fp8_scaled", arch_spec("flux").fp8)
    with pytest.raises(ValueError, match=r"'algo=full' .*; 'lora_unet_\w+' is stored quantized \(29 such modules\)"):
        LycorisNetwork(model, "flux", 4, network_args={"algo": "full"})


def test_a_lycoris_preset_that_adapts_no_block_of_the_model_is_refused(tmp_path, monkeypatch):
    """LyCORIS' presets select diffusers' class names: preset=full trained Z-Image's 2 final-layer modules only and
    exited 0, and on Qwen-Image every built-in preset selected nothing (an error after caching). Now refused before
    caching against the released model's blocks, naming the classes a preset file can name; FLUX.1's match."""
    from networks import lycoris_network
    from networks.factory import check_network_args

    for arch, blocks in (("zimage", "ZImageBlock"), ("qwen_image", "QwenImageBlock")):
        with pytest.raises(ValueError, match=rf"'preset': 'full' adapts no Linear inside the {arch} model's transformer "
                                             rf"blocks \(LyCORIS selects by class name; the blocks are {blocks}\)"):
            check_network_args("lycoris.kohya", arch, {**LOKR, "preset": "full"})
    check_network_args("lycoris.kohya", "flux", {**LOKR, "preset": "full"})
    own = tmp_path / "qwen.toml"
    own.write_text('unet_target_module = ["QwenImageBlock"]\n')
    check_network_args("lycoris.kohya", "qwen_image", {**LOKR, "preset": str(own)})
    unknown = tmp_path / "typo.toml"  # LyCORIS' create_network asserted after caching
    unknown.write_text('unet_target_modules = ["QwenImageBlock"]\n')
    with pytest.raises(ValueError, match=r"typo.toml: not a LyCORIS preset file \(.*Unknown preset keys: unet_target_modules"):
        check_network_args("lycoris.kohya", "qwen_image", {**LOKR, "preset": str(unknown)})
    # the built network is checked on the run's own model too (here the released model's check is skipped)
    last = tmp_path / "last.toml"
    last.write_text('unet_target_module = ["LastLayer"]\n')
    monkeypatch.setattr(lycoris_network, "_released_blocks", lambda arch: None)
    with pytest.raises(ValueError, match=r"last.toml' adapts 2 modules but no Linear inside the flux model's transformer "
                                         r"blocks \(.*the blocks are DoubleStreamBlock, SingleStreamBlock\)"):
        LycorisNetwork(tiny_flux(), "flux", 4, network_args={**LOKR, "preset": str(last)})


def test_rs_lora_on_lokr_that_its_shapes_force_into_full_matrix_is_refused_naming_the_module():
    """A rank at least half a module's lokr_w2 side makes LyCORIS build it full-matrix (no full_matrix=true), trained
    at scale sqrt(rank) with rs_lora while ComfyUI and LyCORIS' loader apply 1: known only from the layer shapes."""
    with pytest.raises(ValueError, match=r"'rs_lora=true' with algo=lokr: 'lora_unet_\w+' is full-matrix LoKr \(29 such "
                                         r"modules: network_dim 16 is at least half"):
        LycorisNetwork(tiny_flux(), "flux", 16, network_args={"algo": "lokr", "rs_lora": True})
    LycorisNetwork(tiny_flux(), "flux", 2, network_args={"algo": "lokr", "rs_lora": True, "factor": 2})


@pytest.mark.parametrize("kind", ["unbalanced_lokr", "lokr_dora_on_input", "ia3", "lokr_low_rank_w2_rebuilt_full"])
def test_a_lycoris_file_lycoris_loader_misreads_is_one_error_naming_the_file_and_module(kind, tmp_path):
    """generate (network_from_file) and merge_lora (LycorisDelta) stopped with a raw RuntimeError / TypeError from
    LyCORIS' make_module_from_state_dict, which re-infers LoKr's factors and DoRA's axis from the shapes; an
    AttributeError where it builds a low-rank w2 (another trainer's, rank 6 of 12 x 4) as full-matrix."""
    from lycoris.modules import IA3Module, LokrModule
    from safetensors.torch import save_file

    from library.io import CheckpointError
    from networks.factory import network_from_file
    from networks.lycoris_network import lycoris_deltas

    model = tiny_flux()
    qkv, name = model.double_blocks[0].img_attn.qkv, "lora_unet_double_blocks_0_img_attn_qkv"
    module = {"unbalanced_lokr": lambda: LokrModule(name, qkv, 1.0, 4, 2.0, factor=4, unbalanced_factorization=True),
              "lokr_dora_on_input": lambda: LokrModule(name, qkv, 1.0, 4, 2.0, factor=4, weight_decompose=True, wd_on_out=False),
              "ia3": lambda: IA3Module(name, qkv), "lokr_low_rank_w2_rebuilt_full": lambda: None}[kind]()
    path = str(tmp_path / f"{kind}.safetensors")
    tensors = {"lokr_w1": torch.randn(4, 4), "lokr_w2_a": torch.randn(12, 6), "lokr_w2_b": torch.randn(6, 4),
               "alpha": torch.tensor(6.0)} if kind == "lokr_low_rank_w2_rebuilt_full" else module.state_dict()
    save_file({f"{name}.{k}": v.detach().contiguous() for k, v in tensors.items()}, path)
    said = rf"^{path}: LyCORIS module '{name}' \(\w+\): LyCORIS' loader cannot rebuild it on a weight of shape \(48, 16\)"
    with pytest.raises(CheckpointError, match=said):
        network_from_file(model, "flux", path)
    if kind != "ia3":  # merge_lora refuses (IA)^3 by its type
        with pytest.raises(CheckpointError, match=said):
            lycoris_deltas(load_file(path), path)[name].merged(qkv.weight.detach())


@pytest.mark.parametrize("algo_args", [LOKR, {"algo": "loha"}, {**LOKR, "dora_wd": True}])
def test_lycoris_on_fp8_base_equals_dequantized_base_and_only_lycoris_trains(algo_args, tmp_path):
    torch.manual_seed(0)
    model = tiny_flux()
    quantize_module(model, "fp8_scaled", arch_spec("flux").fp8)
    # the reference: the same model with every FP8Linear turned into an fp32 nn.Linear of its dequantized weight
    reference = tiny_flux()
    state = {}
    for name, m in model.named_modules():
        if isinstance(m, FP8Linear):
            state[f"{name}.weight"] = m.dequantized_weight(torch.float32)
            state[f"{name}.bias"] = m.bias.float()
    other = {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[0] not in
             {n for n, m in model.named_modules() if isinstance(m, FP8Linear)}}
    reference.load_state_dict({**other, **state})
    net8 = LycorisNetwork(model, "flux", 4, 2.0, network_args=algo_args)
    ref_net = LycorisNetwork(reference, "flux", 4, 2.0, network_args=algo_args)
    randomize(ref_net)
    net8.load_weights(ref_net.state_dict())
    assert len(net8._fp8_targets) == 29  # every target is an FP8Linear, wrapped through its view
    assert all(isinstance(m, FP8Linear) for n, m in model.named_modules() if n == "double_blocks.0.img_attn.qkv")
    x = flux_inputs()
    before = model(*x).detach()
    net8.apply(), ref_net.apply()
    net8.train()
    out = model(*x)
    expected = reference(*x)
    assert (out - before).abs().max() > 1e-3  # the LyCORIS delta is on
    assert (out - expected).abs().max() < 1e-5
    out.square().mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net8.trainable_parameters())
    assert not any(t.requires_grad for t in model.parameters()) and all(b.grad is None for b in model.buffers())
    net8.remove()
    assert (model(*x) - before).abs().max() == 0
    # a LyCORIS file read for generation on the fp8 base (FP8Linears through their views)
    from networks.factory import network_from_file

    ref_net.save(str(tmp_path / "n.safetensors"))
    from_file = network_from_file(model, "flux", str(tmp_path / "n.safetensors"))
    from_file.apply()
    assert (model(*x) - expected).abs().max() < 1e-5


def test_lokr_file_round_trips_through_our_network_and_lycoris_own_loader(tmp_path):
    model = tiny_flux()
    net = LycorisNetwork(model, "flux", 4, 2.0, network_args=LOKR)
    randomize(net)
    path = str(tmp_path / "lokr.safetensors")
    net.save(path, metadata={"ss_output_name": "lokr", "modelspec.hash_sha256": "0x"})  # a training save's header
    tensors = load_file(path)
    assert set(tensors) == set(net.state_dict()) and all(k.startswith("lora_unet_") for k in tensors)
    with open(path, "rb") as f:  # ModelSpec's hash of the tensors written (LyCORIS saves wrote the header's "0x")
        data = f.read()
    with safe_open(path, "pt") as f:
        assert f.metadata()["modelspec.hash_sha256"] == "0x" + hashlib.sha256(data[8 + int.from_bytes(data[:8], "little"):]).hexdigest()
    x = flux_inputs()
    base = model(*x).detach()
    net.apply()
    trained = model(*x).detach()
    net.remove()

    again = LycorisNetwork(model, "flux", 4, 2.0, network_args=LOKR)
    said = again.describe_loaded(again.load_weights(path))  # the network_weights log line
    assert said.startswith("29 LyCORIS lokr modules loaded"), said
    again.apply()
    assert (model(*x) - trained).abs().max() == 0
    again.remove()
    # LyCORIS rebuilds its modules from the file alone (as ComfyUI / sd-scripts' tools do)
    modules = read_lycoris_modules(model, tensors)
    assert len(modules) == 29
    for m in modules:
        m.apply_to()
    assert (model(*x) - trained).abs().max() < 1e-6 and (trained - base).abs().max() > 1e-3
    for m in modules:
        m.restore()
    # what generate.py does with any LoRA file: the network the file names
    from networks.factory import network_from_file

    from_file = network_from_file(model, "flux", path)
    assert isinstance(from_file, LycorisNetwork) and len(from_file.lycoris_modules()) == 29
    assert from_file.describe_loaded({"loaded": 29, "added": 0, "missing": 0}).startswith("29 LyCORIS lokr modules")
    from_file.apply()
    assert (model(*x) - trained).abs().max() < 1e-6
    from_file.remove()
    assert (model(*x) - base).abs().max() == 0
    with pytest.raises(Exception, match="is not a tensor of this LyCORIS network"):
        LycorisNetwork(model, "flux", 4, network_args={"algo": "loha"}).load_weights(path)


def test_a_lokr_file_with_text_encoder_modules_on_flux_and_chroma_loads_its_transformer_modules(tmp_path):
    """generate --lora with a FLUX.1 LoKr file from sd-scripts (CLIP-L modules under lora_te1_ beside the
    transformer's) stopped with "LyCORIS module 'lora_te1_...' names no module of this model", no file named;
    on Chroma (which loads FLUX.1 LoRAs less the modulation it lacks) with "... 'lora_unet_double_blocks_0_img_mod_lin'
    names no module". Now both are left out, each with one warning, as for a down/up LoRA."""
    from safetensors.torch import save_file

    from library.models.chroma.model import Chroma, ChromaConfig
    from networks.factory import network_from_file

    net = LycorisNetwork(tiny_flux(), "flux", 4, 2.0, network_args=LOKR)
    te = "lora_te1_text_model_encoder_layers_0_mlp_fc1"
    tensors = {**net.state_dict(), f"{te}.lokr_w1": torch.ones(2, 2), f"{te}.lokr_w2": torch.ones(4, 4), f"{te}.alpha": torch.tensor(4.0)}
    path = str(tmp_path / "lokr_te.safetensors")
    save_file(tensors, path)
    with pytest.warns(UserWarning) as said:
        assert len(network_from_file(tiny_flux(), "flux", path).lycoris_modules()) == 29
    assert [str(w.message) for w in said] == [f"{path}: left out 1 text-encoder modules (CLIP-L lora_te1_ x1): they adapt "
                                              f"the text encoders, not this network's model"]
    chroma = Chroma(ChromaConfig(in_channels=64, context_in_dim=8, hidden_size=16, num_heads=1, depth=2, depth_single=3,
                                 axes_dim=(4, 6, 6), approximator_hidden=16, approximator_layers=1))
    with pytest.warns(UserWarning) as said:
        assert len(network_from_file(chroma, "chroma", path).lycoris_modules()) == 29 - 2 * 2 - 3  # img / txt_mod, modulation
    assert [str(w.message).split(" (e.g.")[0] for w in said][1] == (
        f"{path}: a FLUX.1 LoRA: left out its 7 modules this Chroma model lacks")


def test_a_network_weights_or_base_loras_file_the_network_cannot_read_stops_the_run_before_caching(tmp_path):
    """A LoKr file as network_weights of network_module networks.lora (the default) stopped the run after caching
    and loading the model ("a LyCORIS file ...; set network_module = "lycoris.kohya""), a LoRA file of
    lycoris.kohya with "key ... is not a tensor of this LyCORIS network", a LoKr file as base_loras with "a
    LyCORIS file; merge it ...": library/training/lora_inputs.py, which runs before caching, now says each."""
    from types import SimpleNamespace

    from library.training.lora_inputs import check_lora_inputs

    lokr, lora = str(tmp_path / "lokr.safetensors"), str(tmp_path / "lora.safetensors")
    LycorisNetwork(tiny_flux(), "flux", 4, 2.0, network_args=LOKR).save(lokr)
    LoRANetwork(tiny_flux(), "flux", 4).save(lora)
    for key, module, path, said in (
            ("network_weights", "networks.lora", lokr, "a LyCORIS file (LoKr / LoHa / ...; network_module lycoris.kohya); "
                                                       "set network_module = \"lycoris.kohya\" to load it"),
            ("network_weights", "lycoris.kohya", lora, "a down/up LoRA file (network_module networks.lora); "
                                                       "set network_module = \"networks.lora\" to load it"),
            ("base_loras", "networks.lora", lokr, "a LyCORIS file (LoKr / LoHa / ...; network_module lycoris.kohya); merge "
                                                  "it into the checkpoint with tools/merge_lora.py and train on the merged checkpoint")):
        args = SimpleNamespace(config_file="run.toml", network_module=module, network_weights=None, base_loras=None)
        setattr(args, key, path if key == "network_weights" else [f"{path}:0.5"])
        with pytest.raises(ConfigError) as error:
            check_lora_inputs(args, "flux")
        assert str(error.value) == f"run.toml: key '{key}': {path}: {said}"
    check_lora_inputs(SimpleNamespace(config_file=None, network_module="lycoris.kohya", network_weights=lokr,
                                      base_loras=[lora]), "flux")


def test_lokr_on_qwen_image_uses_musubi_targets():
    cfg = qwen.QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=1, joint_attention_dim=16,
                               axes_dims_rope=(8, 12, 12))
    model = qwen.QwenImage(cfg)
    net = LycorisNetwork(model, "qwen_image", 4, network_args=LOKR)
    ours = LoRANetwork(model, "qwen_image", 4)
    assert {m.lora_name for m in net.lycoris_modules()} == {n for n, _ in ours.named_children()}
    assert len(net.lycoris_modules()) == 2 * (8 + 4)  # attention + MLP, no modulation (our default)
    # on the fp8 base: the LoKr changes the output, gradients reach only the LoKr
    quantize_module(model, "fp8_scaled", arch_spec("qwen_image").fp8)
    net8 = LycorisNetwork(model, "qwen_image", 4, network_args=LOKR)
    assert len(net8._fp8_targets) == 24
    randomize(net8)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(1, 4, 64, generator=g), torch.randn(1, 3, 16, generator=g), torch.ones(1, 3, dtype=torch.bool),
         torch.tensor([0.5]), [(1, 2, 2)])
    before = model(*x).detach()
    net8.apply(), net8.train()
    out = model(*x)
    assert (out - before).abs().max() > 1e-3
    out.square().mean().backward()
    # (the last block's text-stream outputs are discarded by the model, so block 0 is the check)
    assert all(p.grad is not None for n, p in net8.named_parameters() if "_blocks_0_" in n)
    assert not any(p.requires_grad for p in model.parameters())


def test_train_lora_trains_a_lokr_on_tiny_fp8_flux(tiny_set, tmp_path):
    import train_lora
    from library.models.flux1.family import FluxFamily
    from tests.test_train_lora import flux_args, read_losses

    out = tmp_path / "lokr"
    code = train_lora.main(flux_args(tiny_set, out, "--max_train_steps", "4", "--optimizer_type", "AdamW",
                                     "--optimizer_args", "--learning_rate", "3e-3", "--fp8_base", "--sample_prompts", "",
                                     "--network_module", "lycoris.kohya", "--network_args", "algo=lokr", "factor=4"))
    assert code == 0
    losses = read_losses(out)
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    tensors = load_file(out / "tiny_flux_lora.safetensors")
    assert any(k.endswith(".lokr_w1") for k in tensors) and not any("lora_down" in k for k in tensors)
    # the saved LoKr changes the fp32 model's prediction (LyCORIS zero-initialises one factor)
    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    x = torch.randn(1, 16, 64)
    text = {"t5": torch.randn(1, 32, 32), "clip_pooled": torch.randn(1, 32)}
    with torch.no_grad():
        before = family.predict(model, x, torch.tensor([0.5]), text, 4, 4, 1.0)
        for m in read_lycoris_modules(model, tensors):
            m.apply_to()
        after = family.predict(model, x, torch.tensor([0.5]), text, 4, 4, 1.0)
    assert ((after - before).norm() / before.norm()).item() > 1e-3


def test_a_lokr_applied_after_a_lora_on_a_quantized_base_keeps_the_lora():
    """generate.py --lora lora lokr on an fp8 / nf4 / GGUF base: the LoKr's forward called the quantized
    layer's class forward, dropping the LoRA applied before it (the image was the LoKr's alone, 0.4 of
    the output off); the same pair on the dequantized fp32 weights is the reference."""
    import copy

    cfg = qwen.QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=1, joint_attention_dim=16,
                               axes_dims_rope=(8, 12, 12))
    torch.manual_seed(0)
    quantized = qwen.QwenImage(cfg)
    quantize_module(quantized, "fp8_scaled", arch_spec("qwen_image").fp8)
    dense = copy.deepcopy(quantized)
    for name, layer in list(dense.named_modules()):
        for child, sub in list(layer.named_children()):
            if isinstance(sub, FP8Linear):
                linear = torch.nn.Linear(sub.in_features, sub.out_features, bias=sub.bias is not None)
                linear.weight.data = sub.dequantized_weight(torch.float32)
                if sub.bias is not None:
                    linear.bias.data = sub.bias.data.float()
                setattr(layer, child, linear)
    g = torch.Generator().manual_seed(5)
    x = (torch.randn(1, 4, 64, generator=g), torch.randn(1, 3, 16, generator=g), torch.ones(1, 3, dtype=torch.bool),
         torch.tensor([0.5]), [(1, 2, 2)])
    outputs, networks = [], []
    for model in (dense, quantized):
        torch.manual_seed(1)
        lora, lokr = LoRANetwork(model, "qwen_image", 4), LycorisNetwork(model, "qwen_image", 4, network_args=LOKR)
        randomize(lora), randomize(lokr)
        lora.apply(), lokr.apply()
        with torch.no_grad():
            outputs.append(model(*x).float())
        networks.append((lora, lokr))
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-4)
    before = quantized(*x)
    for lora, lokr in networks:  # removed in reverse order: the base's output again
        lokr.remove(), lora.remove()
    assert not torch.equal(quantized(*x), before)
    torch.manual_seed(1)
    lora = LoRANetwork(quantized, "qwen_image", 4)
    randomize(lora), lora.apply()
    lora_only = quantized(*x)
    lora.remove()
    assert (lora_only - quantized(*x)).abs().max() > 1e-3  # (the LoRA alone changes the output)


def test_a_lycoris_network_weights_file_of_other_shapes_or_modules_stops_the_run_before_caching(tmp_path):
    """lycoris.kohya's network_weights was loaded only once the model had loaded, after caching: a LoKr file of
    another factor (other lokr_w1 / lokr_w2 shapes) or of modules the run's selection leaves out stopped the run
    there. check_network_fits now builds the LyCORIS network on the meta model and loads the file into it."""
    from types import SimpleNamespace

    from library.training.lora_inputs import check_network_fits

    other_factor, all_blocks = str(tmp_path / "factor8.safetensors"), str(tmp_path / "all.safetensors")
    LycorisNetwork(tiny_flux(), "flux", 4, 2.0, network_args={"algo": "lokr", "factor": 8}).save(other_factor)
    LycorisNetwork(tiny_flux(), "flux", 4, 2.0, network_args=LOKR).save(all_blocks)

    def check(path, network_args):
        args = SimpleNamespace(config_file="run.toml", network_module="lycoris.kohya", network_weights=path,
                               network_dim=4, network_alpha=2.0, network_args=network_args, network_dropout=None,
                               dim_from_weights=False, base_loras=None)
        check_network_fits(args, "flux", lambda: tiny_flux().to("meta"))

    check(all_blocks, ["algo=lokr", "factor=4"])  # the file of the run's own args loads
    with pytest.raises(ConfigError, match=r"run\.toml: key 'network_weights': .*factor8\.safetensors: key "
                                          r"'lora_unet_double_blocks_0_img_attn_qkv\.lokr_w2' is not a tensor"):  # full-matrix there
        check(other_factor, ["algo=lokr", "factor=4"])
    with pytest.raises(ConfigError, match=r"run\.toml: key 'network_weights': .*all\.safetensors: key "
                                          r"'lora_unet_double_blocks_.*' is not a tensor of this LyCORIS network"):
        check(all_blocks, ["algo=lokr", "factor=4", "train_blocks=single"])


def test_a_lycoris_file_without_alpha_applies_at_scale_one_as_comfyui_reads_it():
    """Old: LyCORIS' loader took float(None) for a module without `.alpha` and every tool refused the file
    ("cannot rebuild it ... not 'NoneType'"); ComfyUI reads it at scale 1 (alpha = rank), as LyCORIS' modules
    read an alpha of 0."""
    from networks.lycoris_network import LycorisDelta

    torch.manual_seed(0)
    name = "lora_unet_double_blocks_0_img_attn_proj"
    factors = {f"{name}.lokr_w1": torch.randn(4, 4), f"{name}.lokr_w2_a": torch.randn(16, 2),
               f"{name}.lokr_w2_b": torch.randn(2, 16)}
    weight = torch.randn(64, 64)
    merged = {alpha: LycorisDelta(name, {**factors, **({} if alpha is None else {f"{name}.alpha": torch.tensor(alpha)})})
              .merged(weight) for alpha in (None, 2.0, 1.0)}
    delta = torch.kron(factors[f"{name}.lokr_w1"], factors[f"{name}.lokr_w2_a"] @ factors[f"{name}.lokr_w2_b"])
    torch.testing.assert_close(merged[None], weight + delta)  # rank 2: alpha 2 is scale 1
    torch.testing.assert_close(merged[2.0], merged[None])
    torch.testing.assert_close(merged[1.0], weight + delta / 2)
