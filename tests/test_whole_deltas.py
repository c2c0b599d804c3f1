"""Whole-tensor deltas (`.diff` / `.diff_b`: ComfyUI's Extract and Save Lora, LyCORIS' full type) merged by
tools/merge_lora.py as ComfyUI patches them (W += ratio * diff), in either naming of the base: each merged
checkpoint, loaded back by the family's own loader, equals the model with the deltas added by hand."""

import pytest
from PIL import Image
import torch
from safetensors.torch import load_file, save_file

from library.models.flux1.family import FluxFamily
from library.models.zimage.checkpoint import single_file_key
from library.models.zimage.family import ZImageFamily
from networks import lora_files as lf
from tools import merge_lora

RATIO = 0.5


def numbered(*shape, seed: int) -> torch.Tensor:
    """Distinct values a row: a row moved to another's place shows."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def merged_model(family, base: str, lora: str, out: str, ratio: float = RATIO):
    assert merge_lora.main(["--model", base, "--lora", f"{lora}:{ratio}", "--save_to", out]) == 0
    return family(out).load_transformer(torch.float32)


def assert_model_is(got: torch.nn.Module, want: dict[str, torch.Tensor]):
    state = got.state_dict()
    assert sorted(state) == sorted(want)
    for k, v in want.items():
        torch.testing.assert_close(state[k], v, rtol=0, atol=1e-6, msg=k)


def flux_whole_deltas(model) -> dict[str, torch.Tensor]:
    """{our parameter: its delta}: the fused qkv's weight and bias, a modulation bias, an MLP's biases."""
    params = dict(model.named_parameters())
    names = ["double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_attn.qkv.bias", "double_blocks.0.img_mod.lin.bias",
             "single_blocks.0.linear1.bias", "double_blocks.0.txt_mlp.0.bias"]
    return {n: numbered(*params[n].shape, seed=i) for i, n in enumerate(names)}


def as_file(deltas: dict[str, torch.Tensor], path, name=lambda module: f"diffusion_model.{module}", extra=None) -> str:
    """The deltas as a file's `<module>.diff` / `.diff_b` (ComfyUI's dotted names unless `name` says otherwise)."""
    tensors = {f"{name(p.rsplit('.', 1)[0])}.{'diff_b' if p.endswith('.bias') else 'diff'}": d for p, d in deltas.items()}
    save_file({**tensors, **(extra or {})}, str(path))
    return str(path)


def with_deltas(model, deltas: dict[str, torch.Tensor], ratio: float = RATIO) -> dict[str, torch.Tensor]:
    return {k: v + ratio * deltas[k] if k in deltas else v for k, v in model.state_dict().items()}


@pytest.mark.parametrize("checkpoint", ["base.safetensors", "diffusers"])
@pytest.mark.parametrize("naming", ["comfy", "kohya"])
def test_flux_whole_deltas_merge_into_either_naming(flux_loras, tmp_path, checkpoint, naming):
    """BFL-named deltas (ComfyUI's `diffusion_model.` or kohya's `lora_unet_`) into the BFL file and into the
    diffusers folder, whose to_q / to_k / to_v take the fused qkv delta's rows: both load back as the model plus
    the deltas (the old merge refused a file of deltas alone as LyCORIS' full type)."""
    model, root = flux_loras["model"], flux_loras["root"]
    deltas = flux_whole_deltas(model)
    name = (lambda m: f"diffusion_model.{m}") if naming == "comfy" else lf.kohya_name
    path = as_file(deltas, tmp_path / "full.safetensors", name)
    out = str(tmp_path / ("merged.safetensors" if checkpoint.endswith(".safetensors") else "merged"))
    assert_model_is(merged_model(FluxFamily, str(root / checkpoint), path, out), with_deltas(model, deltas))


def test_a_comfyui_extraction_merges_its_lora_and_its_bias_deltas(flux_loras, tmp_path):
    """ComfyUI's Extract and Save Lora: down / up and a `.diff_b` per bias. The merge left the bias deltas out (a
    warning), so the merged checkpoint differed from what ComfyUI renders with the file; it adds both now."""
    model, root = flux_loras["model"], flux_loras["root"]
    lora = load_file(flux_loras["cases"]["ComfyUI dotted lora_down"][0])
    biases = {n: d for n, d in flux_whole_deltas(model).items() if n.endswith(".bias")}
    path = as_file(biases, tmp_path / "extract.safetensors", extra=lora)
    lora_only = merged_model(FluxFamily, str(root / "base.safetensors"), flux_loras["cases"]["ComfyUI dotted lora_down"][0],
                             str(tmp_path / "lora_only.safetensors"))
    got = merged_model(FluxFamily, str(root / "base.safetensors"), path, str(tmp_path / "merged.safetensors"))
    assert_model_is(got, with_deltas(lora_only, biases))
    assert not torch.equal(lora_only.state_dict()["double_blocks.0.img_attn.qkv.weight"],
                           model.state_dict()["double_blocks.0.img_attn.qkv.weight"])  # the LoRA merged too


def test_zimage_deltas_in_comfyuis_fused_names_merge_into_both_checkpoints(zimage_loras, tmp_path):
    """Z-Image's single file (ComfyUI's names) fuses to_q / to_k / to_v into attention.qkv: ComfyUI's extraction
    names that. Into the diffusers folder each part takes its third of the rows and a renamed norm's 1-D weight
    (`.diff`) its own (the family's comfy_map)."""
    model, root = zimage_loras["model"], zimage_loras["root"]
    params = dict(model.named_parameters())
    block = "layers.0.attention"
    fused = numbered(3 * params[f"{block}.to_q.weight"].shape[0], params[f"{block}.to_q.weight"].shape[1], seed=1)
    norm = next(n for n in params if n.startswith(block) and "norm" in n and n.endswith(".weight"))
    deltas = {f"{block}.to_{c}.weight": fused[i * len(fused) // 3 : (i + 1) * len(fused) // 3] for i, c in enumerate("qkv")}
    deltas[norm] = numbered(*params[norm].shape, seed=2)
    path = str(tmp_path / "zimage.safetensors")
    comfy_norm = single_file_key(norm)[: -len(".weight")]  # attention.q_norm: ComfyUI's name of our norm_q
    assert comfy_norm != norm[: -len(".weight")]
    save_file({f"diffusion_model.{block}.qkv.diff": fused, f"diffusion_model.{comfy_norm}.diff": deltas[norm]}, path)
    want = with_deltas(model, deltas)
    for checkpoint in ("base.safetensors", "diffusers"):
        out = str(tmp_path / ("merged.safetensors" if checkpoint.endswith(".safetensors") else "merged"))
        assert_model_is(merged_model(ZImageFamily, str(root / checkpoint), path, out), want)


def test_a_whole_delta_of_another_shape_is_one_line_and_nothing_written(flux_loras, tmp_path, capsys):
    root = flux_loras["root"]
    path = str(tmp_path / "bad.safetensors")
    save_file({"diffusion_model.double_blocks.0.img_attn.qkv.diff_b": torch.ones(7)}, path)
    out = tmp_path / "merged.safetensors"
    assert merge_lora.main(["--model", str(root / "base.safetensors"), "--lora", path, "--save_to", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {path}: 'diffusion_model.double_blocks.0.img_attn.qkv.diff_b' is a delta of shape (7,), "
                   f"the tensor it changes is (192,) ('double_blocks.0.img_attn.qkv.bias')") and not out.exists()


def tiny_flux_extraction(tiny_set, path, bias_rows: int | None = None) -> str:
    """A ComfyUI extraction of the tiny set's FLUX.1: one down / up module and three `.diff_b`, one of them the
    LoRA module's (the first: of `bias_rows` rows where given, the wrong size)."""
    model = FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32)
    params = dict(model.named_parameters())
    names = ["double_blocks.0.img_attn.qkv.bias", "double_blocks.0.img_mod.lin.bias", "single_blocks.0.linear2.bias"]
    biases = {n: numbered(bias_rows or params[n].shape[0], seed=i) * 0.3 for i, n in enumerate(names)}
    lora = {"diffusion_model.double_blocks.0.img_attn.qkv.lora_down.weight": numbered(4, 64, seed=7) * 0.1,
            "diffusion_model.double_blocks.0.img_attn.qkv.lora_up.weight": numbered(192, 4, seed=8) * 0.1}
    return as_file(biases, path, extra=lora)


def tiny_flux_full(tiny_set, path) -> str:
    """LyCORIS' full type on the tiny set's FLUX.1: whole deltas alone, two weights and a bias, ComfyUI's names."""
    params = dict(FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32).named_parameters())
    names = ["double_blocks.0.img_attn.proj.weight", "double_blocks.0.img_attn.proj.bias", "single_blocks.0.linear2.weight"]
    return as_file({n: numbered(*params[n].shape, seed=i) * 0.05 for i, n in enumerate(names)}, path)


@pytest.mark.parametrize("kind", ["extraction", "lycoris_full"])
def test_base_loras_and_generate_add_the_bias_deltas_as_the_merge_does(tiny_set, tmp_path, monkeypatch, kind):
    """A ComfyUI extraction as base_loras and as generate.py's --lora: the down / up modules and the `.diff_b`
    tensors, the old ones with a warning that the bias deltas were left out. Now the base_loras merge equals the
    merge_lora checkpoint, and generate renders with the LoRA what it renders with that checkpoint. generate.py the
    same with LyCORIS' full type (whole deltas alone), which it refused until 2026-11-30: its check on the meta
    model failed in LyCORIS' CPU copy of the weight ("LyCORIS does not recognise its keys"); base_loras refused it
    as a LyCORIS file, and now merges its deltas as they are, on an fp8_scaled run too (its check before caching
    on the meta model)."""
    import copy

    from library.lora_spec import LoRASpec
    from library.training.base_loras import merge_base_loras
    from tests.test_generate import generate_args
    from tools import generate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if kind == "extraction":
        path, modules = tiny_flux_extraction(tiny_set, tmp_path / "extract.safetensors"), 1 + 3
    else:
        path, modules = tiny_flux_full(tiny_set, tmp_path / "full.safetensors"), 3
    merged_file = str(tmp_path / "merged.safetensors")
    merged = merged_model(FluxFamily, tiny_set["flux_bfl"], path, merged_file, ratio=0.8)
    model = FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32)
    base = copy.deepcopy(model)
    assert merge_base_loras(base, "flux", [LoRASpec(path, 0.8)]) == modules
    assert_model_is(base, merged.state_dict())
    changed = "double_blocks.0.img_mod.lin.bias" if kind == "extraction" else "single_blocks.0.linear2.weight"
    assert not torch.equal(merged.state_dict()[changed], model.state_dict()[changed])

    images = {}
    for name, extra in (("lora", ("--lora", f"{path}:0.8")), ("merged", ("--model", merged_file)), ("base", ())):
        assert generate.main(generate_args(tiny_set, tmp_path / name, "--seed", "0", *extra)) == 0
        images[name] = torch.tensor(list(Image.open(tmp_path / name / "000_0.png").getdata()), dtype=torch.int16)
    assert (images["lora"] - images["merged"]).abs().max() <= 1 and (images["lora"] - images["base"]).abs().max() > 8
    if kind == "lycoris_full":
        import train_lora
        from tests.test_train_lora import flux_args

        assert train_lora.main(flux_args(tiny_set, tmp_path / "run", "--base_loras", f"{path}:0.8", "--fp8_base", "true",
                                         "--max_train_steps", "1", "--sample_prompts", "")) == 0


def test_a_bias_delta_of_another_shape_is_refused_before_any_model_loads(tiny_set, tmp_path, capsys, monkeypatch):
    """generate.py's --lora and train_lora.py's base_loras: read onto the transformer built on meta, one line."""
    import train_lora
    from library.training import diffusion_task
    from tests.test_generate import generate_args
    from tests.test_reliability import one_error_line
    from tests.test_train_lora import flux_args
    from tools import generate

    path = tiny_flux_extraction(tiny_set, tmp_path / "bad.safetensors", bias_rows=5)
    monkeypatch.setattr(FluxFamily, "load_text_encoder", lambda *a, **k: pytest.fail("a model loaded"))
    capsys.readouterr()
    line = one_error_line(capsys, generate.main(generate_args(tiny_set, tmp_path / "out", "--lora", path)))
    said = (f"{path}: 'diffusion_model.double_blocks.0.img_attn.qkv.diff_b' is a delta of shape (5,), the tensor it "
            f"changes is (192,) (double_blocks.0.img_attn.qkv.bias)")
    assert line == f"error: {said}", line
    for name in ("cache_latents", "cache_text"):
        monkeypatch.setattr(diffusion_task, name, lambda *a, **k: pytest.fail("cached before the refusal"))
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, tmp_path / "run", "--base_loras", f"{path}:0.5")))
    assert line == f"error: command line: key 'base_loras': {said}", line  # where it was set (old: the config file)


def test_the_merges_read_the_whole_deltas_on_the_files_pages_and_the_rest_into_memory(tiny_set, tmp_path, monkeypatch):
    """A file of whole deltas is as large as the model it changes: merge_lora (which streams the checkpoint) and
    merge_whole_deltas (generate.py, base_loras) held all of it in memory of their own, beside the model. They read
    the `.diff` / `.diff_b` tensors on the file's pages now; down / up in memory of their own (aligned for the GEMM)."""
    from library.lora_spec import LoRASpec
    from networks.lora_files import read_lora_tensors
    from networks.lora_reader import WholeDelta, merge_whole_deltas
    from tests.test_checkpoint_reader import on_pages_of
    from tools.merge_base import lora_deltas, open_base

    path = tiny_flux_extraction(tiny_set, tmp_path / "extract.safetensors")
    tensors = read_lora_tensors(path, map_whole_deltas=True)[0]
    plain = read_lora_tensors(path)[0]
    assert tensors.keys() == plain.keys() and all(torch.equal(tensors[k], plain[k]) for k in plain)
    diffs = [k for k in tensors if k.endswith(".diff_b")]
    assert len(diffs) == 3 and all(on_pages_of(path, tensors[k]) for k in diffs)
    assert not any(on_pages_of(path, v) for k, v in tensors.items() if k not in diffs)
    assert not any(on_pages_of(path, v) for v in plain.values())
    # merge_lora's deltas by checkpoint key, and what merge_whole_deltas adds
    merged = lora_deltas(open_base(tiny_set["flux_bfl"]), LoRASpec(path, 1.0), allow_unmatched=False)
    whole = [d for d in merged.values() if isinstance(d, WholeDelta)]
    assert len(whole) == 3 and all(on_pages_of(path, diff) for d in whole for diff, _ in d.parts)
    added, merge = [], WholeDelta.merged
    monkeypatch.setattr(WholeDelta, "merged", lambda self, *a: added.extend(diff for diff, _ in self.parts) or merge(self, *a))
    merge_whole_deltas(FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32), "flux", path, 1.0)
    assert len(added) == 3 and all(on_pages_of(path, diff) for diff in added)


def test_a_weight_delta_on_an_fp8_base_is_refused_before_any_model_loads(tiny_set, tmp_path, capsys, monkeypatch):
    """A `.diff` of a 2-D weight rendered on an fp8_scaled base (whose weights are e4m3 codes: no delta adds to
    them) was refused only once the text encoders had run and the transformer had loaded, in LyCORIS' words ("Quant
    Linear is not supported ... a file for another model"); now by the meta check, at the render's precision, saying
    what to do."""
    from tests.test_generate import generate_args
    from tests.test_reliability import one_error_line
    from tools import generate

    module = "double_blocks.0.img_attn.proj"
    weight = FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32).get_submodule(module).weight
    path = as_file({f"{module}.weight": numbered(*weight.shape, seed=3) * 0.01}, tmp_path / "full.safetensors")
    monkeypatch.setattr(FluxFamily, "load_text_encoder", lambda *a, **k: pytest.fail("a model loaded"))
    capsys.readouterr()
    args = generate_args(tiny_set, tmp_path / "out", "--lora", path, "--base_precision", "fp8_scaled")
    line = one_error_line(capsys, generate.main(args))
    assert line == (f"error: {path}: 'diffusion_model.{module}.diff' changes {module}.weight, which this model holds as "
                    f"torch.float8_e4m3fn: render on a bf16 base (base_precision bf16), or merge the file into a bf16 "
                    f"checkpoint with tools/merge_lora.py"), line


def test_resize_keeps_the_tensors_beside_the_lora(flux_loras, tmp_path, capsys):
    """resize_lora left ComfyUI's `.diff_b` out (a warning): the resized extraction lost its bias deltas. They have
    no rank; they are written back as they are."""
    from tools import resize_lora

    path = flux_loras["cases"]["ComfyUI extraction (.diff_b beside)"][0]
    out = tmp_path / "resized.safetensors"
    assert resize_lora.main(["--lora", path, "--save_to", str(out), "--new_rank", "2"]) == 0
    before, after = load_file(path), load_file(out)
    diffs = [k for k in before if k.endswith(".diff_b")]
    assert len(diffs) == 13 and all(torch.equal(after[k], before[k]) for k in diffs)
    assert max(after[k].shape[0] for k in after if k.endswith(".lora_down.weight")) == 2
    assert "left out" not in capsys.readouterr().err


def test_whole_deltas_merge_into_a_comfyui_scaled_fp8_base(flux_loras, tmp_path):
    """ComfyUI's scaled fp8 checkpoint holds Linear biases in e4m3 too: a `.diff_b` and a `.diff` merge into the
    dequantized values and are rounded back (stochastically, as ComfyUI patches an fp8 base) within one e4m3 step."""
    from library.precision import fp8

    root = flux_loras["root"]
    base = str(tmp_path / "fp8.safetensors")
    zero = flux_loras["cases"]["kohya (ours)"][0] + ":0"
    assert merge_lora.main(["--model", str(root / "base.safetensors"), "--lora", zero, "--save_to", base, "--save_precision", "fp8"]) == 0
    module = "double_blocks.0.img_attn.qkv"
    before = load_file(base)
    assert before[f"{module}.bias"].dtype == before[f"{module}.weight"].dtype == fp8.FP8_DTYPE
    diff_b, diff = numbered(192, seed=1) * 0.2, numbered(192, 64, seed=2) * 0.02
    path = str(tmp_path / "d.safetensors")
    save_file({f"diffusion_model.{module}.diff_b": diff_b, f"diffusion_model.{module}.diff": diff}, path)
    assert merge_lora.main(["--model", base, "--lora", f"{path}:{RATIO}", "--save_to", str(tmp_path / "m.safetensors")]) == 0
    after = load_file(tmp_path / "m.safetensors")

    def e4m3_step(x):  # the spacing of e4m3 values around x (3 mantissa bits)
        return torch.exp2(torch.floor(torch.log2(x.abs().clamp_min(2**-6))) - 3)

    want_b = before[f"{module}.bias"].float() + RATIO * diff_b
    assert after[f"{module}.bias"].dtype == fp8.FP8_DTYPE
    assert ((after[f"{module}.bias"].float() - want_b).abs() <= e4m3_step(want_b)).all()
    scale_in, scale_out = before[f"{module}.scale_weight"].float(), after[f"{module}.scale_weight"].float()
    want_w = before[f"{module}.weight"].float() * scale_in + RATIO * diff
    got_w = after[f"{module}.weight"].float() * scale_out
    assert ((got_w - want_w).abs() <= e4m3_step(want_w / scale_out) * scale_out).all()
    assert not torch.equal(after[f"{module}.bias"], before[f"{module}.bias"])


def test_combine_sums_the_whole_deltas_of_inputs_in_one_layout(flux_loras, tmp_path, capsys):
    """combine_loras left the `.diff_b` of ComfyUI extractions out; inputs in the output's layout now have theirs
    summed at the ratios (a merge of the combined file adds what merging each adds); inputs in two layouts keep
    the old warning."""
    from tools import combine_loras

    path = flux_loras["cases"]["ComfyUI extraction (.diff_b beside)"][0]
    other = as_file({"double_blocks.0.img_attn.qkv.bias": numbered(192, seed=5)}, tmp_path / "other.safetensors",
                    extra={k: v for k, v in load_file(path).items() if not k.endswith(".diff_b")})
    out = tmp_path / "both.safetensors"
    assert combine_loras.main(["--lora", f"{path}:0.5", f"{other}:-2", "--save_to", str(out)]) == 0
    a, b, got = load_file(path), load_file(other), load_file(out)
    key = "diffusion_model.double_blocks.0.img_attn.qkv.diff_b"
    assert torch.allclose(got[key], 0.5 * a[key] - 2 * b[key])
    assert all(torch.equal(got[k], 0.5 * a[k]) for k in a if k.endswith(".diff_b") and k != key)
    assert "left out" not in capsys.readouterr().err
    kohya = flux_loras["cases"]["kohya (ours)"][0]
    assert combine_loras.main(["--lora", path, kohya, "--save_to", str(tmp_path / "mixed.safetensors")]) == 0
    assert "left out 13 tensors beside the LoRA (bias deltas .diff_b x13): the inputs are in different layouts" in capsys.readouterr().err
    assert not any(k.endswith(".diff_b") for k in load_file(tmp_path / "mixed.safetensors"))


def test_a_bias_delta_holding_a_nan_is_one_line_and_nothing_merged_or_rendered(tiny_set, tmp_path, capsys, monkeypatch):
    """A diverged file's NaN in a `.diff_b` made every output of its layer NaN once generate and base_loras added the
    deltas (a black image, exit 0); merge_lora checked it on its own. Every tool reads whole deltas through one
    reader now, which names the tensor."""
    from tests.test_generate import generate_args
    from tests.test_reliability import one_error_line
    from tools import generate

    path = tiny_flux_extraction(tiny_set, tmp_path / "nan.safetensors")
    tensors = load_file(path)
    tensors["diffusion_model.double_blocks.0.img_mod.lin.diff_b"][3] = float("nan")
    save_file(tensors, path)
    said = (f"{path}: tensor 'diffusion_model.double_blocks.0.img_mod.lin.diff_b' holds 1 non-finite value (NaN / inf) "
            f"of 384: a broken LoRA, which would make the weights it touches NaN")
    monkeypatch.setattr(FluxFamily, "load_text_encoder", lambda *a, **k: pytest.fail("a model loaded"))
    capsys.readouterr()
    assert one_error_line(capsys, generate.main(generate_args(tiny_set, tmp_path / "out", "--lora", path))) == f"error: {said}"
    out = tmp_path / "merged.safetensors"
    assert merge_lora.main(["--model", tiny_set["flux_bfl"], "--lora", path, "--save_to", str(out)]) == 2
    assert capsys.readouterr().err.strip() == f"error: {said}" and not out.exists()
