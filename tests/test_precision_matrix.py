"""tools/precision_matrix.py on tiny FLUX and Qwen-Image: the table's shape, the position-bug
signature next to the flat weight-quantization one, and train-on-what-you-deploy for the bug.

The bases use the doctor tests' "realistic" init (sharp, position-local attention), so rounded
positions visibly matter at a 48 x 48 patch grid (768 px), where e4m3 keeps only part of 0..47.
The newer families (Z-Image, Chroma, Krea 2) run a one-LoRA matrix on their session tiny set, the
config from their spec alone."""

import csv
import os

import pytest
import torch

from library.models.flux1.checkpoint import save_flux_bfl
from library.models.qwen_image.model import save_qwen_image_diffusers
from test_precision_doctor import tiny_flux, tiny_qwen
from tools import precision_matrix

ROWS = ("bf16", "fp8+posbug")


@pytest.fixture(scope="module")
def two_images(tmp_path_factory) -> str:
    """A 2-image dataset (its TOML) for the trained rows: every row caches and trains on all of its
    images at 768 px, and 2 show the signatures as well as the session set's 8."""
    from tools.make_tiny_dataset import make_tiny_dataset

    return make_tiny_dataset(str(tmp_path_factory.mktemp("two_images")), count=2)["dataset_config"]


def write_config(tmp_path, tiny_set, family: str, dataset_config: str | None = None) -> str:
    if family == "flux":
        model = str(tmp_path / "flux.safetensors")
        save_flux_bfl(tiny_flux(), model)
        paths = (f'model_type = "flux"\npretrained_model_name_or_path = "{model}"\nae = "{tiny_set["flux_vae_single"]}"\n'
                 f'clip_l = "{tiny_set["clip_l"]}"\nt5xxl = "{tiny_set["t5xxl"]}"\nt5xxl_max_token_length = 32\n')
    else:
        model = str(tmp_path / "qwen")
        qwen = tiny_qwen()
        save_qwen_image_diffusers(qwen.state_dict(), qwen.config, model)
        paths = (f'model_type = "qwen_image"\npretrained_model_name_or_path = "{model}"\n'
                 f'ae = "{tiny_set["qwen_image_vae"]}"\ntext_encoder = "{tiny_set["qwen_image_text_encoder"]}"\n')
    config = tmp_path / "train.toml"
    config.write_text(paths + f'dataset_config = "{dataset_config or tiny_set["dataset_config"]}"\nmixed_precision = "no"\n'
                      'network_dim = 8\nnetwork_alpha = 8\noptimizer_type = "AdamW"\nlearning_rate = 3e-3\n'
                      f'output_dir = "{tmp_path / "unused"}"\nseed = 42\n')
    return str(config)


@pytest.mark.parametrize("family, spread", [("flux", "region_ratio"), ("qwen_image", "border_centre")])
def test_matrix_shape_and_the_position_bug_signature(tiny_set, two_images, tmp_path, family, spread):
    config = write_config(tmp_path, tiny_set, family, two_images)
    out = tmp_path / "matrix"
    assert precision_matrix.main(["--config_file", config, "--out", str(out), "--steps", "6", "--resolution", "768",
                                  "--max_items", "1", "--sigmas", "0.5", "--rows", ",".join(ROWS)], log=print) == 0
    with open(out / "matrix.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(ROWS) * len(precision_matrix.DEPLOYED_ON)
    cell = {(r["trained_on"], r["deployed_on"]): {k: float(v) for k, v in r.items() if k not in ("trained_on", "deployed_on")}
            for r in rows}
    assert set(cell) == {(t, d) for t in ROWS for d in precision_matrix.DEPLOYED_ON}
    assert os.path.getsize(out / "matrix.png") > 0 and "| fp8+posbug |" in (out / "matrix.md").read_text()
    for trained in ROWS:
        # weight quantization alone: a flat map; the position bug: error piled up where positions round
        assert cell[(trained, "fp8+lora")][spread] < 1.5
        assert cell[(trained, "fp8+lora+posbug")][spread] > 2.0
        assert cell[(trained, "bf16+lora")]["effect_kept"] == pytest.approx(1.0)
    # train on what you deploy: on the buggy deploy, the LoRA trained with the same bug is no worse
    diagonal, off = cell[("fp8+posbug", "fp8+lora+posbug")], cell[("bf16", "fp8+lora+posbug")]
    assert diagonal["val_loss"] <= off["val_loss"]
    assert diagonal["effect_kept"] >= off["effect_kept"] - 1e-3


def test_effect_kept_is_the_effect_projected_on_the_bf16_effect_noise_is_error_not_effect():
    """effect_kept was |effect| / |bf16 effect|: rounding noise orthogonal to the LoRA's effect counted as
    effect kept (a merge's noise read 1.005, a weak LoRA's 2.73). Now the projection: the bf16 effect plus
    noise keeps 1, half of it 0.5, the noise alone 0; the noise shows in effect_error."""
    g = torch.Generator().manual_seed(0)
    data = [(None, torch.zeros(1, 16, 8, 8))]
    base = [torch.randn(1, 16, 32, generator=g)]
    ref = [torch.randn(1, 16, 32, generator=g)]
    noise = torch.randn(1, 16, 32, generator=g)
    noise -= (noise * ref[0]).sum() / ref[0].pow(2).sum() * ref[0]  # orthogonal to the bf16 effect

    def cell(effect):
        return precision_matrix.cell_metrics([base[0] + effect], base, [base[0] + ref[0]], base, data, (4, 4), 2)

    noisy = cell(ref[0] + noise)
    assert noisy["effect_kept"] == pytest.approx(1.0, abs=1e-6)
    assert noisy["effect_error"] == pytest.approx(float(noise.norm() / ref[0].norm()), rel=1e-6)
    assert cell(0.5 * ref[0])["effect_kept"] == pytest.approx(0.5, abs=1e-6)
    assert cell(noise)["effect_kept"] == pytest.approx(0.0, abs=1e-6)


def test_the_posbug_row_bugs_the_transformer_alone_not_the_caption_cache(tiny_set, tmp_path, monkeypatch):
    """The fp8+posbug row patched core.rope_tables for its whole training run, and the Qwen-Image text encoder
    (library/models/llm.py) calls it too: its captions were encoded from fp8-rounded positions and cached on
    disk under the normal key, which later rows and trainings reused. Now the caches equal a clean encode, and
    the bug still reaches the transformer's positions (3 axes: frame, row, column) in training."""
    import torch

    from library.data.caches import read_cache
    from library.models.family import get_family
    from tools.make_tiny_dataset import make_tiny_dataset

    bugged, position_bug = [], precision_matrix.precision.position_bug

    def recorded(dtype):  # the positions each bugged rope_tables call receives
        return lambda rope_tables: position_bug(dtype)(lambda positions, *a, **k: bugged.append(positions.shape)
                                                        or rope_tables(positions, *a, **k))

    monkeypatch.setattr(precision_matrix.precision, "position_bug", recorded)
    data = tmp_path / "data"
    config = write_config(tmp_path, tiny_set, "qwen_image", make_tiny_dataset(str(data), count=2)["dataset_config"])
    with open(config, "a") as f:
        f.write("cache_text_encoder_outputs_to_disk = true\n")
    assert precision_matrix.main(["--config_file", config, "--out", str(tmp_path / "matrix"), "--steps", "2",
                                  "--resolution", "64", "--max_items", "1", "--sigmas", "0.5", "--dtype", "fp32",
                                  "--rows", "fp8+posbug", "--columns", "bf16+lora"], log=print) == 0
    assert len(bugged) == 2 and all(len(shape) == 3 and shape[-1] == 3 for shape in bugged), bugged  # 2 steps
    caches = sorted(data.rglob("*_te.safetensors"))
    assert len(caches) == 2
    cached = {path: read_cache(str(path)) for path in caches}
    for path in caches:
        path.unlink()
    args = precision_matrix.load_config(precision_matrix.run_args(config, []))
    precision_matrix.eval_data(args, get_family(args), 2)  # encodes the captions again, clean, into the same files
    for path, tensors in cached.items():
        clean = read_cache(str(path))
        assert all(torch.equal(tensors[k], clean[k]) for k in clean), path.name


def test_bad_row_is_one_line_exit_2(tiny_set, tmp_path, capsys):
    config = write_config(tmp_path, tiny_set, "flux")
    assert precision_matrix.main(["--config_file", config, "--out", str(tmp_path / "m"), "--rows", "fp16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "row 'fp16': expected one of" in err[0]


@pytest.mark.parametrize("extra, message", [
    (["--sigmas", "abc"], "--sigmas 'abc': expected numbers"),  # the old line: after every row had trained
    (["--sigmas", "2"], "--sigmas '2': each must be in (0, 1]"),  # the old line: a matrix at sigma 2
    (["--sigmas", "-0.5"], "--sigmas '-0.5': each must be in (0, 1]"),
    (["--rows", "bf16", "--loras", "nf4=x.safetensors"], "--loras nf4=...: row 'nf4' is not in --rows bf16"),  # was dropped
    (["--max_items", "0"], "--max_items 0: expected at least 1"),  # a ZeroDivisionError traceback after every row trained
    (["--steps", "0"], "--steps 0: expected at least 1"),  # silently the config's
    (["--rows", ""], "--rows '': expected at least one of"),  # an empty matrix written, then "max() arg is an empty sequence"
    (["--loras", "foo"], "--loras 'foo': expected row=path"),  # "dictionary update sequence element #0 has length 1"
])
def test_bad_sigmas_and_unused_loras_are_one_line_before_training(tiny_set, tmp_path, capsys, extra, message):
    config = write_config(tmp_path, tiny_set, "flux")
    assert precision_matrix.main(["--config_file", config, "--out", str(tmp_path / "m"), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "m").exists()  # old: the folder was made before the settings were read


def test_a_bad_concept_is_one_line_before_training(tiny_set, tmp_path, capsys):
    """--concept, and the concept.json found beside the dataset TOML, were first read after every row had trained;
    a family without a learned tiny base (whose encoder settings encode the trigger prompts) then said
    "Empty module name"."""
    import json

    from library.models.registry import spec_of
    from tools.learned_base import learned_families
    from tools.make_tiny_dataset import make_tiny_dataset
    from tools.make_tiny_models import tiny_config

    dataset = make_tiny_dataset(str(tmp_path / "data"), count=1)["dataset_config"]
    beside = tmp_path / "data" / "concept.json"
    beside.write_text("{")
    concept = tmp_path / "concept.json"
    concept.write_text(json.dumps({"trigger": "zxq", "colour": "purple", "shape": "star", "unrelated_prompts": [],
                                   "trigger_prompts": ["a small zxq on the left, white background"]}))
    unlearned = tmp_path / "hidream_o1.toml"
    unlearned.write_text(tiny_config("hidream_o1", tiny_set, mixed_precision="no",
                                     output_dir=str(tmp_path / "unused")))
    cases = [(write_config(tmp_path, tiny_set, "flux"), ["--concept", str(tmp_path / "missing.json")],
              f"error: {tmp_path / 'missing.json'}: cannot read the concept file"),
             (write_config(tmp_path, tiny_set, "flux", dataset), [], f"error: {beside}: cannot read the concept file"),
             (str(unlearned), ["--concept", str(concept)],
              f"error: {concept}: concept_rate encodes the trigger prompts as a learned tiny base does, but model_type "
              f"'hidream_o1' has no learned tiny base: expected one of {', '.join(learned_families())}; "
              "pass --concept none")]
    assert not spec_of("hidream_o1").learned
    for config, extra, message in cases:
        assert precision_matrix.main(["--config_file", config, "--out", str(tmp_path / "m"), "--rows", "bf16",
                                      "--columns", "bf16+lora", "--steps", "1", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(message), err
        assert not (tmp_path / "m").exists()  # no row trained


def test_an_out_below_a_file_is_one_line(tiny_set, tmp_path, capsys):
    """Old: NotADirectoryError's traceback (exit 1)."""
    config = write_config(tmp_path, tiny_set, "flux")
    (tmp_path / "file").write_text("")
    assert precision_matrix.main(["--config_file", config, "--out", str(tmp_path / "file" / "m"), "--rows", "bf16",
                                  "--columns", "bf16+lora"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: --out {tmp_path / 'file' / 'm'}: cannot be created, '{tmp_path / 'file'}' is a file, not a folder"], err


def test_a_given_lora_of_another_model_is_one_line_before_training(tiny_set, tmp_path, capsys):
    """--loras files were first read after the other rows had trained (minutes), and then said "convert_lora"."""
    from library.models.qwen_image.model import load_qwen_image
    from networks.lora import LoRANetwork

    qwen = str(tmp_path / "qwen_lora.safetensors")
    LoRANetwork(load_qwen_image(tiny_set["qwen_image"]), "qwen_image", 4, 4.0).save(qwen)
    config = write_config(tmp_path, tiny_set, "flux")
    assert precision_matrix.main(["--config_file", config, "--out", str(tmp_path / "m"), "--rows", "bf16,fp8",
                                  "--loras", f"fp8={qwen}"]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {qwen}: a LoRA for Qwen-Image (tools/lora_info.py: arch qwen_image, diffusers names), "
                   f"not for this FLUX.1 model"]
    assert not (tmp_path / "m").exists()  # refused before the folder is made



@pytest.mark.parametrize("lines", ['base_precision = "nf4"\n', 'base_precision = "fp8_scaled"\n',
                                   'fp8_base = true\nfp8_scaled = false\n', 'fp8_compute = true\n', ""])
def test_each_row_trains_on_its_own_base_whatever_the_config_says(tiny_set, tmp_path, lines):
    """A config's base_precision = "nf4" trained the "bf16" row on nf4 (exit 0, the row mislabelled); one with
    base_precision = "fp8_scaled" or fp8_scaled = false failed rows after others had trained (two bases asked, or
    fp8_scaled set where no fp8 base reads it: every nf4 / int8 / GGUF row failed so)."""
    from library.training.config import base_precision, load_config

    config = write_config(tmp_path, tiny_set, "flux")
    with open(config, "a") as f:
        f.write(lines)
    for row in precision_matrix.TRAINED_ON:
        bf16 = ["--mixed_precision", "bf16"] if row == "fp8_compute" else []  # (its bf16 outputs: the config's is "no")
        args = load_config(precision_matrix.run_args(config, precision_matrix.TRAIN_FLAGS[row] + bf16))
        wanted = {"fp8+posbug": "fp8", "fp8_compute": "fp8_scaled"}.get(row, "bf16" if row in precision_matrix.GGUF_BASES else row)
        assert (base_precision(args), args.fp8_compute) == (wanted, row == "fp8_compute"), row


@pytest.mark.parametrize("lines, message", [
    ('network_args = ["dora=True"]\n', "DoRA: the precision matrix applies and merges plain LoRAs"),
    ('network_module = "lycoris.kohya"\nnetwork_args = ["algo=lokr"]\n', "network_module lycoris.kohya: the precision"),
    ('base_loras = ["{lora}"]\n', "base_loras: the matrix evaluates each LoRA on the bare checkpoint"),
])
def test_a_network_the_columns_cannot_take_is_one_line_before_training(tiny_set, tmp_path, capsys, lines, message):
    """A DoRA or LoKr config trained every row, then the evaluation refused the files; base_loras trained the rows
    on the merged base and evaluated them on the bare one (silently)."""
    config = write_config(tmp_path, tiny_set, "flux")
    with open(config, "a") as f:
        f.write(lines.format(lora=tmp_path / "style.safetensors"))
    (tmp_path / "style.safetensors").write_bytes(b"")  # (only its name is read before training)
    assert precision_matrix.main(["--config_file", config, "--out", str(tmp_path / "m"), "--rows", "bf16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "m").exists()


def test_a_pre_quantized_base_is_one_line_before_training(tiny_set, tmp_path, capsys):
    """A ComfyUI scaled-fp8 checkpoint loads as stored whatever row or column asks: the old matrix went
    on to train (or, with every --loras given, to deploy) on that one base in every cell."""
    from test_fp8_checkpoints import comfy_state_dict, write_comfy

    config = write_config(tmp_path, tiny_set, "flux")
    model = tiny_flux()
    stored = write_comfy(comfy_state_dict(model, "flux", "marker"), tmp_path / "flux.safetensors", "flux", config=model.config)
    assert precision_matrix.main(["--config_file", config, "--out", str(tmp_path / "m"), "--rows", "bf16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {config}: pretrained_model_name_or_path {stored}: the transformer is stored pre-quantized "
                   f"(fp8_tensor_scaled) and loads as stored whatever precision is asked for, so every row and column "
                   f"would train and deploy on that one base; give the bf16 checkpoint"]
    assert not (tmp_path / "m").exists()  # refused before the folder is made

def test_an_llm_config_is_refused_as_such(tiny_set, tmp_path, capsys):
    """The old line blamed sample_prompts, a key the tool itself adds for its training runs."""
    config = tmp_path / "llm.toml"
    config.write_text(f'model_type = "llm"\npretrained_model_name_or_path = "{tiny_set["llm"]}"\n'
                      f'train_data = ["{tiny_set["corpus"]}"]\n')
    assert precision_matrix.main(["--config_file", str(config), "--out", str(tmp_path / "m")]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {config}: model_type llm: the precision matrix is for the "
                                               f"diffusion models")


def test_fp8_compute_row_and_column_need_bf16_then_run(tiny_set, tmp_path, capsys, monkeypatch):
    """The fp8_compute row (trained with fp8_compute = true) and column (fp8_scaled base run as fp8 GEMMs):
    refused in one line unless the config and --dtype compute in bf16, and on a torch whose CPU
    _scaled_mm takes no per-row scales (2.11), before any training; then the cell keeps the LoRA."""
    config = write_config(tmp_path, tiny_set, "flux")
    base = ["--config_file", config, "--out", str(tmp_path / "m"), "--steps", "2", "--max_items", "1", "--sigmas", "0.5",
            "--rows", "fp8_compute", "--columns", "fp8_compute+lora"]
    assert precision_matrix.main(base) == 2
    assert "needs mixed_precision = \"bf16\"" in capsys.readouterr().err
    with open(config) as f:
        text = f.read()
    with open(config, "w") as f:
        f.write(text.replace('mixed_precision = "no"', 'mixed_precision = "bf16"'))
    assert precision_matrix.main(base + ["--dtype", "fp32"]) == 2
    assert "pass --dtype bf16" in capsys.readouterr().err
    with monkeypatch.context() as patch:
        patch.setattr(precision_matrix, "fp8_gemm_available", lambda device: False)
        assert precision_matrix.main(base) == 2
    assert "no CPU fp8 GEMMs with per-row scales" in capsys.readouterr().err
    assert not (tmp_path / "m").exists()  # refused before training, before the folder is made
    if not precision_matrix.fp8_gemm_available("cpu"):
        pytest.skip("this torch's CPU _scaled_mm takes no per-row scales")
    assert precision_matrix.main(base, log=print) == 0
    with open(tmp_path / "m" / "matrix.csv") as f:
        cell = {r["deployed_on"]: {k: float(v) for k, v in r.items() if k not in ("trained_on", "deployed_on")}
                for r in csv.DictReader(f)}
    assert set(cell) == {"bf16+lora", "fp8_compute+lora"}
    assert 0.8 < cell["fp8_compute+lora"]["effect_kept"] < 1.2 and cell["fp8_compute+lora"]["effect_error"] > 0


# The random LoRA moves the tiny FLUX.3's output by only 1-2% (random inputs): computed in bf16, its effect error on
# an fp8 base is 0.21, in fp32 0.035 (both measured), the rest bf16's rounding of that small difference. It runs fp32.
# Nucleus-Image's expert-choice routing is a top-k per expert: the fp8 base's rounding upstream flips which tokens an
# expert takes, with the LoRA and without it alike, so the effect moves by more. Measured with the experts in fp8 too
# (fp8_packed): this LoRA 0.348 on fp8 and 0.368 on fp8_scaled in fp32; LoRA seeds 1-5 0.31-0.39 in fp32, seeds 1-3
# 0.32-0.41 in bf16. With the experts bf16 it was 0.358 on both; the same tiny model all dense 0.07, its experts
# taking every token 0.10 (experts bf16). The bound: 1.2x this LoRA's larger error, above every seed's.
EFFECT_ERROR_BOUND = {"nucleus_image": 0.45}


@pytest.mark.parametrize("family, dtype", [("zimage", "bf16"), ("chroma", "bf16"), ("krea2", "bf16"),
                                           ("flux3", "fp32"), ("ernie_image", "bf16"), ("nucleus_image", "fp32"),
                                           ("hunyuan_image", "bf16")])  # patch 1: the family packs its own tokens
def test_a_tiny_matrix_runs_on_the_families_tiny_set(tiny_set, tmp_path, family, dtype):
    """Every deploy column for one given LoRA (random, rank 4: no training) on the family's tiny set at
    128 px, one image, one sigma: the config comes from the family's spec (TINY.config_files) through
    tools/make_tiny_models.py, and nothing here names more than the family."""
    from library.models.registry import spec_of
    from library.models.spec import load_symbol
    from tests.test_merge_convert import lora
    from tools.make_tiny_models import tiny_config

    spec = spec_of(family)
    model = load_symbol(spec.transformer.load)(tiny_set[spec.tiny.transformer])
    lora(model, spec.arch, rank=4, alpha=4.0, seed=1).save(str(tmp_path / "lora.safetensors"))
    config = tmp_path / "train.toml"
    config.write_text(tiny_config(family, tiny_set, mixed_precision="no", output_dir=str(tmp_path / "unused"), seed=42))
    out = tmp_path / "matrix"
    assert precision_matrix.main(["--config_file", str(config), "--out", str(out), "--resolution", "128",
                                  "--max_items", "1", "--sigmas", "0.5", "--rows", "bf16",
                                  "--loras", f"bf16={tmp_path / 'lora.safetensors'}", "--dtype", dtype], log=print) == 0
    with open(out / "matrix.csv") as f:
        cell = {r["deployed_on"]: {k: float(v) for k, v in r.items() if k not in ("trained_on", "deployed_on")}
                for r in csv.DictReader(f)}
    assert set(cell) == set(precision_matrix.DEPLOYED_ON)
    assert cell["bf16+lora"]["effect_kept"] == pytest.approx(1.0) and cell["bf16+lora"]["effect_error"] == 0.0
    # the LoRA at runtime on an fp8 base keeps its effect, with the error the base's rounding gives it
    for deploy in ("fp8+lora", "fp8_scaled+lora"):
        kept, error = cell[deploy]["effect_kept"], cell[deploy]["effect_error"]
        assert 0.9 < kept < 1.1 and 0.0 < error < EFFECT_ERROR_BOUND.get(family, 0.2), (deploy, cell[deploy])
    assert all(0.0 < c["val_loss"] < 10.0 for c in cell.values())


def edit_config(tmp_path, tiny_set, model_type: str) -> tuple[str, str]:
    """(config, image folder) of a 2-pair edit set (32 px) on the tiny model_type, caches on disk."""
    from library.models.krea2.tiny import write_krea2_edit_text_encoder
    from tools.make_tiny_dataset import make_tiny_edit_dataset

    data = make_tiny_edit_dataset(str(tmp_path / "data"), count=2, size=32)
    if model_type == "krea2_edit":
        text_encoder = write_krea2_edit_text_encoder(str(tmp_path), 0)["krea2_edit_text_encoder"]
        files = [tiny_set["krea2_diffusers"], text_encoder]
    else:
        files = [tiny_set["qwen_image_edit"], tiny_set["qwen_image_edit_text_encoder"]]
    config = tmp_path / "train.toml"
    config.write_text(f'model_type = "{model_type}"\npretrained_model_name_or_path = "{files[0]}"\n'
                      f'ae = "{tiny_set["qwen_image_vae"]}"\ntext_encoder = "{files[1]}"\n'
                      f'dataset_config = "{data["edit_dataset_config"]}"\ncache_latents_to_disk = true\n'
                      f'cache_text_encoder_outputs_to_disk = true\nmixed_precision = "no"\nnetwork_dim = 4\n'
                      f'network_alpha = 4\noptimizer_type = "AdamW"\nlearning_rate = 1e-3\n'
                      f'output_dir = "{tmp_path / "unused"}"\nseed = 42\n')
    return str(config), data["edit_image_dir"]


@pytest.mark.parametrize("model_type", ["krea2_edit", "qwen_image_edit"])
def test_an_edit_family_is_evaluated_with_its_references(tiny_set, tmp_path, monkeypatch, model_type):
    """The evaluation scanned, encoded and predicted the edit set as a text-to-image one, after the row had trained:
    krea2_edit's cells were measured without the references (the captions encoded without them, beside the
    training's caches), qwen_image_edit's text encoder raised a TypeError. Now every prediction, the row's
    training and the matrix's, sees the reference, from the caches the training wrote."""
    from library.models.family import get_family

    config, images = edit_config(tmp_path, tiny_set, model_type)
    family = type(get_family(precision_matrix.load_config(["--config_file", config])))
    seen, predict = [], family.predict

    def recording(self, *args, control=None, **kwargs):
        seen.append(len(control or []))
        return predict(self, *args, control=control, **kwargs)

    monkeypatch.setattr(family, "predict", recording)
    assert precision_matrix.main(["--config_file", config, "--out", str(tmp_path / "m"), "--steps", "1",
                                  "--rows", "bf16", "--columns", "bf16+lora", "--max_items", "2", "--sigmas", "0.5",
                                  "--dtype", "fp32", "--concept", "none"], log=print) == 0
    # a training step, then 2 images on 2 bases (bf16 with the LoRA, without): each with its one reference
    assert len(seen) == 1 + 2 * 2 and set(seen) == {1}, seen
    caches = sorted(f for f in os.listdir(images) if f.endswith(".safetensors"))
    assert len(caches) == 2 * 2, caches  # a latent and a text cache per image: the training's, read again


def test_a_layered_family_is_one_line_before_training(tiny_set, tmp_path, capsys):
    """Its targets are frames (per-token maps of one image) and its base loads as Qwen-Image's: refused, not trained."""
    from tools.make_tiny_models import tiny_config

    config = tmp_path / "layered.toml"
    config.write_text(tiny_config("qwen_image_layered", tiny_set, tiny_set["qwen_image_layered"]))
    assert precision_matrix.main(["--config_file", str(config), "--out", str(tmp_path / "m"), "--rows", "bf16"]) == 2
    assert capsys.readouterr().err.strip() == (f"error: {config}: model_type qwen_image_layered trains on layered "
                                               f"targets; the precision matrix evaluates single-image models")
    assert not (tmp_path / "m").exists()  # no row trained
