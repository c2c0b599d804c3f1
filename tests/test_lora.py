"""LoRA network: math, switching, selection, fp8-like bases (its files and formats: test_lora_files.py)."""

import importlib
import re

import pytest
import torch
import torch.nn as nn

from networks import lora_files as lf
from networks.lora_module_map import bfl_to_diffusers
from networks.lora import LoRANetwork
from networks.lora_module import LoRAModule
from library.models.registry import arch_spec

# ----------------------------------------------------------------------------------------------
# Stand-in models whose qualified module names mirror the real ones


class StandIn(nn.Module):
    """Nested containers with a Linear(dim, out) at every given qualified name; forward runs every
    leaf on the same input and concatenates, so any module's change shows in the output."""

    def __init__(self, names, dim=8, out=6):
        super().__init__()
        self.leaves = list(names)
        for name in names:
            parent = self
            *path, leaf = name.split(".")
            for part in path:
                if not hasattr(parent, part):
                    parent.add_module(part, nn.Module())
                parent = getattr(parent, part)
            parent.add_module(leaf, nn.Linear(dim, out))
        self.dim = dim

    def forward(self, x):
        return torch.cat([self.get_submodule(n)(x) for n in self.leaves], -1)


def flux_names(double=3, single=4):
    names = []
    for i in range(double):
        for s in ("img", "txt"):
            names += [f"double_blocks.{i}.{s}_attn.qkv", f"double_blocks.{i}.{s}_attn.proj",
                      f"double_blocks.{i}.{s}_mlp.0", f"double_blocks.{i}.{s}_mlp.2", f"double_blocks.{i}.{s}_mod.lin"]
    for i in range(single):
        names += [f"single_blocks.{i}.linear1", f"single_blocks.{i}.linear2", f"single_blocks.{i}.modulation.lin"]
    return names + ["img_in", "final_layer.linear"]


def qwen_names(blocks=2):
    names = ["img_in", "proj_out"]
    for i in range(blocks):
        b = f"transformer_blocks.{i}."
        names += [b + "attn." + m for m in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out")]
        names += [b + f"{s}_mlp.net.{m}" for s in ("img", "txt") for m in ("0.proj", "2")]
        names += [b + "img_mod.1", b + "txt_mod.1"]
    return names


def llm_names(layers=2):
    names = ["lm_head"]
    for i in range(layers):
        names += [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkvo"]
        names += [f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up", "down")]
    return names


def selected(net):
    return {m.name: m.rank for m in net.lora_modules()}


def randomize(net, scale=0.1):
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, scale)


def assert_same_deltas(a, b, tol=1e-5):
    assert set(a) == set(b)
    for p in a:
        assert (a[p].delta() - b[p].delta()).abs().max() <= tol * a[p].delta().abs().max(), p


# ----------------------------------------------------------------------------------------------
# Module math and switching


def test_zero_initialised_up_leaves_output_unchanged():
    model = StandIn(flux_names())
    x = torch.randn(2, 5, 8)
    before = model(x)
    net = LoRANetwork(model, "flux", rank=4, alpha=2)
    net.apply()
    assert torch.equal(model(x), before)
    assert all(m.lora_up.weight.abs().sum() == 0 and m.lora_down.weight.abs().sum() > 0 for m in net.lora_modules())


def test_delta_is_multiplier_times_alpha_over_rank_times_up_down():
    base = nn.Linear(8, 6)
    lora = LoRAModule("m", base, rank=4, alpha=2.0)
    nn.init.normal_(lora.lora_up.weight)
    lora.apply_to_base()
    x = torch.randn(3, 8)
    expected = (x @ lora.lora_down.weight.T @ lora.lora_up.weight.T) * (2.0 / 4)
    base_out = torch.nn.functional.linear(x, base.weight, base.bias)
    assert lora.scale == 0.5
    assert (base(x) - base_out - expected).abs().max() < 1e-6
    lora.multiplier = -1.5
    assert (base(x) - base_out + 1.5 * expected).abs().max() < 1e-6
    assert LoRAModule("z", nn.Linear(8, 6), rank=4, alpha=0).scale == 1.0  # alpha 0 means alpha = rank
    assert LoRAModule("n", nn.Linear(8, 6), rank=4, alpha=None).scale == 1.0


@pytest.mark.parametrize("autocast", [False, True])
def test_the_up_projection_adds_into_the_base_output_in_one_gemm(autocast):
    """Where the base output, the rank-r activations and the up weight share a dtype (float32, or
    autocast's bf16), the delta is summed into the output by the up GEMM itself (addmm, the scale on
    the rank-r side): the same output and LoRA gradients as out + scale * up(down(x)), and no
    [tokens, out] multiply or add in the graph (they were ~4% of a mid-size CPU step)."""
    torch.manual_seed(0)
    base = nn.Linear(8, 6)
    lora = LoRAModule("m", base, rank=4, alpha=2.0)
    nn.init.normal_(lora.lora_up.weight)
    lora.multiplier = 0.7
    lora.apply_to_base()
    x = torch.randn(2, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        got = base(x)
        reference = nn.functional.linear(x, base.weight, base.bias) + (
            lora.lora_up(lora.lora_down(x)) * (0.7 * 0.5)).to(got.dtype)
    assert got.grad_fn.next_functions[0][0].name() == "AddmmBackward0"  # a view of the fused GEMM's output
    grads = [torch.autograd.grad(y.float().square().sum(), [lora.lora_down.weight, lora.lora_up.weight])
             for y in (got, reference)]
    tolerance = dict(rtol=2e-2, atol=2e-2) if autocast else dict(rtol=1e-5, atol=1e-6)
    assert got.dtype == reference.dtype == (torch.bfloat16 if autocast else torch.float32)
    torch.testing.assert_close(got, reference, **tolerance)
    for fused, unfused in zip(*grads):
        torch.testing.assert_close(fused, unfused, **tolerance)


def test_enabled_multiplier_and_remove_switch_the_lora():
    model = StandIn(llm_names())
    x = torch.randn(2, 3, 8)
    base_out = model(x)
    net = LoRANetwork(model, "llm", rank=2)
    randomize(net)
    net.apply()
    on = model(x)
    assert (on - base_out).abs().max() > 1e-3
    net.enabled = False
    assert not net.enabled and torch.equal(model(x), base_out)
    net.enabled = True
    net.set_multiplier(0.5)
    assert (model(x) - base_out - 0.5 * (on - base_out)).abs().max() < 1e-6
    net.set_multiplier(0.0)
    assert torch.equal(model(x), base_out)
    net.set_multiplier(1.0)
    net.remove()
    assert torch.equal(model(x), base_out)
    assert all("forward" not in model.get_submodule(m.name).__dict__ for m in net.lora_modules())
    net.apply()
    assert torch.equal(model(x), on)


def test_merge_equals_independent_formula_and_unmerged_output():
    model = StandIn(qwen_names())
    x = torch.randn(2, 3, 8)
    originals = {n: model.get_submodule(n).weight.detach().clone() for n in model.leaves}
    net = LoRANetwork(model, "qwen_image", rank=4, alpha=3, multiplier=0.7)
    randomize(net)
    net.apply()
    unmerged = model(x)
    expected = {m.name: originals[m.name] + 0.7 * (3 / 4) * m.lora_up.weight.detach() @ m.lora_down.weight.detach()
                for m in net.lora_modules()}
    net.merge_into_model()
    for name, w in expected.items():
        assert (model.get_submodule(name).weight - w).abs().max() <= 1e-6
    assert all("forward" not in model.get_submodule(n).__dict__ for n in expected)  # unpatched
    assert (model(x) - unmerged).abs().max() <= 1e-5


def test_merge_keeps_base_dtype_and_computes_in_float32():
    base = nn.Linear(8, 6).to(torch.bfloat16)
    lora = LoRAModule("m", base, rank=2, alpha=2)
    nn.init.normal_(lora.lora_up.weight, std=1e-3)
    expected = (base.weight.float() + lora.lora_up.weight @ lora.lora_down.weight).to(torch.bfloat16)
    lora.merge_into_base()
    assert base.weight.dtype == torch.bfloat16
    assert torch.equal(base.weight.detach(), expected.detach())


def test_only_lora_parameters_train():
    model = StandIn(flux_names())
    net = LoRANetwork(model, "flux", rank=2)
    randomize(net)
    net.apply()
    model(torch.randn(2, 8)).square().sum().backward()
    assert all(not p.requires_grad and p.grad is None for p in model.parameters())
    params = net.trainable_parameters()
    assert len(params) == 2 * len(net.lora_modules()) and all(p.grad is not None and p.grad.abs().sum() > 0 for p in params)
    assert {id(p) for p in params} == {id(p) for p in net.parameters()}


def test_dropouts_follow_the_lora_network_mode_not_the_frozen_base():
    """The trainer keeps the frozen base in eval: the LoRA modules' own mode must decide."""
    model = StandIn(llm_names(1))
    x = torch.randn(4, 3, 8)
    plain = LoRANetwork(model, "llm", rank=4)
    randomize(plain)
    plain.apply()
    reference = model(x)
    plain.remove()
    net = LoRANetwork(model, "llm", rank=4, network_args={"dropout": 0.5, "rank_dropout": "0.5", "module_dropout": 0.3})
    net.load_state_dict(plain.state_dict())
    net.apply()
    assert not net.training  # a new network starts in eval: tools never drop out by accident
    assert torch.equal(model(x), reference)
    model.eval()
    net.train()  # base in eval (as in training), network in train: the dropouts act
    assert (model(x) - reference).abs().max() > 1e-3
    net.eval()
    model.train()
    assert torch.equal(model(x), reference)


def test_rank_dropout_keeps_the_expected_delta():
    base = nn.Linear(8, 6, bias=False)
    nn.init.zeros_(base.weight)
    lora = LoRAModule("m", base, rank=64, alpha=64, rank_dropout=0.25)
    nn.init.normal_(lora.lora_up.weight)
    lora.apply_to_base()
    x = torch.randn(1, 1, 8).expand(4000, 1, 8)  # one sample, many masks
    with torch.no_grad():
        mean = base(x).mean(0)
        lora.eval()
        exact = base(x[:1])[0]
    assert (mean - exact).abs().max() / exact.abs().max() < 0.1


# ----------------------------------------------------------------------------------------------
# Selection from the TARGETS table and network_args


def test_flux_default_targets_are_sd_scripts_every_block_linear_with_modulation():
    """sd-scripts' lora_flux default: every Linear inside DoubleStreamBlock / SingleStreamBlock."""
    names = flux_names(3, 4)
    net = LoRANetwork(StandIn(names), "flux", rank=4)
    assert set(selected(net)) == {n for n in names if n.startswith(("double_blocks.", "single_blocks."))}
    assert len(net.lora_modules()) == 3 * 2 * 5 + 4 * 3
    off = LoRANetwork(StandIn(names), "flux", rank=4, network_args={"train_modulation": "false"})
    assert not any("mod" in n for n in selected(off)) and len(off.lora_modules()) == 3 * 2 * 4 + 4 * 2


def test_flux_sd_scripts_type_dims_and_in_dims():
    names = flux_names(2, 2) + ["txt_in"]  # without txt_in, in_dims' 7 for it is refused (it ranked no module)
    typed = LoRANetwork(StandIn(names), "flux", rank=4, network_args={
        "img_attn_dim": 8, "txt_attn_dim": 0, "img_mlp_dim": 2, "txt_mlp_dim": 3, "img_mod_dim": 0, "txt_mod_dim": 5,
        "single_dim": 6, "single_mod_dim": 0, "in_dims": "[1, 0, 0, 0, 7]"})
    ranks = selected(typed)
    assert ranks["double_blocks.1.img_attn.qkv"] == 8 and ranks["double_blocks.0.img_mlp.2"] == 2
    assert ranks["double_blocks.0.txt_mlp.0"] == 3 and ranks["double_blocks.1.txt_mod.lin"] == 5
    assert ranks["single_blocks.1.linear1"] == 6 and ranks["img_in"] == 1 and ranks["txt_in"] == 7
    assert not any("txt_attn" in n or "img_mod" in n or "modulation" in n for n in ranks)
    assert "final_layer.linear" not in ranks and len(ranks) == 2 * (2 + 2 + 2 + 1) + 2 * 2 + 2
    with pytest.raises(ValueError, match="in_dims.*expected 5 ranks"):
        LoRANetwork(StandIn(names), "flux", rank=4, network_args={"in_dims": "[1, 2]"})


@pytest.mark.parametrize("key", ["split_qkv", "train_t5xxl"])
def test_sd_scripts_args_we_cannot_honour_are_refused_with_the_reason(key):
    assert LoRANetwork(StandIn(flux_names(1, 1)), "flux", rank=4, network_args={key: "False"}).lora_modules()
    with pytest.raises(ValueError, match=f"'{key}=true' is not supported: .{{40}}"):
        LoRANetwork(StandIn(flux_names(1, 1)), "flux", rank=4, network_args={key: "True"})


def test_flux_train_blocks_indices_and_per_type_ranks():
    model = StandIn(flux_names(3, 4))
    single = LoRANetwork(model, "flux", rank=4, network_args={"train_blocks": "single", "train_single_block_indices": "0-1,3"})
    assert set(selected(single)) == {f"single_blocks.{i}.{m}" for i in (0, 1, 3) for m in ("linear1", "linear2", "modulation.lin")}
    typed = LoRANetwork(model, "flux", rank=4, network_args={
        "train_double_block_indices": "1", "train_single_block_indices": "none", "attn_dim": 8, "mlp_dim": 0, "mod_dim": 2})
    assert selected(typed) == {
        **{f"double_blocks.1.{s}_attn.{p}": 8 for s in ("img", "txt") for p in ("qkv", "proj")},
        **{f"double_blocks.1.{s}_mod.lin": 2 for s in ("img", "txt")},
    }
    with_mod = LoRANetwork(model, "flux", rank=4, network_args={"train_modulation": "true", "train_blocks": "double"})
    assert len(with_mod.lora_modules()) == 3 * 2 * 5


def test_include_and_exclude_patterns():
    model = StandIn(flux_names(2, 2))
    net = LoRANetwork(model, "flux", rank=4, network_args={"train_modulation": False,
        "exclude_patterns": [r".*txt_.*", r"single_blocks\.1\..*"], "include_patterns": [r"double_blocks\.0\.txt_attn\.qkv", ".*modulation.*"]})
    expected = {f"double_blocks.{i}.img_{p}" for i in (0, 1) for p in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2")}
    expected |= {"single_blocks.0.linear1", "single_blocks.0.linear2", "double_blocks.0.txt_attn.qkv"}
    expected |= {f"single_blocks.{i}.modulation.lin" for i in (0, 1)}  # include overrides the default-off type
    assert set(selected(net)) == expected
    # whole names, as musubi-tuner's fullmatch: "double_blocks\.1" searched dropped blocks 1 and 10-18 of FLUX.1
    searched = {"exclude_patterns": [r"double_blocks\.1"]}
    with pytest.raises(ValueError, match="matches no LoRA target module"):
        LoRANetwork(StandIn(flux_names(12, 1)), "flux", rank=4, network_args=searched)
    one = LoRANetwork(StandIn(flux_names(12, 1)), "flux", rank=4, network_args={"exclude_patterns": [r"double_blocks\.1\..*"]})
    assert sorted({int(n.split(".")[1]) for n in selected(one) if n.startswith("double")}) == [0] + list(range(2, 12))


def test_qwen_image_and_llm_targets_and_block_indices():
    qwen = LoRANetwork(StandIn(qwen_names(3)), "qwen_image", rank=4, network_args={"block_indices": [0, 2]})
    assert len(qwen.lora_modules()) == 2 * 12 and not any(".1." in n or "mod" in n for n in selected(qwen))
    qwen_mod = LoRANetwork(StandIn(qwen_names(1)), "qwen_image", rank=4, network_args={"mod_dim": 1})
    assert selected(qwen_mod)["transformer_blocks.0.txt_mod.1"] == 1
    llm = LoRANetwork(StandIn(llm_names(2)), "llm", rank=4, network_args={"mlp_dim": 0})
    assert set(selected(llm)) == {f"model.layers.{i}.self_attn.{p}_proj" for i in (0, 1) for p in "qkvo"}


@pytest.mark.parametrize("args, message", [
    ({"train_blockz": "all"}, "unknown key 'train_blockz'"),
    ({"block_indices": "0"}, "unknown key 'block_indices' for family 'flux'"),
    ({"include_patterns": [r"double_blocks\.0\.img_attn\.qkvx"]}, "matches no LoRA target module"),
    ({"exclude_patterns": "(unclosed"}, "bad regex"),
    ({"train_double_block_indices": "0-9"}, "index 3 is out of range"),
    ({"train_double_block_indices": "a-b"}, "bad range"),
    ({"train_double_block_indices": "0,2-1"}, "bad range '2-1'"),  # selected no block of the range before
    ({"train_blocks": "both"}, "expected all, double or single"),
    ({"dropout": "lots"}, "expected a number"),
    ({"train_blocks": "single", "single_dim": 0, "single_mod_dim": 0}, "select no module"),
    ({"rank_dropout": 1.0}, "'rank_dropout': expected a probability in [0, 1), got 1.0"),
    ({"module_dropout": "1"}, "'module_dropout': expected a probability in [0, 1)"),
    ({"dropout": -0.1}, "'dropout': expected a probability in [0, 1)"),
    ({"img_attn_dim": "4.5"}, "'img_attn_dim': expected an integer, got '4.5'"),
    ({"attn_dim": -1}, "'attn_dim': expected a rank >= 0"),
    ({"in_dims": "[1, 0, 0, 0, 2.5]"}, "'in_dims': expected an integer"),
    ({"loraplus_lr_ratio": 0}, "'loraplus_lr_ratio': expected a finite number > 0, got 0"),
    ({"dora": "maybe"}, "'dora': expected true/false"),
    # raw TypeErrors ('float' object is not iterable) or "the model has None such blocks" before
    ({"train_double_block_indices": 1.5}, "'train_double_block_indices': expected block indices like '0-5,10'"),
    ({"train_double_block_indices": True}, "'train_double_block_indices': expected block indices like '0-5,10'"),
    ({"train_double_block_indices": {1: 2}}, "'train_double_block_indices': expected block indices like '0-5,10'"),
    ({"include_patterns": 5}, "'include_patterns': expected a regex or a list of regexes, got 5"),
])
def test_bad_network_args_raise_naming_the_key(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LoRANetwork(StandIn(flux_names(3, 2)), "flux", rank=4, network_args=args)


def test_a_rank_for_a_type_the_model_lacks_is_refused_and_a_zero_passes():
    """A model without guidance_in (a released config without the guidance embedder; a target regex with a
    typo reads the same) trained nothing for guidance_in_dim without a word."""
    with pytest.raises(ValueError, match=re.escape("network_args 'guidance_in_dim': this flux model has no guidance_in module")):
        LoRANetwork(StandIn(flux_names(1, 1)), "flux", rank=4, network_args={"guidance_in_dim": 4})
    assert LoRANetwork(StandIn(flux_names(1, 1)), "flux", rank=4, network_args={"guidance_in_dim": 0}).lora_modules()
    # the same rank as in_dims' 4th entry built the network without guidance_in modules
    with pytest.raises(ValueError, match=re.escape("network_args 'in_dims': this flux model has no guidance_in module")):
        LoRANetwork(StandIn(flux_names(1, 1)), "flux", rank=4, network_args={"in_dims": "[0, 0, 0, 8, 0]"})
    assert "img_in" in selected(LoRANetwork(StandIn(flux_names(1, 1)), "flux", rank=4, network_args={"in_dims": "[2, 0, 0, 0, 0]"}))


@pytest.mark.parametrize("args, said", [
    ({"single_dim": 0, "include_patterns": [r"single_blocks\.0\.linear1"]}, "'single_dim' gives single rank 0"),
    ({"in_dims": "[0, 0, 0, 0, 0]", "include_patterns": ["img_in"]}, "'in_dims' gives img_in rank 0"),
])
def test_an_include_matching_only_modules_of_rank_0_is_refused(args, said):
    """The include was left out without a word (an include trains at its type's rank): 22 modules, not linear1."""
    with pytest.raises(ValueError, match=re.escape(f"network_args 'include_patterns': {args['include_patterns'][0]!r} "
                                                   f"matches only modules of rank 0 ({said})")):
        LoRANetwork(StandIn(flux_names(2, 2)), "flux", rank=4, network_args=args)
    mixed = {"single_dim": 0, "include_patterns": [r"single_blocks\.0\..*"]}  # modulation.lin has a rank: included
    assert set(selected(LoRANetwork(StandIn(flux_names(2, 2)), "flux", rank=4, network_args=mixed))) >= {"single_blocks.0.modulation.lin"}
    assert selected(LoRANetwork(StandIn(flux_names(2, 2)), "flux", rank=4, network_args={"include_patterns": ["img_in"]}))["img_in"] == 4


@pytest.mark.parametrize("args, message", [
    ({"train_blocks": "single", "train_double_block_indices": "0"},
     "network_args 'train_double_block_indices' = '0' selects double blocks, which 'train_blocks' = 'single' switches off"),
    ({"train_blocks": "double", "train_single_block_indices": "all"}, "'train_single_block_indices' = 'all' selects single"),
    ({"train_blocks": "double", "single_dim": 8},
     "network_args 'single_dim' = 8 ranks modules of the single blocks only, which 'train_blocks' = 'double' switches off"),
    ({"train_blocks": "single", "attn_dim": 8}, "'attn_dim' = 8 ranks modules of the double blocks only"),
])
def test_a_selection_of_blocks_train_blocks_switches_off_is_refused(args, message):
    """Accepted before caching, then doing nothing: the indices selected no block, the rank ranked no module."""
    with pytest.raises(ValueError, match=re.escape(message)):
        LoRANetwork(StandIn(flux_names(2, 2)), "flux", rank=4, network_args=args)


@pytest.mark.parametrize("args", [
    {"train_blocks": "single", "train_double_block_indices": "none"},  # asks for nothing
    {"train_blocks": "double", "single_dim": 0},  # skips the type
    {"train_blocks": "single", "mod_dim": 2},  # single_mod is one of mod's types
    {"train_blocks": "double", "single_dim": 2, "include_patterns": [r"single_blocks\.0\.linear1"]},  # ranks the include
])
def test_a_block_selection_train_blocks_leaves_a_use_for_passes(args):
    assert LoRANetwork(StandIn(flux_names(2, 2)), "flux", rank=4, network_args=args).lora_modules()


@pytest.mark.parametrize("args", [{"rank_dropout": 1.0}, {"img_attn_dim": 4.5}, {"train_double_block_indices": "x"},
                                  {"loraplus_lr_ratio": "many"}, {"train_modulation": "on"}, {"train_blocks": "both"},
                                  {"exclude_patterns": "(unclosed"}, {"dora": "true", "use_dora": "false"},
                                  {"train_double_block_indices": "0", "train_blocks": "single"}])
def test_network_arg_values_are_checked_without_a_model(args):
    """The config check (before minutes of caching) runs check_lora_args: rank_dropout=1 divided by
    zero at the first step and img_attn_dim=4.5 trained rank 4, both after caching."""
    from networks.lora_args import check_lora_args

    with pytest.raises(ValueError, match=f"network_args '{next(iter(args))}'"):
        check_lora_args("flux", args)


@pytest.mark.parametrize("arch, args, message", [
    # an open range was read as its first block alone (sd-scripts' parse_block_selection refuses it)
    ("flux", {"train_double_block_indices": "10-"}, "network_args 'train_double_block_indices': bad range '10-' in "
                                                    "'10-' (expected like '0-5,10', 'all' or 'none')"),
    ("flux", {"train_single_block_indices": "0-3,20-"},
     "network_args 'train_single_block_indices': bad range '20-' in '0-3,20-'"),
    ("qwen_image", {"block_indices": "30-"}, "network_args 'block_indices': bad range '30-' in '30-'"),
    ("flux", {"train_double_block_indices": "-5"}, "bad range '-5' in '-5'"),
    ("flux", {"train_double_block_indices": "3-1"}, "bad range '3-1' in '3-1'"),
    ("flux", {"train_double_block_indices": "a-b"}, "bad range 'a-b' in 'a-b'"),
    ("flux", {"train_double_block_indices": "\u00b2"}, "bad range '\u00b2'"),  # isdigit() but not int(): raw ValueError
    # inf passed 'not ratio > 0' and the loss was NaN at step 2, after caching
    ("flux", {"loraplus_lr_ratio": "inf"}, "network_args 'loraplus_lr_ratio': expected a finite number > 0, got 'inf'"),
    ("flux", {"loraplus_lr_ratio": float("-inf")}, "network_args 'loraplus_lr_ratio': expected a finite number > 0, got -inf"),
    ("flux", {"loraplus_lr_ratio": float("inf")}, "network_args 'loraplus_lr_ratio': expected a finite number > 0, got inf"),
    # re.compile(1) raised a raw TypeError
    ("flux", {"exclude_patterns": [".*img_mod.*", 1]}, "network_args 'exclude_patterns': item 1 is not a regex "
                                                       "string, got ['.*img_mod.*', 1]"),
    ("flux", {"include_patterns": [None]}, "network_args 'include_patterns': item None is not a regex string"),
])
def test_open_ranges_infinite_ratios_and_non_string_patterns_are_refused_without_a_model(arch, args, message):
    """check_lora_args is the config check that runs before caching: each of these got past it before."""
    from networks.lora_args import check_lora_args

    with pytest.raises(ValueError, match=re.escape(message)):
        check_lora_args(arch, args)


@pytest.mark.parametrize("arch", ["flux2", "chroma", "krea2", "llm"])
def test_train_modulation_is_unknown_where_the_family_has_no_modulation_types(arch):
    """Accepted before on every family, and it switched nothing where the spec has no modulation types."""
    from networks.lora_args import check_lora_args

    with pytest.raises(ValueError, match=f"unknown key 'train_modulation' for family '{arch}'"):
        check_lora_args(arch, {"train_modulation": "true"})


def test_alpha_zero_is_each_modules_own_rank_and_survives_a_save(tmp_path):
    """network_alpha = 0 means alpha = rank per module (sd-scripts, musubi-tuner): a module of its own rank
    (a *_dim or in_dims network_arg) trains at scale 1, not network_dim / its rank; the file keeps it."""
    model = StandIn(flux_names(2, 2))
    net = LoRANetwork(model, "flux", rank=16, alpha=0, network_args={"img_attn_dim": 4, "in_dims": "[2, 0, 0, 0, 0]"})
    assert {m.rank for m in net.lora_modules()} == {2, 4, 16}
    assert {(m.rank, float(m.alpha), m.scale) for m in net.lora_modules()} == {(2, 2.0, 1.0), (4, 4.0, 1.0), (16, 16.0, 1.0)}
    net.save(str(tmp_path / "a.safetensors"))
    back = LoRANetwork.from_weights(StandIn(flux_names(2, 2)), "flux", str(tmp_path / "a.safetensors"))
    assert {m.name: m.scale for m in back.lora_modules()} == {m.name: m.scale for m in net.lora_modules()}


def test_rank_above_a_layer_width_warns_once_naming_the_layer_and_the_effective_rank():
    with pytest.warns(UserWarning) as caught:
        net = LoRANetwork(StandIn(flux_names(1, 1), dim=8, out=6), "flux", rank=7)
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert ("LoRA rank 7 exceeds min(in, out) of 13 target layers (first 'double_blocks.0.img_attn.qkv': 8 in, 6 out): "
            "their update has rank at most 6") in str(caught[0].message)
    assert set(selected(net).values()) == {7}  # kept as given (sd-scripts does too): files keep their shapes


def test_loraplus_param_groups():
    net = LoRANetwork(StandIn(llm_names(1)), "llm", rank=2, network_args={"loraplus_lr_ratio": 16})
    groups = net.param_groups(1e-4)
    assert [g["name"] for g in groups] == ["lora_down", "lora_up"]
    assert groups[1]["lr"] == pytest.approx(1.6e-3) and len(groups[0]["params"]) == len(groups[1]["params"]) == 7
    assert len(LoRANetwork(StandIn(llm_names(1)), "llm", rank=2).param_groups(1e-4)) == 1


def test_network_reg_dims_rank_modules_by_regex_over_the_type_ranks_as_sd_scripts():
    """sd-scripts' network_reg_dims (refused until 2026-12-01): the first regex that re.search-es a module's
    kohya name gives its rank, over the *_dim ranks; 0 drops the module. A string or a table alike."""
    model = StandIn(flux_names(2, 2))
    text = "double_blocks_0_img=16, double_blocks_0=8 ,single_blocks_1=0"
    net = LoRANetwork(model, "flux", rank=4, network_args={"network_reg_dims": text, "attn_dim": 2})
    ranks = selected(net)
    assert {n: r for n, r in ranks.items() if n.startswith("double_blocks.0.")} == {
        **{f"double_blocks.0.img_{p}": 16 for p in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2", "mod.lin")},
        **{f"double_blocks.0.txt_{p}": 8 for p in ("attn.qkv", "attn.proj", "mlp.0", "mlp.2", "mod.lin")}}
    assert not any(n.startswith("single_blocks.1.") for n in ranks)
    assert ranks["double_blocks.1.img_attn.qkv"] == 2 and ranks["double_blocks.1.img_mlp.0"] == 4
    table = {"double_blocks_0_img": 16, "double_blocks_0": 8, "single_blocks_1": 0}
    assert selected(LoRANetwork(model, "flux", 4, network_args={"network_reg_dims": table, "attn_dim": 2})) == ranks
    assert net.lora_modules()[0].lora_down.weight.shape[0] == ranks[net.lora_modules()[0].name]


def test_network_reg_lrs_give_matching_modules_their_own_groups_and_rates():
    net = LoRANetwork(StandIn(flux_names(2, 1)), "flux", rank=2,
                      network_args={"network_reg_lrs": "single_blocks=5e-5,double_blocks_1=2e-4"})
    groups = net.param_groups(1e-4)
    assert [(g["name"], g["lr"]) for g in groups] == [("lora", 1e-4), ("reg0", 5e-5), ("reg1", 2e-4)]
    assert [(g.get("matches"), g.get("modules")) for g in groups] == [
        (None, None), ("single_blocks", 3), ("double_blocks_1", 10)]
    assert [len(g["params"]) for g in groups] == [2 * 10, 2 * 3, 2 * 10]  # double 0, single 0, double 1
    plus = LoRANetwork(StandIn(flux_names(1, 1)), "flux", rank=2,
                       network_args={"network_reg_lrs": {"single": 1e-5}, "loraplus_lr_ratio": 4})
    assert [(g["name"], g["lr"]) for g in plus.param_groups(1e-4)] == [
        ("lora_down", 1e-4), ("lora_up", 4e-4), ("reg0_down", 1e-5), ("reg0_up", 4e-5)]
    every = {id(p) for g in groups for p in g["params"]}
    assert every == {id(p) for p in net.trainable_parameters()} and len(every) == sum(len(g["params"]) for g in groups)


@pytest.mark.parametrize("args, message", [
    ({"network_reg_dims": r"double_blocks\.0=8"}, r"'double_blocks\\.0' searches no trained module's name"),
    ({"network_reg_lrs": "txt_attn=1e-4,nothing_here=1e-4"}, "'nothing_here' searches no trained module's name"),
    ({"network_reg_dims": "img_attn"}, "expected 'regex=value,regex=value'"),
    ({"network_reg_dims": "img_(=8"}, "bad regex 'img_('"),
    ({"network_reg_dims": "img_attn=-1"}, "expected a rank >= 0"),
    ({"network_reg_dims": "img_attn=4.5"}, "expected an integer"),
    ({"network_reg_lrs": "img_attn=0"}, "expected a finite rate > 0"),
    ({"network_reg_lrs": ["img_attn=1e-4"]}, "expected 'regex=value,...' or a table"),
])
def test_bad_network_reg_args_are_one_line_naming_the_key(args, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LoRANetwork(StandIn(flux_names(1, 1)), "flux", rank=2, network_args=args)


# ----------------------------------------------------------------------------------------------
# fp8-like base and real tiny models


class DequantLinear(nn.Module):
    """fp8 stand-in when library/precision/fp8.py is absent: e4m3 weight, dequantized in forward."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(linear.weight.detach().to(torch.float8_e4m3fn), requires_grad=False)
        self.bias = nn.Parameter(linear.bias.detach().clone())

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), self.bias.to(x.dtype))


def to_fp8(model: nn.Module, family: str) -> int:
    """Quantize the model's Linears: library.precision.fp8.prepare_fp8 when it exists, else DequantLinear.
    Returns the number of fp8 modules."""
    try:
        from library.precision.fp8 import prepare_fp8
    except ImportError:
        for name, module in list(model.named_modules()):
            if isinstance(module, nn.Linear):
                parent, _, leaf = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, leaf, DequantLinear(module))
    else:
        prepare_fp8(model, "fp8", arch_spec(family).fp8)
    return sum(getattr(m, "weight", torch.empty(0)).dtype == torch.float8_e4m3fn for m in model.modules())


def test_lora_on_fp8_like_base_trains_only_lora_and_refuses_merge():
    model = StandIn(llm_names(1))
    assert to_fp8(model, "llm") >= 7
    x = torch.randn(2, 3, 8)
    base_out = model(x)
    net = LoRANetwork(model, "llm", rank=4)
    randomize(net)
    net.apply()
    out = model(x)
    assert out.dtype == torch.float32 and (out - base_out).abs().max() > 1e-3
    out.square().sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.trainable_parameters())
    with pytest.raises(ValueError, match="merging into fp8"):
        net.merge_into_model()


def test_branch_output_is_cast_to_the_base_output_dtype():
    base = nn.Linear(8, 6).to(torch.bfloat16)
    lora = LoRAModule("m", base, rank=2)
    nn.init.normal_(lora.lora_up.weight)
    lora.apply_to_base()
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    out = base(x)
    assert out.dtype == torch.bfloat16 and lora.lora_up.weight.dtype == torch.float32
    branch = (x.float() @ lora.lora_down.weight.T @ lora.lora_up.weight.T).bfloat16()
    expected = torch.nn.functional.linear(x, base.weight, base.bias) + branch
    assert (out.float() - expected.float()).abs().max() <= 0.02 * expected.float().abs().max()


def test_real_tiny_flux_and_qwen_image_get_the_expected_loras():
    flux = importlib.import_module("library.models.flux1.model")
    qwen = importlib.import_module("library.models.qwen_image.model")
    cfg = flux.FluxConfig(hidden_size=16, num_heads=1, depth=2, depth_single=3, axes_dim=(4, 6, 6),
                          context_in_dim=8, vec_in_dim=8, guidance_embed=False)
    model = flux.Flux(cfg)
    net = LoRANetwork(model, "flux", rank=2, network_args={"train_modulation": True})
    assert len(net.lora_modules()) == 2 * 2 * 5 + 3 * 3
    assert {m.name for m in net.lora_modules()} <= {n for n, _ in model.named_modules()}
    randomize(net)
    net.apply()
    inputs = (torch.randn(1, 4, 64), flux.make_img_ids(1, 2, 2), torch.randn(1, 3, 8), flux.make_txt_ids(1, 3),
              torch.tensor([0.5]), torch.randn(1, 8))
    unmerged = model(*inputs)
    net.merge_into_model()
    assert (model(*inputs) - unmerged).abs().max() <= 1e-5

    qcfg = qwen.QwenImageConfig(num_layers=2, attention_head_dim=32, num_attention_heads=1, joint_attention_dim=16,
                                axes_dims_rope=(8, 12, 12))
    qnet = LoRANetwork(qwen.QwenImage(qcfg), "qwen_image", rank=2, network_args={"mod_dim": 1})
    assert len(qnet.lora_modules()) == 2 * (8 + 4 + 2)


def test_flux_network_loads_a_diffusers_named_peft_lora(tmp_path):
    flux = importlib.import_module("library.models.flux1.model")
    from library.models.flux1.checkpoint import flux_diffusers_module_map

    cfg = flux.FluxConfig(hidden_size=16, num_heads=1, depth=1, depth_single=1, axes_dim=(4, 6, 6),
                          context_in_dim=8, vec_in_dim=8, guidance_embed=False)
    net = LoRANetwork(flux.Flux(cfg), "flux", rank=2, alpha=1)
    randomize(net)
    diffusers = bfl_to_diffusers(net.lora_weights(), flux_diffusers_module_map(1, 1, 16, 64))
    lf.write_peft(diffusers, str(tmp_path / "d.safetensors"))
    fresh = LoRANetwork(flux.Flux(cfg), "flux", rank=2)
    fresh.load_weights(str(tmp_path / "d.safetensors"))
    assert_same_deltas(net.lora_weights(), fresh.lora_weights(), tol=1e-6)


def test_real_tiny_llm_in_fp8_scaled_trains_only_lora():
    llm = importlib.import_module("library.models.llm")
    fp8 = importlib.import_module("library.precision.fp8")
    cfg = llm.LLMConfig(vocab_size=32, hidden_size=16, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=24)
    model = llm.LLM(cfg)
    fp8.prepare_fp8(model, "fp8_scaled", arch_spec("llm").fp8)
    targets = {f"model.layers.{i}.{m}" for i in (0, 1) for m in
               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert all(isinstance(model.get_submodule(n), fp8.FP8Linear) for n in targets)
    ids = torch.randint(0, 32, (2, 5))
    base_out = model(ids)
    net = LoRANetwork(model, "llm", rank=2)
    assert set(selected(net)) == targets
    randomize(net)
    net.apply()
    out = model(ids)
    assert (out - base_out).abs().max() > 1e-4
    out.square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in net.trainable_parameters())


@pytest.mark.parametrize("family, ranks, added", [("krea2", 6, 8), ("ideogram4", 5, 7), ("qwen_image21", 5, 7),
                                                  ("ernie_image", 4, 6), ("nucleus_image", 3, 5)])
def test_in_dims_adds_the_embedders_and_final_layer_where_the_docs_say(family, ranks, added):
    """README and the configs give these families `in_dims`; the config check refused it as an unknown key
    (only FLUX.1's spec listed it) until 2026-11-27."""
    import importlib

    from networks.factory import check_network_args

    model_module = importlib.import_module(f"library.models.{family}.model")
    tiny = importlib.import_module(f"library.models.{family}.tiny")
    classes = {"krea2": "Krea2", "ideogram4": "Ideogram4", "qwen_image21": "QwenImage21", "ernie_image": "ErnieImage",
               "nucleus_image": "NucleusImage"}
    model = getattr(model_module, classes[family])(tiny.tiny_config())
    args = {"in_dims": str([4] * ranks)}
    check_network_args("networks.lora", family, args)
    plain = len(LoRANetwork(model, family, rank=4, alpha=4).lora_modules())
    assert len(LoRANetwork(model, family, rank=4, alpha=4, network_args=args).lora_modules()) == plain + added
