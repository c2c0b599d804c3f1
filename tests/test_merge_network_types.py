"""tools/merge_lora.py and tools/convert_lora.py on DoRA and LyCORIS files (LyCORIS' full type too): the merged
checkpoint gives the output of the unmerged network, DoRA converts kohya <-> diffusers exactly, a LyCORIS
file is refused by convert with the reason."""

import pytest
import torch

from library.models.flux1.checkpoint import load_flux, save_flux_bfl
from library.models.flux1.model import Flux
from networks.lora import LoRANetwork
from networks.lycoris_network import LycorisNetwork
from tests.test_merge_convert import FLUX_CFG, flux_inputs, merge, only_line, randomized, run
from tools import convert_lora


def flux_base(tmp_path):
    model = randomized(Flux(FLUX_CFG), 1)
    save_flux_bfl(model, str(tmp_path / "base.safetensors"))
    return model


def random_(net, scale):
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in net.trainable_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.abs().mean() + 0.1))


def test_dora_merge_equals_the_unmerged_dora_and_a_lora_after_it(tmp_path):
    model = flux_base(tmp_path)
    dora = LoRANetwork(model, "flux", 4, 2.0, network_args={"dora": True})
    lora = LoRANetwork(model, "flux", 2, 2.0)
    random_(dora, 0.5), random_(lora, 0.5)
    dora.save(str(tmp_path / "dora.safetensors")), lora.save(str(tmp_path / "lora.safetensors"))
    base = run(model, flux_inputs())
    dora.set_multiplier(0.7), dora.apply()
    expected = run(model, flux_inputs())
    dora.remove()
    assert (expected - base).abs().max() > 0.05
    assert merge("--model", tmp_path / "base.safetensors", "--lora", f"{tmp_path / 'dora.safetensors'}:0.7",
                 "--save_to", tmp_path / "m.safetensors") == 0
    assert (run(load_flux(str(tmp_path / "m.safetensors")), flux_inputs()) - expected).abs().max() <= 1e-5


def merged_equals_unmerged(tmp_path, model, named_args_ratios, base="base.safetensors", save_to="m.safetensors"):
    """(the networks' effect on the output, the merge's error against them) for LyCORIS files merged into `base`."""
    nets = []
    for name, algo, ratio in named_args_ratios:
        net = LycorisNetwork(model, "flux", 4, 2.0, network_args=algo)
        random_(net, 0.3)
        net.save(str(tmp_path / f"{name}.safetensors"))
        nets.append((net, ratio))
    unmerged = run(model, flux_inputs())
    for net, ratio in nets:
        net.set_multiplier(ratio), net.apply()
    expected = run(model, flux_inputs())
    for net, _ in reversed(nets):
        net.remove()
    specs = [f"{tmp_path / name}.safetensors:{ratio}" for name, _, ratio in named_args_ratios]
    assert merge("--model", tmp_path / base, "--lora", *specs, "--save_to", tmp_path / save_to) == 0
    return (expected - unmerged).abs().max(), (run(load_flux(str(tmp_path / save_to)), flux_inputs()) - expected).abs().max()


@pytest.mark.parametrize("files", [
    [("lokr", {"algo": "lokr", "factor": 4}, 0.8), ("loha", {"algo": "loha"}, -0.5), ("locon", {"algo": "locon"}, 0.5)],
    [("dokr", {"algo": "lokr", "factor": 8, "dora_wd": True}, 0.6)],  # weight-decomposed: each alone
    [("dora", {"algo": "locon", "dora_wd": True}, 1.0)],
], ids=["lokr+loha+locon", "lokr-dora_wd", "locon-dora_wd"])
def test_lycoris_merge_equals_the_unmerged_network(tmp_path, files):
    """alpha != rank, where lycoris' get_merged_weight would apply alpha / rank twice."""
    effect, error = merged_equals_unmerged(tmp_path, flux_base(tmp_path), files)
    assert effect > 0.05 and error <= 1e-5, (effect, error)


@pytest.mark.parametrize("algo", [{"algo": "lokr", "factor": 4}, {"algo": "loha"}, {"algo": "locon"}],
                         ids=["lokr", "loha", "locon"])
def test_a_dora_wd_file_applies_at_a_ratio_as_comfyui_does(tmp_path, algo):
    """ComfyUI applies a dora_wd module at strength s as W + s * (DoRA(W + dW) - W). LyCORIS' own multiplier blends
    the magnitude alone and keeps the whole dW: merge_lora and generate's forward at ratio 0 were not the base
    (0.25 off, the update 0.23), at 0.5 1.5-2x the update off ComfyUI's. Merged and unmerged, each ratio now."""
    from networks.lycoris_network import LycorisDelta, lycoris_deltas

    model = flux_base(tmp_path)
    net = LycorisNetwork(model, "flux", 4, 2.0, network_args={**algo, "dora_wd": True})
    random_(net, 0.3)
    net.save(str(tmp_path / "dora_wd.safetensors"))
    tensors = {k: v for k, v in net.state_dict().items()}
    weights = {f"lora_unet_{n}".replace(".", "_"): m.weight.detach().float() for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}
    deltas: dict[str, LycorisDelta] = lycoris_deltas(tensors)
    for name, delta in deltas.items():
        w = weights[name]
        full = delta.merged(w, 1.0) - w
        assert torch.equal(delta.merged(w, 0.0), w)
        assert (delta.merged(w, 0.5) - w - 0.5 * full).abs().max() <= 1e-6 * full.abs().max()
    linears = {f"lora_unet_{n}".replace(".", "_"): m for n, m in model.named_modules()
               if isinstance(m, torch.nn.Linear)}
    g = torch.Generator().manual_seed(3)
    xs = {name: torch.randn(3, linears[name].in_features, generator=g) for name in deltas}
    outputs = {}
    for ratio in (0.0, 0.5, 1.0):  # each module's output (its forward) is linear in its weight
        loaded = LycorisNetwork.from_weights(model, "flux", str(tmp_path / "dora_wd.safetensors"), multiplier=ratio)
        loaded.apply()
        with torch.no_grad():
            outputs[ratio] = {name: linears[name](x) for name, x in xs.items()}
        loaded.remove()
    for name, x in xs.items():
        with torch.no_grad():
            base = linears[name](x)
        change = (outputs[1.0][name] - base).abs().max()
        assert change > 1e-3 and (outputs[0.0][name] - base).abs().max() <= 1e-6 * change
        assert (outputs[0.5][name] - (base + outputs[1.0][name]) / 2).abs().max() <= 1e-5 * change


def test_a_lycoris_full_file_merges_as_the_unmerged_network(tmp_path):
    """LyCORIS' full type (`diff` and `diff_b`: whole weight and bias deltas) was refused ("is a FullModule: merging
    supports LoKr, LoHa and LoCon"); it merges as ComfyUI patches it (W + ratio * diff), the output of LyCORIS' own
    forward."""
    model = flux_base(tmp_path)
    base = run(model, flux_inputs())
    net = LycorisNetwork(model, "flux", 4, 2.0, network_args={"algo": "full"})
    net.apply()  # the module holds the whole weight from here on: its file's diff is that less the original
    random_(net, 0.3)
    net.save(str(tmp_path / "full.safetensors"))
    net.set_multiplier(0.7)
    expected = run(model, flux_inputs())
    net.remove()
    assert merge("--model", tmp_path / "base.safetensors", "--lora", f"{tmp_path / 'full.safetensors'}:0.7",
                 "--save_to", tmp_path / "m.safetensors") == 0
    effect, error = (expected - base).abs().max(), (run(load_flux(str(tmp_path / "m.safetensors")), flux_inputs()) - expected).abs().max()
    assert effect > 0.05 and error <= 1e-5, (effect, error)


def test_a_lycoris_algo_merge_cannot_write_is_one_line_and_no_output(tmp_path, capsys):
    model = flux_base(tmp_path)
    LycorisNetwork(model, "flux", 4, network_args={"algo": "diag-oft"}).save(str(tmp_path / "oft.safetensors"))
    capsys.readouterr()
    assert merge("--model", tmp_path / "base.safetensors", "--lora", tmp_path / "oft.safetensors",
                 "--save_to", tmp_path / "m.safetensors") == 2
    assert "merging supports LoKr, LoHa and LoCon" in only_line(capsys.readouterr().err)
    assert not (tmp_path / "m.safetensors").exists()


def test_dora_converts_kohya_diffusers_kohya_exactly_and_lycoris_is_refused(tmp_path, capsys):
    model = flux_base(tmp_path)
    dora = LoRANetwork(model, "flux", 4, 2.0, network_args={"dora": True, "train_modulation": True})
    random_(dora, 0.5)
    dora.save(str(tmp_path / "dora.safetensors"))
    for args in (["dora.safetensors", "d.safetensors", "--to", "diffusers"], ["d.safetensors", "back.safetensors", "--to", "kohya"]):
        assert convert_lora.main([str(tmp_path / args[0]), str(tmp_path / args[1]), *args[2:]]) == 0
    dora.apply()
    expected = run(model, flux_inputs())
    dora.remove()
    back = LoRANetwork.from_weights(model, "flux", str(tmp_path / "back.safetensors"))
    back.apply()
    assert (run(model, flux_inputs()) - expected).abs().max() <= 1e-5
    back.remove()
    lokr = LycorisNetwork(model, "flux", 4, network_args={"algo": "lokr"})
    lokr.save(str(tmp_path / "lokr.safetensors"))
    capsys.readouterr()
    assert convert_lora.main([str(tmp_path / "lokr.safetensors"), str(tmp_path / "x.safetensors"), "--to", "diffusers"]) == 2
    line = only_line(capsys.readouterr().err)
    assert "a LyCORIS file (LoKr) has no kohya/diffusers LoRA form" in line and "Flux2 and Z-Image" in line
    assert "in ai-toolkit's diffusion_model.* names: --to comfy writes those for them" in line  # not our lora_unet_*
    assert not (tmp_path / "x.safetensors").exists()


def test_lycoris_files_are_read_by_the_one_reader_into_either_naming(tmp_path, capsys):
    """merge_lora resolved LyCORIS names itself: a LoKr file into a diffusers-named base crashed with
    "AttributeError: 'LycorisDelta' object has no attribute 'up'" (its BFL modules went through the down/up
    split); then a fused module (qkv -> to_q / to_k / to_v, linear1) was refused, so no LyCORIS file trained on
    BFL names merged into a diffusers folder. networks/lora_reader.py lycoris_for_model renames what maps whole
    (img_attn.proj -> attn.to_out.0) and gives each split part its rows of the whole delta (RowsOfFused): the
    merged folder computes what the unmerged networks do, at ratio 0 it is the base; dora_wd is one line."""
    from safetensors.torch import load_file

    from library.models.flux1.checkpoint import save_flux_diffusers
    from tests.test_merge_convert import FLUX_CFG

    model = flux_base(tmp_path)
    save_flux_diffusers(model, FLUX_CFG, str(tmp_path / "diffusers"))
    files = [("lokr", {"algo": "lokr", "factor": 4}, 0.8), ("loha", {"algo": "loha"}, -0.5),
             ("locon", {"algo": "locon"}, 0.5)]
    effect, error = merged_equals_unmerged(tmp_path, model, files, base="diffusers", save_to="m")
    assert effect > 0.05 and error <= 1e-5, (effect, error)
    assert merge("--model", tmp_path / "diffusers", "--lora", f"{tmp_path / 'loha.safetensors'}:0",
                 "--save_to", tmp_path / "zero") == 0
    zero, source = (load_file(str(tmp_path / p / "diffusion_pytorch_model.safetensors")) for p in ("zero", "diffusers"))
    assert zero.keys() == source.keys() and all(torch.equal(zero[k], source[k]) for k in zero)
    dokr = LycorisNetwork(model, "flux", 4, 2.0, network_args={"algo": "lokr", "dora_wd": True})
    dokr.save(str(tmp_path / "dokr.safetensors"))
    capsys.readouterr()
    assert merge("--model", tmp_path / "diffusers", "--lora", tmp_path / "dokr.safetensors",
                 "--save_to", tmp_path / "d") == 2
    line = only_line(capsys.readouterr().err)
    assert "LyCORIS module 'double_blocks.0.img_attn.qkv' is in the other naming, where 'double_blocks.0.img_attn.qkv' " \
           "is the rows transformer_blocks.0.attn.to_q [0:64] + " in line and "weight-decomposed (dora_wd" in line
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("algo", [{"algo": "lokr", "factor": 4}, {"algo": "loha"}, {"algo": "lokr", "factor": 4, "dora_wd": True}],
                         ids=["lokr", "loha", "lokr-dora_wd"])  # a Linear's LoCon is a down / up LoRA: read as one
def test_zimage_lycoris_merge_into_the_fused_single_file_equals_the_diffusers_merge_fused(tmp_path, algo):
    """A Z-Image LyCORIS file (to_q / to_k / to_v) into the single file (fused attention.qkv: the only GGUF and
    ComfyUI fp8 source) was refused ("LyCORIS factors do not split or join by rows"); each part merges into its
    rows of qkv, exactly (fp32) what merging into the diffusers folder and fusing its weights gives."""
    from safetensors.torch import load_file

    from library.models.zimage.checkpoint import save_zimage_diffusers, save_zimage_single_file, to_single_file_state_dict
    from library.models.zimage.model import ZImage
    from library.models.zimage.tiny import tiny_config
    from tests.test_merge_convert import randomized

    model = randomized(ZImage(tiny_config()), 2)
    save_zimage_single_file(model, str(tmp_path / "base.safetensors"), tiny_config())
    save_zimage_diffusers(model, tiny_config(), str(tmp_path / "diffusers"))
    net = LycorisNetwork(model, "zimage", 4, 2.0, network_args=algo)
    random_(net, 0.3)
    net.save(str(tmp_path / "ly.safetensors"))
    lora = f"{tmp_path / 'ly.safetensors'}:0.7"
    assert merge("--model", tmp_path / "base.safetensors", "--lora", lora, "--save_to", tmp_path / "m.safetensors") == 0
    assert merge("--model", tmp_path / "diffusers", "--lora", lora, "--save_to", tmp_path / "m") == 0
    fused = load_file(str(tmp_path / "m.safetensors"))
    want = to_single_file_state_dict(load_file(str(tmp_path / "m" / "diffusion_pytorch_model.safetensors")))
    base = load_file(str(tmp_path / "base.safetensors"))
    assert sorted(fused) == sorted(want) and fused["layers.0.attention.qkv.weight"].dtype == torch.float32
    assert (fused["layers.0.attention.qkv.weight"] - base["layers.0.attention.qkv.weight"]).abs().max() > 0.01
    assert max((fused[k] - want[k]).abs().max().item() for k in fused) == 0.0


def test_another_familys_lycoris_file_is_named_by_merge(tmp_path, capsys):
    """A Qwen-Image LoKr into a FLUX.1 base said "no LoRA module matches a weight of the flux checkpoint ... is it
    a LoRA for another model?"; now what lora_info reports, as for a down / up LoRA."""
    from library.models.qwen_image.model import QwenImage, QwenImageConfig

    flux_base(tmp_path)
    qwen = QwenImage(QwenImageConfig(num_layers=1, attention_head_dim=32, num_attention_heads=2, joint_attention_dim=32,
                                     axes_dims_rope=(8, 12, 12)))
    LycorisNetwork(qwen, "qwen_image", 4, 2.0, network_args={"algo": "lokr", "factor": 4}).save(str(tmp_path / "q.safetensors"))
    capsys.readouterr()
    assert merge("--model", tmp_path / "base.safetensors", "--lora", tmp_path / "q.safetensors", "--save_to", tmp_path / "m.safetensors") == 2
    assert only_line(capsys.readouterr().err) == (f"error: {tmp_path / 'q.safetensors'}: a LoRA for Qwen-Image (tools/lora_info.py: "
                                                  f"arch qwen_image, diffusers names), not for this FLUX.1 model")


def test_a_part_of_other_rows_than_its_fused_module_gives_is_one_checkpoint_error():
    """RowsOfFused on a checkpoint of other sizes raised torch's broadcast RuntimeError, which merge_lora does not
    turn into its one line."""
    from library.io import CheckpointError
    from networks.lora_reader import RowsOfFused, WholeOfFused

    class Delta:  # a LyCORIS module's merge: W + ratio * ones
        name, source = "lora_unet_double_blocks_0_img_attn_qkv", "lokr.safetensors"

        def merged(self, weight, multiplier=1.0):
            return weight + multiplier

    part = RowsOfFused(WholeOfFused(Delta(), 12, 1), [(4, 8)])
    assert torch.equal(part.merged(torch.zeros(4, 3), 0.5), torch.full((4, 3), 0.5))
    with pytest.raises(CheckpointError, match="'lora_unet_double_blocks_0_img_attn_qkv' gives 4 rows of its fused "
                                              "weight to a part of 5 rows"):
        part.merged(torch.zeros(5, 3))


def test_the_parts_of_a_fused_lycoris_module_share_one_whole_delta(tmp_path, monkeypatch):
    """RowsOfFused computed the whole fused delta from zeros once per part (to_q / to_k / to_v, and linear1's four
    parts: 4 x 21504 x 3072 float32 at FLUX.1's width, bench/bench_merge.py --lokr --diffusers); the parts of one
    module share it (WholeOfFused), computed once and released after the last part. The merged folder is unchanged:
    exactly (fp32) what computing it for each part gave, and the merge into the BFL file split into the folder's names."""
    from safetensors.torch import load_file

    from library.models.flux1.checkpoint import flux_to_diffusers_state_dict, save_flux_diffusers
    from networks import lora_reader, lycoris_network

    model = flux_base(tmp_path)
    save_flux_diffusers(model, FLUX_CFG, str(tmp_path / "diffusers"))
    net = LycorisNetwork(model, "flux", 4, 2.0, network_args={"algo": "lokr", "factor": 4})
    random_(net, 0.3)
    net.save(str(tmp_path / "lokr.safetensors"))
    from_zeros = []  # the modules whose whole delta was computed (merged into zeros of the fused shape)
    merged = lycoris_network.LycorisDelta.merged

    def counted(self, weight, multiplier=1.0):
        if not weight.any():
            from_zeros.append(self.name)
        return merged(self, weight, multiplier)

    monkeypatch.setattr(lycoris_network.LycorisDelta, "merged", counted)
    lora = f"{tmp_path / 'lokr.safetensors'}:0.7"
    assert merge("--model", tmp_path / "base.safetensors", "--lora", lora, "--save_to", tmp_path / "m.safetensors") == 0
    assert from_zeros == []
    assert merge("--model", tmp_path / "diffusers", "--lora", lora, "--save_to", tmp_path / "m") == 0
    fused = ["lora_unet_double_blocks_0_img_attn_qkv", "lora_unet_double_blocks_0_txt_attn_qkv", "lora_unet_single_blocks_0_linear1"]
    assert sorted(from_zeros) == fused  # once each
    shared = lora_reader.WholeOfFused
    monkeypatch.setattr(lora_reader, "WholeOfFused", lambda delta, rows, parts: shared(delta, rows, 1))  # each part its own
    from_zeros.clear()
    assert merge("--model", tmp_path / "diffusers", "--lora", lora, "--save_to", tmp_path / "each") == 0
    assert sorted(from_zeros) == [fused[0]] * 3 + [fused[1]] * 3 + [fused[2]] * 4  # what the parts computed before
    folder, each, base = (load_file(str(tmp_path / p / "diffusion_pytorch_model.safetensors")) for p in ("m", "each", "diffusers"))
    want = flux_to_diffusers_state_dict(load_file(str(tmp_path / "m.safetensors")))
    assert sorted(folder) == sorted(each) == sorted(want) and folder["transformer_blocks.0.attn.to_q.weight"].dtype == torch.float32
    assert (folder["single_transformer_blocks.0.proj_mlp.weight"] - base["single_transformer_blocks.0.proj_mlp.weight"]).abs().max() > 0.01
    assert all(torch.equal(folder[k], each[k]) for k in folder)
    assert max((folder[k] - want[k]).abs().max().item() for k in folder) <= 1e-6  # W + dW against W[rows] + dW[rows]


def lycoris_module(kind: str, name: str, layer: torch.nn.Linear):
    """A LyCORIS module of `layer` with every factor random (LoKr starts with one at zero), as trained."""
    from lycoris.modules import LohaModule, LokrModule

    make = {"lokr": lambda: LokrModule(name, layer, 1.0, 4, 2.0, factor=4),  # low-rank w2, alpha / rank 0.5
            "lokr_both": lambda: LokrModule(name, layer, 1.0, 1, 2.0, factor=4, decompose_both=True),
            "lokr_full": lambda: LokrModule(name, layer, 1.0, 4, 2.0, factor=4, full_matrix=True),  # scale 1
            "loha": lambda: LohaModule(name, layer, 1.0, 4, 2.0)}[kind]
    torch.manual_seed(3)
    module = make()
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape) * 0.3)
    return module.eval()


@pytest.mark.parametrize("kind", ["lokr", "lokr_both", "lokr_full", "loha"])
def test_a_lycoris_merge_is_the_modules_own_weight_bit_for_bit(kind):
    """LycorisDelta builds the delta in one buffer and adds in place (a LoKr's Kronecker product scaled in place:
    LyCORIS' kron * scale made a second full-size tensor); the merged weight is bit for bit the module's own
    W + multiplier * ((W + get_weight() * scalar) - W), out of place, into a whole weight or a fused one's rows."""
    from networks.lora_reader import RowsOfFused, WholeOfFused
    from networks.lycoris_network import LycorisDelta
    from networks.lycoris_views import weight_delta

    name, layer = "lora_unet_double_blocks_0_img_attn_qkv", torch.nn.Linear(64, 96, bias=False)
    module = lycoris_module(kind, name, layer)
    tensors = {f"{name}.{k}": v.detach().clone() for k, v in module.state_dict().items()}
    w = torch.randn(96, 64, generator=torch.Generator().manual_seed(5))
    kept = w.clone()
    own = module.get_weight((96, 64))
    assert torch.equal(weight_delta(module, (96, 64)), own) and own.abs().max() > 0.1
    for ratio in (1.0, 0.7, -0.5):
        assert torch.equal(LycorisDelta(name, tensors).merged(w, ratio), w + ratio * ((w + own * module.scalar) - w))
    part = RowsOfFused(WholeOfFused(LycorisDelta(name, tensors), 96, 1), [(32, 64)])
    zeros = torch.zeros(96, 64)
    assert torch.equal(part.merged(w[32:64], 0.7), w[32:64] + (zeros + 0.7 * ((zeros + own) - zeros))[32:64])
    assert torch.equal(w, kept)  # only read


@pytest.mark.parametrize("kind", ["lokr", "loha", "locon", "lokr_dora_wd"])
def test_a_lycoris_merge_leaves_no_weight_to_the_cycle_collector(kind):
    """LyCORIS' module is a reference cycle (its hooks hold its bound methods) holding the Linear LycorisDelta builds
    it around, and that Linear held the weight merged: every merge left one weight to Python's cycle collector, which
    ran only every few modules (bench/bench_merge.py --lokr: 2.3 GiB above import at FLUX.1's width against the
    kohya LoRA's 0.6). After the merge nothing but the caller's tensor holds the weight's memory."""
    import gc

    from networks.lycoris_network import lycoris_deltas

    net_args = {"lokr": {"algo": "lokr", "factor": 4}, "loha": {"algo": "loha"}, "locon": {"algo": "locon"},
                "lokr_dora_wd": {"algo": "lokr", "factor": 4, "dora_wd": True}}[kind]
    model = Flux(FLUX_CFG)
    net = LycorisNetwork(model, "flux", 4, 2.0, network_args=net_args)
    random_(net, 0.3)
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    delta = lycoris_deltas({k: v.detach() for k, v in net.state_dict().items() if k.startswith(name + ".")})[name]
    weight = model.double_blocks[0].img_attn.qkv.weight.detach().clone()
    gc.collect()
    gc.disable()  # what the merge leaves in a cycle stays there: no collection may run in between
    try:
        merged = delta.merged(weight, 0.7)
        # plain tensors only: a worker that ran a compiled test keeps dynamo's FakeTensors, which have no data
        holders = [o for o in gc.get_objects()
                   if type(o) in (torch.Tensor, torch.nn.Parameter) and o is not weight
                   and o.data_ptr() == weight.data_ptr()]
    finally:
        gc.enable()
    assert holders == [] and (merged - weight).abs().max() > 1e-3
