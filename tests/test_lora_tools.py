"""tools/resize_lora.py, extract_lora.py and combine_loras.py on the tiny models (lora_info.py: test_lora_info.py).
Oracles: torch.linalg.svd of the full delta, hand-computed sd-scripts ranks, tools/merge_lora.py
merged checkpoints, and model outputs with the LoRAs applied unmerged."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from library.models.flux1.checkpoint import load_flux
from library.models.llm import load_llm
from library.models.qwen_image.model import load_qwen_image
from networks import lora_files as lf
from networks.lora import LoRANetwork
from tools import resize_lora
from tools.lora_common import load_model, read_lora_file


def deltas(path) -> dict[str, torch.Tensor]:
    """{file module name: float32 delta (alpha / r) up @ down} of a LoRA file."""
    return {n: w.delta() for n, w in read_lora_file(str(path), "test").weights.items()}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def random_lora(model_path, path, rank=8, alpha=4.0, seed=0, family="flux", loader=load_flux, **args):
    """A LoRA on every default target of a tiny model, up random (not the zero init)."""
    torch.manual_seed(seed)
    net = LoRANetwork(loader(model_path), family, rank=rank, alpha=alpha, network_args=args)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.2)
    net.save(str(path))
    return net


@pytest.fixture(scope="module")
def flux_lora(tiny_set, tmp_path_factory):
    path = tmp_path_factory.mktemp("loras") / "flux_r8.safetensors"
    random_lora(tiny_set["flux_bfl"], path)
    return path


# ----------------------------------------------------------------------------------------------
# resize_lora


def test_resize_to_the_same_rank_is_lossless(flux_lora, tmp_path):
    out = tmp_path / "same.safetensors"
    assert resize_lora.main(["--lora", str(flux_lora), "--save_to", str(out), "--new_rank", "8"]) == 0
    before, after = deltas(flux_lora), deltas(out)
    assert set(before) == set(after) and len(before) == 26  # 2 double + 2 single blocks, modulation on
    worst = max(rel(after[n], before[n]) for n in before)
    assert worst <= 1e-6, worst
    assert resize_lora.main(["--lora", str(flux_lora), "--save_to", str(tmp_path / "cap.safetensors"), "--new_rank", "16"]) == 0
    meta = read_lora_file(str(tmp_path / "cap.safetensors"), "test").metadata  # rank 16 asked, 8 written
    assert meta["ss_network_dim"] == "8" and meta["ss_training_comment"].startswith("dimension is resized from 8 to 8;")
    alphas = {w.alpha for w in read_lora_file(str(out), "test").weights.values()}
    assert alphas == {4.0}  # scale 4 / 8 kept at rank 8


def test_resize_reports_the_error_of_the_delta_as_written_in_bf16(flux_lora, tmp_path):
    """A bf16 file resized at its own rank printed "rel error 0.00e+00" (the truncation's), while its new bf16
    factors moved each delta by up to 2.4e-3: the printed error is the written delta's."""
    done = resize_lora.resize_lora(str(flux_lora), str(tmp_path / "bf16.safetensors"), 8, precision="bf16")
    before, after = deltas(flux_lora), deltas(tmp_path / "bf16.safetensors")
    worst = max(rel(after[n], before[n]) for n in before)
    assert worst > 1e-4 and done["summary"]["max_rel_error"] == pytest.approx(worst, rel=1e-3)


def test_resize_to_a_lower_rank_keeps_the_top_singular_values(flux_lora, tmp_path):
    out = tmp_path / "r3.safetensors"
    assert resize_lora.main(["--lora", str(flux_lora), "--save_to", str(out), "--new_rank", "3"]) == 0
    before, resized = deltas(flux_lora), read_lora_file(str(out), "test").weights
    for name, d in before.items():
        w = resized[name]
        assert w.rank == 3 and w.alpha == pytest.approx(4.0 / 8 * 3)  # scale preserved (sd-scripts)
        U, S, Vh = torch.linalg.svd(d.double())
        best = (U[:, :3] * S[:3]) @ Vh[:3]  # Eckart-Young: the best rank-3 approximation
        assert rel(w.delta().double(), best) <= 1e-5, name
        kept = torch.linalg.svdvals(w.delta().double())[:3]
        assert torch.allclose(kept, S[:3], rtol=1e-5), name
    meta = read_lora_file(str(out), "test").metadata
    assert meta["ss_network_dim"] == "3" and meta["ss_network_alpha"] == "1.5"


def _lora_with_spectrum(path, S, n=16):
    """One module whose delta has exactly the singular values S (alpha = rank: scale 1)."""
    g = torch.Generator().manual_seed(1)
    U, _ = torch.linalg.qr(torch.randn(n, len(S), generator=g, dtype=torch.float64))
    V, _ = torch.linalg.qr(torch.randn(n, len(S), generator=g, dtype=torch.float64))
    w = lf.LoRAWeights(V.T.float().contiguous(), (U * torch.tensor(S, dtype=torch.float64)).float(), float(len(S)))
    lf.write_kohya({"double_blocks.0.img_attn.proj": w}, str(path))


@pytest.mark.parametrize("method, param, expected", [
    ("sv_ratio", 4.0, 3),        # S > 10/4: 2 values, + 1
    ("sv_ratio", 20.0, 4),       # all 4 exceed 0.5: 4 + 1, capped at the old rank
    ("sv_fro", 0.9, 3),          # cumulative S^2 / 130 = .769 .962 ...: first >= .81 at index 1; +1, +1
    ("sv_fro", 0.99, 4),         # first >= .9801 at index 2 (.9923)
    ("sv_cumulative", 0.5, 2),   # cumulative S / 18 = .556 ...: index 0; +1, +1
    ("sv_cumulative", 0.9, 4),   # .556 .833 .944: index 2
])  # fmt: skip
def test_dynamic_ranks_follow_sd_scripts_definitions(tmp_path, method, param, expected):
    _lora_with_spectrum(tmp_path / "s.safetensors", [10.0, 5.0, 2.0, 1.0])
    result = resize_lora.resize_lora(str(tmp_path / "s.safetensors"), str(tmp_path / "o.safetensors"), 8, method, param)
    (row,) = result["modules"]
    assert row["new_rank"] == expected
    S = torch.tensor([10.0, 5.0, 2.0, 1.0])[:expected]
    assert row["fro_retained"] == pytest.approx(float(S.pow(2).sum() / 130) ** 0.5, rel=1e-5)
    assert read_lora_file(str(tmp_path / "o.safetensors"), "t").metadata["ss_network_dim"] == "Dynamic"


def test_resize_reports_output_error_on_the_tiny_model(flux_lora, tiny_set, tmp_path, capsys):
    same = resize_lora.resize_lora(str(flux_lora), str(tmp_path / "a.safetensors"), 8, model=tiny_set["flux_bfl"])
    low = resize_lora.resize_lora(str(flux_lora), str(tmp_path / "b.safetensors"), 2, model=tiny_set["flux_bfl"])
    assert same["output_error"]["rel_to_lora_effect"] <= 1e-5
    assert 0.05 <= low["output_error"]["rel_to_lora_effect"] <= 2.0
    assert low["summary"]["min_fro_retained"] < same["summary"]["min_fro_retained"] == pytest.approx(1.0)
    assert resize_lora.main(["--lora", str(flux_lora), "--save_to", str(tmp_path / "c.safetensors"), "--new_rank", "2",
                             "--model", tiny_set["flux_bfl"]]) == 0  # fmt: skip
    assert "of the LoRA's effect" in capsys.readouterr().out


@pytest.mark.parametrize("model", ["missing", "zimage", "the LoRA"])
def test_resize_with_a_model_that_cannot_take_the_lora_writes_nothing(flux_lora, tiny_set, tmp_path, model):
    """Old: --model was opened after the output was written: a missing file, another family's base or a
    LoRA given as the model exited 2 with the resized file left behind."""
    path = {"missing": str(tmp_path / "nope.safetensors"), "zimage": tiny_set["zimage"], "the LoRA": str(flux_lora)}[model]
    out = tmp_path / "o.safetensors"
    assert resize_lora.main(["--lora", str(flux_lora), "--save_to", str(out), "--new_rank", "2", "--model", path]) == 2
    assert not out.exists()


def test_resize_keeps_a_peft_file_peft_with_the_same_delta(flux_lora, tmp_path):
    """A diffusers PEFT file whose alpha is in its adapter-config header: the output folds alpha
    into lora_B and drops the header (keeping it would apply the scale twice)."""
    weights = read_lora_file(str(flux_lora), "t").weights
    paths = {f"double_blocks.0.img_attn.{m}": weights[f"lora_unet_double_blocks_0_img_attn_{m}"] for m in ("qkv", "proj")}
    tensors = {}
    for path, w in paths.items():
        tensors[f"transformer.{path}.lora_A.weight"] = w.down
        tensors[f"transformer.{path}.lora_B.weight"] = w.up  # unfolded: the header's alpha 4 / r 8 applies
    lf.write_lora_tensors(tensors, str(tmp_path / "p.safetensors"), {lf.ADAPTER_METADATA_KEY: json.dumps({"lora_alpha": 4.0, "r": 8})})
    assert resize_lora.main(["--lora", str(tmp_path / "p.safetensors"), "--save_to", str(tmp_path / "o.safetensors"),
                             "--new_rank", "8"]) == 0  # fmt: skip
    out = read_lora_file(str(tmp_path / "o.safetensors"), "t")
    assert out.fmt == "peft" and out.prefix == "transformer." and lf.ADAPTER_METADATA_KEY not in out.metadata
    for path, w in paths.items():
        assert rel(out.weights[path].delta(), w.delta()) <= 1e-6


def test_resize_keeps_dora_magnitudes(tiny_set, tmp_path):
    """DoRA: the low-rank direction is resized, the magnitude vector is written back unchanged, so at
    the same rank the merged weight m * (W + dW) / ||W + dW|| is unchanged too."""
    model = load_flux(tiny_set["flux_bfl"])
    net = random_lora(tiny_set["flux_bfl"], tmp_path / "d.safetensors", rank=4, alpha=2.0, dora=True)
    with torch.no_grad():
        for m in net.lora_modules():
            m.dora_scale.mul_(1 + 0.1 * torch.randn_like(m.dora_scale))
    net.save(str(tmp_path / "d.safetensors"))
    assert resize_lora.main(["--lora", str(tmp_path / "d.safetensors"), "--save_to", str(tmp_path / "o.safetensors"),
                             "--new_rank", "4"]) == 0  # fmt: skip
    before, after = read_lora_file(str(tmp_path / "d.safetensors"), "t").weights, read_lora_file(str(tmp_path / "o.safetensors"), "t").weights
    modules = dict(model.named_modules())
    for m in net.lora_modules():
        name = lf.kohya_name(m.name)
        assert torch.equal(after[name].magnitude, before[name].magnitude)
        W = modules[m.name].weight
        assert rel(after[name].merged(W), before[name].merged(W)) <= 1e-6, name


def _lokr(path):
    save_file({"lora_unet_double_blocks_0_img_attn_proj.lokr_w1": torch.ones(2, 2),
               "lora_unet_double_blocks_0_img_attn_proj.lokr_w2": torch.ones(32, 32),
               "lora_unet_double_blocks_0_img_attn_proj.alpha": torch.tensor(1.0)}, str(path))  # fmt: skip


def test_resize_errors_are_one_line(flux_lora, tmp_path, capsys):
    _lokr(tmp_path / "k.safetensors")
    cases = [
        (["--lora", str(tmp_path / "k.safetensors")], "a LyCORIS file (LoKr / LoHa / ...): resize_lora works on LoRA"),
        (["--lora", str(flux_lora), "--dynamic_method", "sv_fro"], "--dynamic_method and --dynamic_param go together"),
        (["--lora", str(flux_lora), "--dynamic_method", "sv_fro", "--dynamic_param", "2"], "takes a fraction in (0, 1]"),
        (["--lora", str(flux_lora), "--new_rank", "0"], "--new_rank 0: must be >= 1"),
    ]
    for argv, message in cases:
        assert resize_lora.main(argv + ["--save_to", str(tmp_path / "o.safetensors")]) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
    assert not (tmp_path / "o.safetensors").exists()


def test_a_lora_with_nan_factors_is_one_line_in_resize_combine_and_convert(tmp_path, capsys):
    """A diverged training's LoRA (NaN in a factor): resize was a traceback (linalg.svd failed to converge),
    combine --mode concat wrote the NaN into a new file and said it kept 100% of the energy."""
    _lora_with_spectrum(tmp_path / "s.safetensors", [10.0, 5.0, 2.0, 1.0])
    tensors = load_file(str(tmp_path / "s.safetensors"))
    up = "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight"
    tensors[up] = tensors[up].clone()
    tensors[up][3, 1] = float("nan")
    save_file(tensors, str(tmp_path / "nan.safetensors"))
    from tools import combine_loras

    for tool, argv in ((resize_lora, ["--lora", str(tmp_path / "nan.safetensors"), "--new_rank", "2"]),
                       (combine_loras, ["--lora", str(tmp_path / "nan.safetensors")]),
                       (combine_loras, ["--lora", str(tmp_path / "nan.safetensors"), "--mode", "svd", "--rank", "2"])):
        assert tool.main(argv + ["--save_to", str(tmp_path / "o.safetensors")]) == 2
        err = capsys.readouterr().err.strip()
        assert "module 'lora_unet_double_blocks_0_img_attn_proj' up holds 1 non-finite value" in err, err
        assert "\n" not in err and str(tmp_path / "nan.safetensors") in err, err
        assert not (tmp_path / "o.safetensors").exists()
    # convert_lora wrote it on, NaN and all, exit 0 (a LyCORIS file too: its keys pass through as they are)
    from tools import convert_lora

    lokr = tmp_path / "lokr_nan.safetensors"
    save_file({"lora_unet_double_blocks_0_img_attn_proj.lokr_w1": torch.full((4, 4), float("nan")),
               "lora_unet_double_blocks_0_img_attn_proj.lokr_w2": torch.ones(16, 16),
               "lora_unet_double_blocks_0_img_attn_proj.alpha": torch.tensor(1.0)}, str(lokr))
    nan = tmp_path / "nan.safetensors"
    for source, to, key in ((nan, "comfy", up), (nan, "diffusers", up), (nan, "kohya", up),
                            (lokr, "comfy", "lora_unet_double_blocks_0_img_attn_proj.lokr_w1")):
        assert convert_lora.main([str(source), str(tmp_path / "o.safetensors"), "--to", to]) == 2
        held = ("module 'double_blocks.0.img_attn.proj' up holds 1 non-finite value (NaN / inf) of 64"
                if key == up else f"tensor '{key}' holds 16 non-finite values (NaN / inf) of 16")
        assert capsys.readouterr().err.strip() == (f"error: {source}: {held}: a broken LoRA, which convert_lora "
                                                   f"cannot work on")
        assert not (tmp_path / "o.safetensors").exists()
    # lora_info describes it, and says what the tools refuse (it said nothing of the NaN)
    from tools import lora_info

    assert lora_info.main([str(tmp_path / "nan.safetensors")]) == 0
    assert ("values: NOT FINITE: module 'lora_unet_double_blocks_0_img_attn_proj' up holds 1 non-finite value (NaN / inf)"
            " of 64: the trainer, generate and the LoRA tools refuse this file") in capsys.readouterr().out.splitlines()
    assert lora_info.read_info(str(tmp_path / "s.safetensors"))["finite"] == "all finite"


# ----------------------------------------------------------------------------------------------
# extract_lora


def _lora_and_merge(tiny_set, name, tmp_path, rank=4, alpha=2.0):
    """A random LoRA on tiny model `name` and the base with it merged in (merge_lora, fp32)."""
    from tools import merge_lora

    model, family, kwargs = load_model(tiny_set[name])
    torch.manual_seed(3)
    net = LoRANetwork(model, family, rank=rank, alpha=alpha)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.2)
    net.save(str(tmp_path / "lora.safetensors"))
    merged = tmp_path / ("merged.safetensors" if tiny_set[name].endswith(".safetensors") else "merged")
    assert merge_lora.main(["--model", tiny_set[name], "--lora", str(tmp_path / "lora.safetensors"), "--save_to", str(merged),
                            "--save_precision", "fp32"]) == 0  # fmt: skip
    return model, family, kwargs, net, merged


@torch.no_grad()
def _lora_output(model, family, kwargs, source) -> torch.Tensor:
    net = LoRANetwork.from_weights(model, family, source) if isinstance(source, str) else source
    net.apply()
    out = model(**kwargs).float()
    net.remove()
    return out


# zimage and qwen_image21_comfy: single files fusing (qkv, gate_up) or renaming the model's modules; each
# part is extracted under the model's name (their fused names match no LoRA target: the deltas were left out)
@pytest.mark.parametrize("name", ["flux_bfl", "flux_diffusers", "qwen_image", "llm", "zimage", "qwen_image21_comfy", "qwen_image21"])
def test_extract_from_base_plus_merged_lora_recovers_its_delta(tiny_set, tmp_path, name):
    from tools import extract_lora

    model, family, kwargs, net, merged = _lora_and_merge(tiny_set, name, tmp_path)
    out = tmp_path / "extracted.safetensors"
    assert extract_lora.main(["--model", tiny_set[name], "--tuned", str(merged), "--save_to", str(out), "--rank", "4"]) == 0
    if name != "flux_diffusers":  # same module names: compare the deltas themselves
        linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
        extracted, _, fmt = lf.read_lora(str(out), module_paths=linears)
        original = net.lora_weights()
        assert fmt == "kohya" and set(extracted) == set(original)
        worst = max(rel(extracted[p].delta(), original[p].delta()) for p in original)
        assert worst <= 1e-5, worst
    # ModelSpec as sd-scripts' flux_extract_lora.py writes it (none for the LLM: no peer trains one)
    meta = read_lora_file(str(out), "t").metadata
    spec = {k: v for k, v in meta.items() if k.startswith("modelspec.")}
    if name == "llm":
        assert spec == {}
    else:
        assert spec["modelspec.architecture"].endswith("/lora") and spec["modelspec.title"] == "extracted"
        assert spec["modelspec.resolution"] == "1024x1024" and spec["modelspec.sai_model_spec"] == "1.0.0"
        assert spec["modelspec.hash_sha256"] == "0x" + meta["sshs_model_hash"]  # the tensors written
    with torch.no_grad():
        base_out = model(**kwargs).float()
    expected = _lora_output(model, family, kwargs, net)
    got = _lora_output(model, family, kwargs, str(out))  # loads with our loader (diffusers names converted)
    assert rel(got, expected) <= 1e-5 * float(expected.norm() / (expected - base_out).norm()) + 1e-5


def test_extract_from_an_fp8_base_and_a_float_fine_tune_counts_no_scale_as_another_tensor(tiny_set, tmp_path):
    """A ComfyUI-style plain fp8 base (every tensor e4m3, biases too) beside a float fine-tune raised "Promotion
    for Float8 Types is not supported" after every module's SVD, nothing written; two scaled fp8 files counted
    the changed weights' scales as "other tensors differ". Both: 0 other tensors, the file written."""
    from safetensors.torch import load_file, save_file

    from library.precision.fp8_checkpoints import COMFY_MARKER
    from tools import extract_lora

    _, _, _, _, merged = _lora_and_merge(tiny_set, "flux_bfl", tmp_path)
    base = load_file(tiny_set["flux_bfl"])
    save_file({k: v.to(torch.float8_e4m3fn) for k, v in base.items()}, str(tmp_path / "plain_fp8.safetensors"))
    done = extract_lora.extract_lora(str(tmp_path / "plain_fp8.safetensors"), str(merged),
                                     str(tmp_path / "from_fp8.safetensors"), rank=4, log=lambda line: None)
    assert done["other_changed"] == 0 and os.path.isfile(tmp_path / "from_fp8.safetensors")

    def scaled(weights: dict, path: str) -> str:  # ComfyUI's scaled fp8: e4m3 2-D weights, a float32 scale each
        out = {COMFY_MARKER: torch.empty(0, dtype=torch.float8_e4m3fn)}
        for k, v in weights.items():
            if k.endswith(".weight") and v.dim() == 2:
                scale = v.float().abs().max().clamp_min(1e-12) / 448
                out[k], out[k[:-6] + "scale_weight"] = (v.float() / scale).to(torch.float8_e4m3fn), scale.reshape(1)
            else:
                out[k] = v
        save_file(out, str(tmp_path / path))
        return str(tmp_path / path)

    done = extract_lora.extract_lora(scaled(base, "a.safetensors"), scaled(load_file(str(merged)), "b.safetensors"),
                                     str(tmp_path / "scaled.safetensors"), rank=4, log=lambda line: None)
    assert done["modules"] and done["other_changed"] == 0
    done = extract_lora.extract_lora(str(tmp_path / "a.safetensors"), str(merged), str(tmp_path / "mixed.safetensors"),
                                     rank=4, log=lambda line: None)  # scaled base, float fine-tune: no cast equals codes
    assert done["modules"] and done["other_changed"] == 0


def test_extract_with_randomized_svd_recovers_a_merged_lora_exactly(tiny_set, tmp_path):
    from tools import extract_lora

    model, _, _, net, merged = _lora_and_merge(tiny_set, "llm", tmp_path)
    full = extract_lora.extract_lora(tiny_set["llm"], str(merged), str(tmp_path / "f.safetensors"), rank=4, log=lambda line: None)
    fast = extract_lora.extract_lora(tiny_set["llm"], str(merged), str(tmp_path / "l.safetensors"), rank=4, log=lambda line: None,
                                     svd="lowrank")  # fmt: skip
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    extracted, _, _ = lf.read_lora(str(tmp_path / "l.safetensors"), module_paths=linears)
    assert max(rel(extracted[p].delta(), w.delta()) for p, w in net.lora_weights().items()) <= 1e-5
    assert max(r["rel_error"] for r in fast["modules"]) <= 1e-5 and max(r["rel_error"] for r in full["modules"]) <= 1e-5
    with pytest.raises(ValueError, match="--svd lowrank: expected full, or lowrank with --rank R and no --energy"):
        extract_lora.extract_lora(tiny_set["llm"], str(merged), str(tmp_path / "e.safetensors"), energy=0.9, svd="lowrank")


def test_extract_with_an_energy_threshold_keeps_the_smallest_sufficient_rank(tiny_set, tmp_path):
    from tools import extract_lora

    _, _, _, net, merged = _lora_and_merge(tiny_set, "flux_bfl", tmp_path, rank=6)
    done = extract_lora.extract_lora(tiny_set["flux_bfl"], str(merged), str(tmp_path / "e.safetensors"), energy=0.9,
                                     log=lambda line: None)  # fmt: skip
    original = net.lora_weights()
    assert len(done["modules"]) == len(original) and done["other_changed"] == 0
    for row in done["modules"]:
        S = torch.linalg.svdvals(original[row["module"]].delta().double())
        fro = lambda k: float(S[:k].pow(2).sum() / S.pow(2).sum()) ** 0.5  # noqa: E731
        k = row["rank"]
        assert fro(k) >= 0.9 > fro(k - 1), (row, [fro(i) for i in range(7)])
        assert row["rel_error"] == pytest.approx((1 - fro(k) ** 2) ** 0.5, rel=1e-3, abs=1e-6)


def test_extract_header_says_the_ranks_written(tiny_set, tmp_path):
    """--rank above a module's min(out, in) writes that smaller rank: the header said ss_network_dim 512 /
    alpha 512 for the tiny LLM (10 modules of rank 32 and 4 of 16 written); now Dynamic, as for per-module ranks.
    --energy with one rank everywhere said Dynamic; now that rank."""
    from tools import extract_lora

    _, _, _, _, merged = _lora_and_merge(tiny_set, "llm", tmp_path)
    done = extract_lora.extract_lora(tiny_set["llm"], str(merged), str(tmp_path / "big.safetensors"), rank=512, log=lambda line: None)
    meta = read_lora_file(str(tmp_path / "big.safetensors"), "t").metadata
    assert len({r["rank"] for r in done["modules"]}) > 1 and max(r["rank"] for r in done["modules"]) < 512
    assert (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("Dynamic", "Dynamic")
    done = extract_lora.extract_lora(tiny_set["llm"], str(merged), str(tmp_path / "e.safetensors"), energy=1.0, log=lambda line: None)
    meta = read_lora_file(str(tmp_path / "e.safetensors"), "t").metadata
    assert {r["rank"] for r in done["modules"]} == {4} and (meta["ss_network_dim"], meta["ss_network_alpha"]) == ("4", "4")


def test_extract_errors_are_one_line(tiny_set, tmp_path, capsys):
    from tools import extract_lora

    tuned = load_file(tiny_set["flux_bfl"])  # a diverged fine-tune: linalg.svd's error named no weight nor file
    tuned["double_blocks.0.img_attn.proj.weight"][0, 0] = float("nan")
    save_file(tuned, str(tmp_path / "nan.safetensors"))
    cases = [
        (["--tuned", str(tmp_path / "nan.safetensors"), "--rank", "4"],
         f"'double_blocks.0.img_attn.proj.weight' of --tuned {tmp_path / 'nan.safetensors'} minus the base {tiny_set['flux_bfl']} holds 1 non-finite"),
        (["--tuned", tiny_set["llm"], "--rank", "4"], "a llm checkpoint in hf names, the base"),
        (["--tuned", tiny_set["flux_bfl"], "--rank", "4"], "no LoRA target weight differs from the base"),
        (["--tuned", tiny_set["flux_bfl"]], "give --rank R or --energy X"),
        (["--tuned", tiny_set["flux_bfl"], "--energy", "1.5"], "--energy 1.5: must be in (0, 1]"),
    ]
    for argv, message in cases:
        assert extract_lora.main(["--model", tiny_set["flux_bfl"], "--save_to", str(tmp_path / "o.safetensors")] + argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
    assert not (tmp_path / "o.safetensors").exists()


def test_extract_never_writes_over_a_file_of_a_folder_checkpoint(tiny_set, tmp_path, capsys):
    """--save_to BASE_FOLDER/diffusion_pytorch_model.safetensors replaced the base's weights with the LoRA (exit 0):
    only the --model / --tuned paths themselves were compared, not the files read from a folder."""
    import shutil

    from tools import extract_lora

    _, _, _, _, merged = _lora_and_merge(tiny_set, "flux_diffusers", tmp_path)
    shutil.copytree(tiny_set["flux_diffusers"], tmp_path / "base")
    shard = next(p for p in (tmp_path / "base").rglob("*.safetensors"))
    before = shard.read_bytes()
    capsys.readouterr()
    assert extract_lora.main(["--model", str(tmp_path / "base"), "--tuned", str(merged), "--save_to", str(shard), "--rank", "4"]) == 2
    assert f"--save_to {shard}: is one of the inputs" in capsys.readouterr().err
    assert shard.read_bytes() == before


# ----------------------------------------------------------------------------------------------
# combine_loras


@pytest.fixture(scope="module")
def two_flux_loras(tiny_set, tmp_path_factory):
    """a: kohya rank 4 alpha 2 on every target; b: PEFT (dotted names) rank 2 alpha 8 on the single blocks."""
    root = tmp_path_factory.mktemp("combine")
    model, family, kwargs = load_model(tiny_set["flux_bfl"])
    nets = []
    for seed, rank, alpha, args in ((1, 4, 2.0, {}), (2, 2, 8.0, {"train_blocks": "single"})):
        torch.manual_seed(seed)
        net = LoRANetwork(model, family, rank=rank, alpha=alpha, network_args=args)
        with torch.no_grad():
            for m in net.lora_modules():
                m.lora_up.weight.normal_(0, 0.2)
        nets.append(net)
    nets[0].save(str(root / "a.safetensors"))
    lf.write_peft(nets[1].lora_weights(), str(root / "b.safetensors"), prefix="transformer")
    return root, model, family, kwargs, nets


def _combined_delta(nets, ratios):
    total = {}
    for net, ratio in zip(nets, ratios):
        for p, w in net.lora_weights().items():
            total[p] = total.get(p, 0) + ratio * w.delta()
    return total


def test_combine_by_concatenation_equals_applying_both(two_flux_loras, tmp_path):
    from tools import combine_loras

    root, model, family, kwargs, (a, b) = two_flux_loras
    out = tmp_path / "c.safetensors"
    assert combine_loras.main(["--lora", f"{root / 'a.safetensors'}:0.7", f"{root / 'b.safetensors'}:-0.4",
                               "--save_to", str(out)]) == 0  # fmt: skip
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    combined, _, fmt = lf.read_lora(str(out), module_paths=linears)
    expected = _combined_delta((a, b), (0.7, -0.4))
    assert fmt == "kohya" and set(combined) == set(expected)
    assert {w.rank for w in combined.values()} == {4, 6}  # single blocks: 4 + 2
    assert max(rel(combined[p].delta(), expected[p]) for p in expected) <= 1e-6
    with torch.no_grad():
        a.set_multiplier(0.7), b.set_multiplier(-0.4)
        a.apply(), b.apply()
        both = model(**kwargs).float()
        b.remove(), a.remove()
        a.set_multiplier(1.0), b.set_multiplier(1.0)
    assert rel(_lora_output(model, family, kwargs, str(out)), both) <= 1e-5


def test_combine_by_svd_is_the_best_low_rank_approximation_of_the_sum(two_flux_loras, tmp_path):
    from tools import combine_loras

    root, model, _, _, (a, b) = two_flux_loras
    out = tmp_path / "s.safetensors"
    rows = combine_loras.combine_loras([combine_loras.parse_lora_spec(f"{root / 'a.safetensors'}:0.7"),
                                        combine_loras.parse_lora_spec(f"{root / 'b.safetensors'}:-0.4")],
                                       str(out), "svd", rank=3)  # fmt: skip
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    combined, _, _ = lf.read_lora(str(out), module_paths=linears)
    for p, d in _combined_delta((a, b), (0.7, -0.4)).items():
        U, S, Vh = torch.linalg.svd(d.double())
        assert combined[p].rank == 3 and rel(combined[p].delta().double(), (U[:, :3] * S[:3]) @ Vh[:3]) <= 1e-5, p
    assert min(r["fro_retained"] for r in rows) < 1.0


def test_combine_errors_are_one_line(two_flux_loras, tiny_set, tmp_path, capsys):
    from tools import combine_loras

    root, model, _, _, (a, _) = two_flux_loras
    dora = LoRANetwork(model, "flux", rank=2, alpha=1.0, network_args={"dora": True})
    dora.save(str(tmp_path / "dora.safetensors"))
    _lokr(tmp_path / "k.safetensors")
    random_lora(tiny_set["llm"], tmp_path / "llm.safetensors", rank=2, family="llm", loader=load_llm)
    random_lora(tiny_set["qwen_image"], tmp_path / "qwen.safetensors", rank=2, family="qwen_image", loader=load_qwen_image)
    cases = [
        ([str(tmp_path / "dora.safetensors")], "a DoRA file (dora_scale / lora_magnitude_vector): its delta is not additive"),
        ([str(tmp_path / "k.safetensors")], "a LyCORIS file (LoKr / LoHa / ...): combine_loras works on LoRA"),
        ([str(root / "a.safetensors"), "--mode", "svd"], "--mode svd needs --rank R >= 1"),
        ([str(root / "a.safetensors"), str(tmp_path / "llm.safetensors")],
         f"{root / 'a.safetensors'} (for FLUX.1) and {tmp_path / 'llm.safetensors'} (for LLM) are LoRAs of different models"),
        ([str(root / "a.safetensors"), str(tmp_path / "qwen.safetensors")],
         f"{root / 'a.safetensors'} (for FLUX.1) and {tmp_path / 'qwen.safetensors'} (for Qwen-Image) are LoRAs of different"),
    ]
    for argv, message in cases:
        assert combine_loras.main(["--save_to", str(tmp_path / "o.safetensors"), "--lora"] + argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
    assert not (tmp_path / "o.safetensors").exists()


@pytest.mark.parametrize("name", ["flux_bfl", "krea2", "zimage"])
def test_combine_of_one_model_in_two_namings_equals_merging_both(tiny_set, tmp_path, name):
    """Until 2026-11-28 combine_loras wrote two namings of one module side by side (Krea 2's blocks.N.attn.gate
    beside diffusers' transformer_blocks.N.attn.to_gate, Z-Image's to_q beside ComfyUI's fused attention.qkv), which
    merge_lora, generate and the trainer refuse (the module is in the file twice); FLUX.1's pair it refused."""
    from tests.lora_layouts import comfy_own_zimage
    from tools import combine_loras, convert_lora, merge_lora

    ours, other, combined = (str(tmp_path / f"{n}.safetensors") for n in ("ours", "other", "combined"))
    model, family, _ = load_model(tiny_set[name])
    net = random_lora(tiny_set[name], ours, rank=4, alpha=2.0, family=family, loader=lambda _: model)
    if name == "zimage":  # musubi-tuner's ComfyUI form: q / k / v fused, out renamed
        comfy_own_zimage(net.lora_weights(), other)
    else:
        convert_lora.convert_lora(ours, other, "diffusers")
    pair = [f"{other}:0.7", f"{ours}:-0.4"]
    assert combine_loras.main(["--lora", *pair, "--save_to", combined]) == 0
    merged = {}
    for loras in ([combined], pair):
        out = str(tmp_path / f"merged{len(merged)}.safetensors")
        assert merge_lora.main(["--model", tiny_set[name], "--lora", *loras, "--save_to", out, "--save_precision", "fp32"]) == 0
        merged[len(merged)] = load_file(out)
    assert merged[0].keys() == merged[1].keys()
    assert max(float((merged[0][k] - merged[1][k]).abs().max()) for k in merged[0]) <= 1e-5


def test_combine_adds_a_file_under_onetrainers_kohya_prefix_and_a_file_naming_a_module_twice_is_refused(
        two_flux_loras, tmp_path):
    """Until 2026-11-27 combine_loras kept lora_unet_X and lora_transformer_X (OneTrainer's prefix) as two
    modules, and every reader then kept one of the two silently: the sum was one LoRA."""
    from safetensors.torch import load_file

    from tools import combine_loras

    root, model, _, _, (a, _) = two_flux_loras
    renamed = {k.replace("lora_unet_", "lora_transformer_"): v for k, v in load_file(str(root / "a.safetensors")).items()}
    save_file(renamed, str(tmp_path / "ot.safetensors"))
    out = tmp_path / "sum.safetensors"
    assert combine_loras.main(["--lora", str(root / "a.safetensors"), str(tmp_path / "ot.safetensors"), "--save_to", str(out)]) == 0
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    combined, _, _ = lf.read_lora(str(out), module_paths=linears)
    expected = a.lora_weights()
    assert set(combined) == set(expected) and {w.rank for w in combined.values()} == {8}  # 4 + 4, each module once
    assert max(rel(combined[p].delta(), 2 * expected[p].delta()) for p in expected) <= 1e-6
    first = tmp_path / "ot_first.safetensors"  # the output keeps the first kohya file's prefix
    assert combine_loras.main(["--lora", str(tmp_path / "ot.safetensors"), str(root / "a.safetensors"), "--save_to", str(first)]) == 0
    assert {k.split(".")[0][:17] for k in load_file(str(first))} == {"lora_transformer_"}
    both = {**load_file(str(root / "a.safetensors")), **renamed}  # one module under both prefixes
    save_file(both, str(tmp_path / "twice.safetensors"))
    from library.io import CheckpointError

    with pytest.raises(CheckpointError, match=r"twice.safetensors: modules 'lora_\w+' and 'lora_\w+' are both 'double_blocks"):
        lf.read_lora(str(tmp_path / "twice.safetensors"), module_paths=linears)  # what merge_lora, generate, the trainer read


@pytest.mark.parametrize("alpha", [torch.tensor([4.0, 4.0]), torch.tensor(float("nan"))])
def test_a_malformed_alpha_is_one_line_in_the_lora_tools(flux_lora, tmp_path, capsys, alpha):
    """It was a traceback (a tensor of 2 elements cannot be converted to a scalar); a NaN alpha was read."""
    from safetensors.torch import load_file

    from tools import convert_lora, lora_info

    tensors = load_file(str(flux_lora))
    key = sorted(k for k in tensors if k.endswith(".alpha"))[0]
    save_file({**tensors, key: alpha}, str(tmp_path / "bad.safetensors"))
    for tool, argv in ((lora_info, []), (convert_lora, [str(tmp_path / "o.safetensors"), "--to", "diffusers"])):
        code = tool.main([str(tmp_path / "bad.safetensors"), *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and f"module '{key[:-len('.alpha')]}' alpha is " in err, err
        assert "expected one finite number" in err
    assert not (tmp_path / "o.safetensors").exists()
    # a LyCORIS file's alpha in lora_info (old: "only one element tensors can be converted", no file or key named)
    module = "lora_unet_double_blocks_0_img_attn_proj"
    save_file({f"{module}.lokr_w1": torch.ones(4, 4), f"{module}.lokr_w2": torch.ones(16, 16),
               f"{module}.alpha": alpha}, str(tmp_path / "lokr.safetensors"))
    assert lora_info.main([str(tmp_path / "lokr.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: {tmp_path / 'lokr.safetensors'}: module '{module}' alpha is "), err


def test_converted_and_combined_files_drop_sd_scripts_legacy_hash(flux_lora, tmp_path):
    """sshs_legacy_hash describes the input's tensors: convert_lora kept it in the converted file."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from tools import combine_loras, convert_lora

    with safe_open(str(flux_lora), "pt") as f:
        metadata = dict(f.metadata())
    save_file(load_file(str(flux_lora)), str(tmp_path / "in.safetensors"), {**metadata, "sshs_legacy_hash": "deadbeef"})
    assert convert_lora.main([str(tmp_path / "in.safetensors"), str(tmp_path / "d.safetensors"), "--to", "diffusers"]) == 0
    assert combine_loras.main(["--lora", str(tmp_path / "in.safetensors"), "--save_to", str(tmp_path / "c.safetensors")]) == 0
    for name in ("d", "c"):
        with safe_open(str(tmp_path / f"{name}.safetensors"), "pt") as f:
            assert "sshs_legacy_hash" not in f.metadata() and f.metadata()["sshs_model_hash"] != metadata["sshs_model_hash"]


def test_combined_header_lists_every_inputs_tags_and_names_the_output(flux_lora, tmp_path):
    """combine_loras wrote the first input's header: A1111's trained tags (ss_tag_frequency) and dataset size
    (ss_dataset_dirs) showed the first LoRA's alone ({'img': {'ohwx': 10}} of 10 + 4 images) and its alias / SwarmUI's
    title (ss_output_name, modelspec.title) named the first LoRA. Now every input's folders, a repeated one as
    sd-scripts names it ('img (2)'), and the output's name."""
    from safetensors import safe_open

    from tools import combine_loras

    tensors = load_file(str(flux_lora))
    for name, tag, n in (("a", "ohwx", 10), ("b", "sks", 4)):
        save_file(tensors, str(tmp_path / f"{name}.safetensors"), {
            "ss_output_name": name, "modelspec.title": name, "ss_tag_frequency": json.dumps({"img": {tag: n}}),
            "ss_dataset_dirs": json.dumps({"img": {"n_repeats": 1, "img_count": n}})})
    assert combine_loras.main(["--lora", str(tmp_path / "a.safetensors"), str(tmp_path / "b.safetensors"),
                               "--save_to", str(tmp_path / "both.safetensors")]) == 0
    with safe_open(str(tmp_path / "both.safetensors"), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["ss_tag_frequency"]) == {"img": {"ohwx": 10}, "img (2)": {"sks": 4}}
    assert sum(d["img_count"] for d in json.loads(meta["ss_dataset_dirs"]).values()) == 14
    assert meta["ss_output_name"] == meta["modelspec.title"] == "both"


@pytest.mark.parametrize("ratio", ["nan", "1e30", "-101"])
def test_lora_ratio_must_be_finite_and_within_100_in_merge_and_combine(flux_lora, tiny_set, tmp_path, capsys, ratio):
    from tools import combine_loras, merge_lora

    spec = f"{flux_lora}:{ratio}"
    for main, argv in ((merge_lora.main, ["--model", tiny_set["flux_bfl"]]), (combine_loras.main, [])):
        assert main([*argv, "--lora", spec, "--save_to", str(tmp_path / "o.safetensors")]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"error: --lora '{spec}': ratio '{ratio}' is not a finite number in [-100, 100] (1 applies the LoRA as trained)"
    assert not (tmp_path / "o.safetensors").exists()
    assert merge_lora.parse_lora_spec(f"{flux_lora}:-100").ratio == -100.0  # the bound itself is allowed


# ----------------------------------------------------------------------------------------------
# PEFT adapters: the alpha lives in adapter_config.json


def test_resize_and_combine_apply_a_peft_adapters_lora_alpha(tiny_set, tmp_path, capsys):
    """r 4, lora_alpha 2 in adapter_config.json only: the output deltas are the adapter's (scale 0.5), for
    the folder and for its adapter_model.safetensors; a PEFT file without any alpha gets a warning."""
    from tools import combine_loras

    model, family, _ = load_model(tiny_set["llm"])
    torch.manual_seed(3)
    net = LoRANetwork(model, family, rank=4, alpha=2.0)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.2)
    net.save_peft(str(tmp_path / "adapter"))
    expected = {p: w.delta() for p, w in net.lora_weights().items()}
    for source in (tmp_path / "adapter", tmp_path / "adapter" / "adapter_model.safetensors"):
        for i, argv in enumerate((["--new_rank", "4"], None)):
            out = tmp_path / f"out{i}.safetensors"
            if argv is None:
                assert combine_loras.main(["--lora", str(source), "--save_to", str(out)]) == 0
            else:
                assert resize_lora.main(["--lora", str(source), "--save_to", str(out), *argv]) == 0
            got = deltas(out)
            assert set(got) == set(expected)
            assert max(rel(got[p], expected[p]) for p in expected) <= 1e-5, (source, argv)
    assert "warning" not in capsys.readouterr().err
    bare = {k: v for k, v in lf.read_lora_tensors(str(tmp_path / "adapter"))[0].items()}
    save_file(bare, str(tmp_path / "bare.safetensors"))
    assert combine_loras.main(["--lora", str(tmp_path / "bare.safetensors"), "--save_to", str(tmp_path / "o.safetensors")]) == 0
    assert "bare.safetensors: PEFT file without 'lora_adapter_metadata' or alphas" in capsys.readouterr().err
    assert resize_lora.main(["--lora", str(tmp_path / "adapter"), "--save_to",
                             str(tmp_path / "adapter" / "adapter_model.safetensors")]) == 2  # fmt: skip
    assert "is one of the inputs" in capsys.readouterr().err


def test_a_file_that_is_no_lora_is_named_in_the_error(flux_lora, tiny_set, tmp_path, capsys):
    from tests.test_reliability import one_error_line
    from tools import lora_info, merge_lora

    save_file({}, str(tmp_path / "empty.safetensors"))
    capsys.readouterr()
    line = one_error_line(capsys, merge_lora.main(["--model", tiny_set["flux_bfl"], "--lora", str(flux_lora),
                                                   str(tmp_path / "empty.safetensors"), "--save_to", str(tmp_path / "m.safetensors")]))  # fmt: skip
    assert line == f"error: {tmp_path / 'empty.safetensors'}: LoRA file holds no tensors"
    line = one_error_line(capsys, lora_info.main([tiny_set["flux_bfl"]]))  # a base model, not a LoRA
    assert line.startswith(f"error: {tiny_set['flux_bfl']}: LoRA key ") and line.endswith("(is it a LoRA file?)")
    _lokr(tmp_path / "k.safetensors")
    net = LoRANetwork(load_flux(tiny_set["flux_bfl"]), "flux", rank=4)
    with pytest.raises(lf.CheckpointError, match=f'{tmp_path / "k.safetensors"}: a LyCORIS file .* set network_module = "lycoris.kohya"'):
        net.load_weights(str(tmp_path / "k.safetensors"), strict=False)


def test_extract_records_the_base_version_and_merge_refuses_another_architectures_lora(tiny_set, tmp_path, capsys):
    """A LoRA extracted from Chroma says "chroma" (it read as FLUX.1, the names are the same); merge
    refuses a LoRA whose ss_base_model_version is another architecture's (Chroma into FLUX.1: every
    name and shape fits) and warns for another release of the base's own (schnell into dev)."""
    from tests.test_reliability import one_error_line
    from tools import extract_lora, lora_info, merge_lora

    _, _, _, net, merged = _lora_and_merge(tiny_set, "chroma_bfl", tmp_path)
    out = tmp_path / "extracted.safetensors"
    assert extract_lora.main(["--model", tiny_set["chroma_bfl"], "--tuned", str(merged), "--save_to", str(out), "--rank", "4"]) == 0
    assert read_lora_file(str(out), "test").metadata["ss_base_model_version"] == "chroma"
    flux = LoRANetwork(load_flux(tiny_set["flux_bfl"]), "flux", rank=2)
    flux.save(str(tmp_path / "schnell.safetensors"), metadata={"ss_base_model_version": "flux1-schnell"})
    flux.save(str(tmp_path / "chroma_meta.safetensors"), metadata={"ss_base_model_version": "chroma"})
    capsys.readouterr()
    line = one_error_line(capsys, merge_lora.main(["--model", tiny_set["flux_bfl"], "--lora", str(tmp_path / "chroma_meta.safetensors"),
                                                   "--save_to", str(tmp_path / "m.safetensors")]))  # fmt: skip
    # what tools/lora_info.py says of it (networks/lora_reader.py refuses it before merge_lora's version check)
    assert line == (f"error: {tmp_path / 'chroma_meta.safetensors'}: a LoRA for Chroma (tools/lora_info.py: arch chroma, "
                    f"bfl names), not for this FLUX.1 model")
    assert lora_info.read_info(str(tmp_path / "chroma_meta.safetensors"))["arch"] == "chroma"
    assert merge_lora.main(["--model", tiny_set["flux_bfl"], "--lora", str(tmp_path / "schnell.safetensors"),
                            "--save_to", str(tmp_path / "m.safetensors")]) == 0  # fmt: skip
    assert "trained on 'flux1-schnell' (ss_base_model_version), merged into 'flux1-dev'" in capsys.readouterr().err


def test_combine_keeps_a_diffusers_files_text_encoder_modules_apart_from_its_transformers(flux_lora, tmp_path, capsys):
    """A diffusers file with text_encoder. modules beside transformer. ones: its transformer names kept the prefix, so
    they never met the same modules of a file without text-encoder modules (43 modules side by side, the second file's
    written without `transformer.`, which diffusers ignores); beside a kohya file its text-encoder module vanished unsaid."""
    from tools import combine_loras, convert_lora

    assert convert_lora.main([str(flux_lora), str(tmp_path / "d.safetensors"), "--to", "diffusers"]) == 0
    tensors = load_file(str(tmp_path / "d.safetensors"))
    te = "text_encoder.text_model.encoder.layers.0.self_attn.q_proj"
    save_file({**tensors, f"{te}.lora_A.weight": torch.randn(2, 32), f"{te}.lora_B.weight": torch.randn(32, 2)},
              str(tmp_path / "te.safetensors"), {lf.FOLDED_MARK: "true"})
    argv = ["--lora", str(tmp_path / "te.safetensors"), f"{tmp_path / 'd.safetensors'}:-1", "--save_to", str(tmp_path / "o.safetensors")]
    assert combine_loras.main(argv) == 0
    out = read_lora_file(str(tmp_path / "o.safetensors"), "test").weights
    assert len(out) == len(deltas(tmp_path / "d.safetensors")) + 1 and te in out
    assert all(k.startswith(("transformer.", "text_encoder.")) for k in load_file(str(tmp_path / "o.safetensors")))
    assert max(float(w.delta().norm()) for n, w in out.items() if n != te) < 1e-5  # each module met its own
    capsys.readouterr()
    assert combine_loras.main(["--lora", str(flux_lora), str(tmp_path / "te.safetensors"), "--save_to", str(tmp_path / "k.safetensors")]) == 0
    assert f"left out" in capsys.readouterr().err and not any("text" in n for n in deltas(tmp_path / "k.safetensors"))


def test_save_precision_float_is_fp32_in_the_lora_tools_as_in_sd_scripts_and_the_training_config():
    """sd-scripts' resize / svd_merge / flux_merge / flux_extract and musubi-tuner's extract take `--save_precision
    float` (fp32), and so does our training config; the tools refused it (invalid choice: 'float')."""
    from tools import combine_loras, extract_lora, merge_lora

    required = {resize_lora: ["--lora", "a.safetensors", "--save_to", "b.safetensors"],
                combine_loras: ["--lora", "a.safetensors", "--save_to", "b.safetensors"],
                extract_lora: ["--model", "a", "--tuned", "b", "--save_to", "c.safetensors", "--rank", "4"],
                merge_lora: ["--model", "a", "--lora", "b.safetensors", "--save_to", "c.safetensors"]}
    for tool, argv in required.items():
        assert tool.build_parser().parse_args(argv + ["--save_precision", "float"]).save_precision == "fp32", tool
        assert tool.build_parser().parse_args(argv + ["--save_precision", "bf16"]).save_precision == "bf16", tool
