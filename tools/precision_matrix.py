"""The train-precision x deploy-precision matrix: which LoRA survives which base, measured.

    python tools/precision_matrix.py --config_file my_run.toml --out matrix/ [--steps 200] \
        [--resolution 1024] [--loras bf16=a.safetensors,fp8=b.safetensors,fp8_scaled=c.safetensors] \
        [--rows bf16,fp8_scaled,nf4,gguf_q4_0] [--columns bf16+lora,nf4+lora,gguf_q4_0+lora,...] \
        [--max_items 8] [--sigmas 0.1,0.3,0.5,0.7,0.9] [--dtype bf16|fp32] [--concept concept.json|none]

Rows (trained on): the same training config run once per base precision, same seed and steps:
bf16 (the high-precision base), fp8 (plain cast), fp8_scaled, and fp8+posbug: the fp8 base with
the bug users hit (positions cast to the weight dtype before RoPE), as a buggy trainer would train.
More rows (--rows): fp8_compute (the fp8_scaled base run as fp8 GEMMs, train_lora's fp8_compute = true;
the config must compute in bf16, and --dtype bf16), nf4 / nf4_dq / int8 (bitsandbytes' layers, base_precision), and gguf_q8_0 /
gguf_q4_0 (the base transformer written as a GGUF file by our writer, OUT/bases/, and trained over as
stored). The 4-bit GGUF is Q4_0, not Q4_K: a K-quant block spans 256 weights of a row and most Linears
of the tiny bases are 128 wide, so a Q4_K file would hold Q4_K in few layers (llama.cpp falls back to
Q5_0 for the rest). --loras takes existing files instead of training (missing rows are trained).

Columns (deployed on): the LoRA at runtime on bf16 / fp8 / fp8_scaled bases, merged into fp8 and
fp8_scaled (round to nearest: merge_rtn; stochastic rounding: merge_sr), and fp8+lora+posbug (a
runtime LoRA on an fp8 base whose inference code has the position bug). More (--columns): the LoRA at
runtime on fp8_compute (fp8_compute+lora: ComfyUI's fp8 matmul in kind, per-row scales; --dtype bf16),
on nf4 / nf4_dq / int8 and on the GGUF bases (gguf_q8_0+lora, gguf_q4_0+lora), and merged
into a GGUF (gguf_q8_0+merge: merge_lora of the bf16 base and the LoRA, quantized as the GGUF base is;
ComfyUI-GGUF itself applies LoRAs at runtime, and merging into a GGUF file's blocks would re-round them).

Each cell, on the same images with fixed noise at fixed sigmas (comparable between cells and runs):
- val_loss: the flow-matching loss (mean over images and sigmas);
- border_centre / region_ratio: where the prediction's error against the same LoRA on bf16 sits
  (library.models.precision_doctor.map_ratios: ~1 = flat weight-quantization error; high = position damage);
- effect_kept: the LoRA's effect on the deploy base (pred with LoRA - pred without) projected on its
  effect on bf16, <effect, bf16 effect> / |bf16 effect|^2 (1 = all of it survives; rounding noise
  orthogonal to it counts in effect_error, not here: a norm ratio took noise for effect), and
  effect_error: |effect - bf16 effect| / |bf16 effect|;
- concept_rate, when the dataset is a concept (the concept.json of tools/make_tiny_dataset.py --concept
  beside the dataset TOML, or --concept): the share of the trigger prompts that render the concept's
  colour and shape on that base with the LoRA (tools/concept_demo.render_and_score), NaN otherwise.

Writes OUT/matrix.csv, OUT/matrix.md (tables) and OUT/matrix.png (per-token error heatmaps, rows =
trained on, columns = deployed on). Exit 2 with one line on bad input.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import math
import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.cli import Parser, check_command_line, check_out_folder, exit_without_collecting  # noqa: E402

DEFAULT_ROWS = ("bf16", "fp8", "fp8_scaled", "fp8+posbug")
LOWBIT = ("nf4", "nf4_dq", "int8")  # bitsandbytes' layers, quantized while loading (base_precision)
GGUF_BASES = {"gguf_q8_0": "Q8_0", "gguf_q4_0": "Q4_0"}  # written from the base by gguf_writer (OUT/bases/)
COMPUTED = ("fp8_compute",)  # the fp8_scaled base run as fp8 GEMMs (bf16 only)
TRAINED_ON = DEFAULT_ROWS + COMPUTED + LOWBIT + tuple(GGUF_BASES)


def row_flags(base: str, fp8_compute: bool = False) -> list[str]:
    """train_lora's flags for a row trained on `base` whatever the config says of its base: base_precision,
    the older fp8_base / fp8_scaled spelling agreeing with it (fp8_scaled at its default where no fp8 base
    reads it), fp8_compute. A config's base_precision = "nf4" trained the "bf16" row on nf4."""
    fp8 = base in ("fp8", "fp8_scaled")
    return ["--base_precision", base, "--fp8_base", str(fp8).lower(), "--fp8_scaled", str(base != "fp8").lower(),
            "--fp8_compute", str(fp8_compute).lower()]


TRAIN_FLAGS = {row: row_flags(row) for row in ("bf16", "fp8", "fp8_scaled", *LOWBIT)}
TRAIN_FLAGS["fp8+posbug"] = TRAIN_FLAGS["fp8"]
TRAIN_FLAGS["fp8_compute"] = row_flags("fp8_scaled", fp8_compute=True)
TRAIN_FLAGS.update({g: row_flags("bf16") for g in GGUF_BASES})  # + the file as the base (a GGUF base trains as bf16)
DEPLOYED_ON = ("bf16+lora", "fp8+lora", "fp8_scaled+lora", "fp8+merge_rtn", "fp8+merge_sr",
               "fp8_scaled+merge_rtn", "fp8_scaled+merge_sr", "fp8+lora+posbug")  # the default columns
DEPLOYABLE = DEPLOYED_ON + tuple(f"{m}+lora" for m in COMPUTED + LOWBIT) + tuple(f"{g}+{how}" for g in GGUF_BASES for how in ("lora", "merge"))
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def build_parser() -> argparse.ArgumentParser:
    p = Parser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config_file", required=True, help="the training TOML the rows are trained with (model paths, dataset)")
    p.add_argument("--out", default="precision_matrix")
    p.add_argument("--steps", type=int, default=None, help="max_train_steps of each row (default: the config's)")
    p.add_argument("--resolution", type=int, default=None, help="train and evaluate at this square size (default: the dataset's)")
    p.add_argument("--loras", default="", help="trained_on=path,... to take instead of training (rows: " + ", ".join(TRAINED_ON) + ")")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="which rows, of " + ", ".join(TRAINED_ON))
    p.add_argument("--columns", default=",".join(DEPLOYED_ON), help="which deploy columns (bf16+lora always), of " + ", ".join(DEPLOYABLE))
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES),
                   help="the high-precision weights' and compute dtype of every base (fp32: faster on a CPU)")
    p.add_argument("--concept", default=None, help="concept.json whose trigger prompts give concept_rate (default: the one "
                                                   "beside the dataset TOML, if any; none: no concept_rate)")
    p.add_argument("--max_items", type=int, default=8, help="images evaluated")
    p.add_argument("--sigmas", default="0.1,0.3,0.5,0.7,0.9")
    p.add_argument("--seed", type=int, default=0, help="noise seed of the evaluation")
    return p


# The arguments are checked before torch and the library load (seconds): --help and a bad flag answer at once.
if __name__ == "__main__":
    check_command_line(build_parser)

import torch  # noqa: E402

import train_lora  # noqa: E402
from library.data.caches import cache_latents, cache_text, hold_cache_folders, loaded_on_first_call  # noqa: E402
from library.data.dataset import ImageDataset  # noqa: E402
from library.data.controls import check_family_takes  # noqa: E402
from library.data.dataset_config import load_dataset_config  # noqa: E402
from library.data.image_folders import split_validation  # noqa: E402
from library.io import CheckpointError, atomic_path, write_text  # noqa: E402
from library.models.family import control_kwargs, get_family  # noqa: E402
from library.models import precision_doctor as precision  # noqa: E402
from library.precision.fp8 import FP8_DTYPE  # noqa: E402
from library.precision.fp8_compute import fp8_gemm_available  # noqa: E402
from library.precision.stored_layouts import refuse_stored_base  # noqa: E402
from library.models import flow_matching as fm  # noqa: E402
from library.training.config import ConfigError, load_config, lora_network_args  # noqa: E402
from library.training.diffusion_task import DiffusionTask, scan_family_images  # noqa: E402
from library.training.state import sample_seed  # noqa: E402
from library.models.family import fp8_prepare  # noqa: E402
from library.models.registry import arch_spec  # noqa: E402
from library.models.spec import load_symbol  # noqa: E402
from networks.lora_reader import check_lora_arch  # noqa: E402
from tools.precision_doctor import apply_runtime_lora, disk_variant, read_lora_for  # noqa: E402


def base_of(deploy: str) -> str:
    """The same base without the LoRA: 'fp8_scaled+merge_sr' -> 'fp8_scaled', '+posbug' kept."""
    precision_name = deploy.split("+")[0]
    return precision_name + ("+posbug" if deploy.endswith("+posbug") else "")


class Bases:
    """Every base a row trains on or a column deploys on, loaded from the config's checkpoint one at a
    time: bf16 / fp8 / fp8_scaled (tools/precision_doctor.disk_variant: quantized while loading, LoRA
    merged on the way), nf4 / int8 (bitsandbytes' layers while loading), and GGUF files written once
    from the checkpoint into OUT/bases/ (loaded as stored: GGUFLinear)."""

    def __init__(self, model_path: str, arch: str, dtype: torch.dtype, out: str, seed: int):
        self.model_path, self.arch, self.dtype, self.seed = model_path, arch, dtype, seed
        self.folder, self.files = os.path.join(out, "bases"), {}

    def gguf(self, name: str, lora_path: str | None = None) -> str:
        """The GGUF file of base `name` (gguf_q8_0 ...): the checkpoint quantized by merge_lora's GGUF
        writer, with the LoRA at lora_path merged in first when given (written once per run)."""
        from library.lora_spec import LoRASpec
        from tools.merge_lora import merge_lora

        key = (name, lora_path)
        if key not in self.files:
            stem = os.path.splitext(os.path.basename(self.model_path))[0]
            merged = sum(1 for _, lora in self.files if lora)  # rows' LoRAs are all "lora.safetensors": numbered
            path = os.path.join(self.folder, f"{stem}-{name}" + (f"+lora{merged + 1}" if lora_path else "") + ".gguf")
            os.makedirs(self.folder, exist_ok=True)
            merge_lora(self.model_path, [LoRASpec(lora_path, 1.0)] if lora_path else [], path, name)
            self.files[key] = path
        return self.files[key]

    def load(self, deploy: str, lora=None, lora_path: str | None = None):
        """The model of column `deploy` ('nf4+lora', 'gguf_q4_0+merge', 'fp8+lora+posbug' ...), or of
        the base alone for a name without '+'; lora: read_lora_for's weights, lora_path: its file."""
        name, _, how = deploy.removesuffix("+posbug").partition("+")
        if name not in GGUF_BASES and name not in LOWBIT:
            return disk_variant(self.model_path, self.arch, deploy.removesuffix("+posbug"), lora, self.seed, dtype=self.dtype)
        load = load_symbol(arch_spec(self.arch).transformer.load)
        if name in GGUF_BASES:
            model = load(self.gguf(name, lora_path if how == "merge" else None), dtype=self.dtype)
        else:
            model = load(self.model_path, dtype=self.dtype, prepare=fp8_prepare(name, self.arch))
        model = model.requires_grad_(False).eval()
        return apply_runtime_lora(model, lora) if how == "lora" else model


class Concept:
    """The concept's trigger prompts, encoded once, and the VAE that decodes their renders. The file and the
    family's learned base (whose encoder settings encode the prompts) are checked when made, before any row
    trains; the prompts are encoded and the VAE loaded at the first rate()."""

    def __init__(self, path: str, family):
        from tools.concept_demo import read_concept, wanted_of
        from tools.learned_base import learned_spec

        self.path, self.family = path, family
        concept = read_concept(path)
        try:
            learned_spec(family.name)
        except ValueError as e:
            raise ValueError(f"{path}: concept_rate encodes the trigger prompts as a learned tiny base does, but {e}; "
                             f"pass --concept none") from None
        self.prompts = concept["trigger_prompts"]
        self.name = f"'{concept['trigger']}' = {concept['colour']} {concept['shape']}"
        self.wanted, self.text, self.vae = wanted_of(concept, self.prompts), None, None

    def rate(self, model, seed: int, position_bug: bool) -> float:
        """Share of the trigger prompts whose render on `model` shows the concept (concept_demo's reading)."""
        from tools.concept_demo import render_and_score
        from tools.learned_base import encode_prompts

        if self.text is None:  # outside the position bug's patch below
            self.text, self.vae = encode_prompts(self.family, self.prompts), self.family.load_vae(torch.float32)
        bug = precision.position_bug(precision.storage_dtype(model)) if position_bug else (lambda f: f)
        with precision.patched_rope_tables(bug), torch.no_grad():
            hits = render_and_score(self.family, model, self.vae, self.text, self.wanted, seed)[1]
        return sum(hits) / len(hits)


def find_concept(option: str | None, dataset_config: str) -> str | None:
    """--concept, else the concept.json beside the dataset TOML (make_tiny_dataset --concept writes both)."""
    if option == "none":
        return None
    if option:
        return option
    beside = os.path.join(os.path.dirname(os.path.abspath(dataset_config)), "concept.json")
    return beside if os.path.exists(beside) else None


# ----------------------------------------------------------------------------------------------
# Training the rows


def run_args(config_file: str, overrides: list[str]) -> list[str]:
    return ["--config_file", config_file, "--sample_prompts", "", "--sample_at_first", "false",
            "--save_every_n_steps", "0", "--save_every_n_epochs", "0", "--save_last_n_saves", "0", "--save_state", "false",
            *overrides]


@contextlib.contextmanager
def bugged_transformer(dtype: torch.dtype):
    """The position bug in the trained transformer alone: its forward (training, validation) computes RoPE
    from positions cast to `dtype`. Not process-wide: the LLM text encoders call core.rope_tables too, and
    the captions they encode in the run are cached on disk under the key every later run reuses."""
    load_base = DiffusionTask._load_base

    def load_bugged(task):
        base = load_base(task)
        forward = base.forward

        def bugged(*args, **kwargs):
            with precision.patched_rope_tables(precision.position_bug(dtype)):
                return forward(*args, **kwargs)

        base.forward = bugged
        return base

    DiffusionTask._load_base = load_bugged
    try:
        yield
    finally:
        DiffusionTask._load_base = load_base


def train_row(trained_on: str, config_file: str, out: str, overrides: list[str], bases: "Bases") -> str:
    """Train one row's LoRA (in this process; the position bug patched into the transformer for '+posbug';
    a GGUF row over its GGUF copy of the base)."""
    folder = os.path.join(out, f"train_{trained_on.replace('+', '_')}")
    flags = [*TRAIN_FLAGS[trained_on], *(["--pretrained_model_name_or_path", bases.gguf(trained_on)] if trained_on in GGUF_BASES else [])]
    argv = run_args(config_file, [*overrides, *flags, "--output_dir", folder, "--output_name", "lora"])
    with bugged_transformer(FP8_DTYPE) if trained_on.endswith("+posbug") else contextlib.nullcontext():
        code = train_lora.main(argv)
    if code != 0:
        raise ValueError(f"training the {trained_on} row failed (exit {code}); run train_lora.py with the same config to see why")
    return os.path.join(folder, "lora.safetensors")


# ----------------------------------------------------------------------------------------------
def refuse_unevaluated_networks(args, config_file: str) -> None:
    """What the rows would train but the evaluation cannot take, before any row trains (hours at full size): the
    columns apply and merge plain LoRAs (a DoRA or LyCORIS file was refused after every row trained), on the bare
    checkpoint (base_loras were merged into the rows' training base only: each LoRA measured on another base)."""
    net_args = lora_network_args(args)
    if args.network_module != "networks.lora" or net_args.get("dora") or net_args.get("use_dora"):
        network = "DoRA" if args.network_module == "networks.lora" else f"network_module {args.network_module}"
        raise ValueError(f"{config_file}: {network}: the precision matrix applies and merges plain LoRAs "
                         f"(networks.lora without dora)")
    if args.base_loras:
        raise ValueError(f"{config_file}: base_loras: the matrix evaluates each LoRA on the bare checkpoint; merge them "
                         f"into it with tools/merge_lora.py and give that file as pretrained_model_name_or_path")


# Evaluation data: the config's images, from the training caches (encoders load only if needed)


def eval_data(args, family, max_items: int) -> list[tuple[str, torch.Tensor, dict, list | None]]:
    """[(key, latents [1, C, h, w] float32, text {k: [1, ...]}, reference latents [[1, C, h', w'], ...] or None)]
    for the first max_items images, scanned, cached and encoded as training does them (an edit family's text
    sees the references), their cache folders held shared while cached and read (a training run alone there
    removes the cache files its own entries do not use)."""
    blueprint = load_dataset_config(args.dataset_config)
    training_items = split_validation(scan_family_images(blueprint, family), blueprint)[0]
    dataset = ImageDataset(blueprint, seed=args.seed, items=training_items)
    items = dataset.items[:max_items]
    check_family_takes(items, family.name, family.max_controls, family.min_controls, family.takes_layers)
    with contextlib.ExitStack() as held:
        if args.cache_latents_to_disk or args.cache_text_encoder_outputs_to_disk:
            hold_cache_folders(items, held)
        cache_latents(items, loaded_on_first_call(lambda: family.load_vae(torch.float32).encode),
                      family.latent_cache_key(), batch_size=args.vae_batch_size, to_disk=args.cache_latents_to_disk)
        options = family.text_options(args)
        precision = args.text_encoder_precision
        cache_text(items, loaded_on_first_call(lambda: family.load_text_encoder(precision, **options)),
                   family.text_cache_key(options, precision), to_disk=args.cache_text_encoder_outputs_to_disk,
                   with_references=family.text_sees_controls)
        data = []
        for i in range(len(items)):
            sample = dataset[dataset.entries.index(i)]
            text = {k: v[None] for k, v in sample["text"].items()}
            controls = [c[None] for c in sample["controls"]] if "controls" in sample else None
            data.append((sample["key"], sample["latents"][None], text, controls))
    return data


@torch.no_grad()
def predictions(family, model, data, sigmas, seed: int, guidance, position_bug: bool) -> tuple[list, float]:
    """Per (image, sigma): the prediction float32 [1, L, C]; and the mean flow-matching loss."""
    bug = precision.position_bug(precision.storage_dtype(model)) if position_bug else (lambda f: f)
    preds, losses = [], []
    with precision.patched_rope_tables(bug):
        for key, latents, text, control in data:
            _, _, lh, lw = latents.shape
            for s in sigmas:
                gen = torch.Generator().manual_seed(sample_seed(seed, -1, f"{key}@{s}"))  # fixed noise per image, sigma
                noise = torch.randn(latents.shape, generator=gen)
                sigma = torch.tensor([s], dtype=torch.float32)
                x_t = family.pack_target(fm.noisy_input(latents, noise, sigma))  # the tokens its predict takes
                pred = family.predict(model, x_t, sigma, text, lh // family.patch, lw // family.patch, guidance,
                                      **control_kwargs(control)).float()
                losses.append(fm.flow_loss(pred, family.pack_target(fm.flow_target(latents, noise))).item())
                preds.append(pred.cpu())
    return preds, sum(losses) / len(losses)


# ----------------------------------------------------------------------------------------------
# The matrix


def _norm(tensors) -> float:
    return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))


def _dot(tensors, others) -> float:
    return sum(float((t.double() * o.double()).sum()) for t, o in zip(tensors, others))


def cell_metrics(preds, base_preds, ref_preds, ref_base_preds, data, grid, patch: int) -> dict:
    """grid: the token grid (latent rows, columns // the family's patch) of the images the error maps are laid on."""
    effect = [p - b for p, b in zip(preds, base_preds)]
    ref_effect = [p - b for p, b in zip(ref_preds, ref_base_preds)]
    ref_size = _norm(ref_effect)
    same_grid = [i for i, (_, lat, *_) in enumerate(data) for _ in (0,)
                 if (lat.shape[-2] // patch, lat.shape[-1] // patch) == grid]
    per = len(preds) // len(data)
    chosen = [i * per + j for i in same_grid for j in range(per)]
    error_map = precision.token_error_map(torch.cat([preds[k] for k in chosen]), torch.cat([ref_preds[k] for k in chosen]), grid)
    ratios = precision.map_ratios(error_map) if float(error_map.max()) > 0 else {"border_centre_ratio": 1.0, "region_ratio": 1.0}
    return {
        "border_centre": ratios["border_centre_ratio"], "region_ratio": ratios["region_ratio"],
        "effect_kept": _dot(effect, ref_effect) / ref_size**2 if ref_size else float("nan"),
        "effect_error": _norm([e - r for e, r in zip(effect, ref_effect)]) / ref_size if ref_size else float("nan"),
        "map": error_map,
    }


def run_matrix(args, family, bases: Bases, loras: dict[str, str], columns, data, sigmas, seed: int,
               concept: Concept | None = None, log=print) -> tuple[list[dict], dict[str, float]]:
    """Every (trained on, deployed on) cell, and each base's concept rate without a LoRA (NaN without
    a concept). Models load one at a time."""
    guidance = args.guidance_scale
    nan = float("nan")
    base_preds, base_rates = {}, {}
    for base in sorted({base_of(d) for d in columns}):
        model = bases.load(base.removesuffix("+posbug"))
        base_preds[base], _ = predictions(family, model, data, sigmas, seed, guidance, base.endswith("+posbug"))
        base_rates[base] = concept.rate(model, seed, base.endswith("+posbug")) if concept else nan
        del model
    shapes = [tuple(lat.shape[-2:]) for _, lat, *_ in data]
    grid = max(set(shapes), key=shapes.count)
    grid = (grid[0] // family.patch, grid[1] // family.patch)  # the token grid the error maps are laid on
    rows = []
    for trained_on, path in loras.items():
        probe = bases.load("bf16")
        lora = read_lora_for(probe, family.arch, path)
        del probe
        cells = {}
        for deploy in columns:
            model = bases.load(deploy, lora, path)
            preds, loss = predictions(family, model, data, sigmas, seed, guidance, deploy.endswith("+posbug"))
            rate = concept.rate(model, seed, deploy.endswith("+posbug")) if concept else nan
            del model
            cells[deploy] = (preds, loss, rate)
        ref_preds = cells["bf16+lora"][0]
        for deploy, (preds, loss, rate) in cells.items():
            metrics = cell_metrics(preds, base_preds[base_of(deploy)], ref_preds, base_preds["bf16"], data, grid,
                                   family.patch)
            rows.append({"trained_on": trained_on, "deployed_on": deploy, "val_loss": loss, "concept_rate": rate, **metrics})
            log(f"{trained_on:>11} -> {deploy:<22} val_loss {loss:.5f}  border/centre {metrics['border_centre']:.2f}  "
                f"regions {metrics['region_ratio']:.2f}  effect kept {metrics['effect_kept']:.3f}"
                + (f"  concept {rate:.0%}" if concept else ""))
    return rows, base_rates


# ----------------------------------------------------------------------------------------------
# Output


COLUMNS = ("trained_on", "deployed_on", "val_loss", "concept_rate", "border_centre", "region_ratio", "effect_kept", "effect_error")


def write_outputs(rows: list[dict], out: str, title: str, base_rates: dict[str, float] | None = None) -> dict[str, str]:
    os.makedirs(out, exist_ok=True)
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(COLUMNS)
    for r in rows:
        writer.writerow([r[c] if isinstance(r[c], str) else f"{r[c]:.6g}" for c in COLUMNS])
    paths = {"csv": os.path.join(out, "matrix.csv"), "md": os.path.join(out, "matrix.md"), "png": os.path.join(out, "matrix.png")}
    write_text(paths["csv"], buffer.getvalue())
    write_text(paths["md"], markdown(rows, title, base_rates or {}))
    write_grid(rows, paths["png"], title)
    return paths


def markdown(rows: list[dict], title: str, base_rates: dict[str, float]) -> str:
    trained = list(dict.fromkeys(r["trained_on"] for r in rows))
    deployed = list(dict.fromkeys(r["deployed_on"] for r in rows))
    cell = {(r["trained_on"], r["deployed_on"]): r for r in rows}
    text = [f"# {title}", ""]
    metrics = [("val_loss", "flow-matching loss at fixed sigmas and noise", "{:.4g}")]
    if any(not math.isnan(r["concept_rate"]) for r in rows):
        metrics.append(("concept_rate", "trigger prompts rendered as the concept (shape detector)", "{:.0%}"))
    metrics += [("effect_kept", "share of the LoRA's effect (vs bf16) that survives, projected on it", "{:.4g}"),
                ("border_centre", "border/centre error ratio vs the same LoRA on bf16", "{:.4g}"),
                ("region_ratio", "max/min error of 4x4 regions vs the same LoRA on bf16", "{:.4g}")]
    for metric, what, form in metrics:
        text += [f"## {metric}: {what}", "", "| trained on \\ deployed on | " + " | ".join(deployed) + " |",
                 "|---" * (len(deployed) + 1) + "|"]
        text += [f"| {t} | " + " | ".join(form.format(cell[(t, d)][metric]) for d in deployed) + " |" for t in trained]
        if metric == "concept_rate":
            text += ["", "Without the LoRA: " + ", ".join(f"{b} {r:.0%}" for b, r in base_rates.items() if not math.isnan(r))]
        text.append("")
    return "\n".join(text)


def write_grid(rows: list[dict], path: str, title: str):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trained = list(dict.fromkeys(r["trained_on"] for r in rows))
    deployed = list(dict.fromkeys(r["deployed_on"] for r in rows))
    cell = {(r["trained_on"], r["deployed_on"]): r for r in rows}
    top = max(float(r["map"].max()) for r in rows) or 1.0
    fig, axes = plt.subplots(len(trained), len(deployed), figsize=(2.2 * len(deployed), 2.2 * len(trained)), squeeze=False)
    for i, t in enumerate(trained):
        for j, d in enumerate(deployed):
            ax = axes[i][j]
            ax.imshow(cell[(t, d)]["map"].numpy(), cmap="magma", vmin=0, vmax=top)
            ax.set_xticks([]), ax.set_yticks([])
            ax.set_title(f"loss {cell[(t, d)]['val_loss']:.4f}", fontsize=7)
            if j == 0:
                ax.set_ylabel(f"trained {t}", fontsize=8)
            if i == len(trained) - 1:
                ax.set_xlabel(d, fontsize=7)
    fig.suptitle(f"{title}: per-token error vs the same LoRA on bf16 (shared scale 0..{top:.3g})", fontsize=9)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# CLI


def resized_dataset(dataset_config: str, resolution: int, out: str) -> str:
    """A copy of the dataset TOML at another square resolution, buckets off (one grid for the maps)."""
    import toml

    data = toml.load(dataset_config)
    for table in [data.get("general", {})] + data.get("datasets", []):
        for key in ("resolution", "enable_bucket", "min_bucket_reso", "max_bucket_reso", "bucket_no_upscale"):
            table.pop(key, None)
    data.setdefault("general", {})["resolution"] = resolution
    path = os.path.join(out, f"dataset_{resolution}.toml")
    write_text(path, toml.dumps(data))
    return path


def check_computed(rows: list[str], columns: list[str], dtype: str, mixed_precision: str, config_file: str) -> None:
    """fp8_compute runs in bf16 only: its row trains with the config's mixed_precision, its column with --dtype."""
    if any(r in COMPUTED for r in rows) and mixed_precision != "bf16":
        raise ValueError(f"{config_file}: row fp8_compute trains with fp8_compute = true, which needs mixed_precision = "
                         f"\"bf16\" (got \"{mixed_precision}\"); train every row in bf16 for a fair comparison")
    computed = any(c.split("+")[0] in COMPUTED for c in rows + columns)
    if computed and dtype != "bf16":
        raise ValueError(f"fp8_compute computes in bf16: pass --dtype bf16 (got {dtype})")
    if computed and not fp8_gemm_available("cpu"):  # (the matrix's device)
        raise ValueError(f"fp8_compute: torch {torch.__version__} has no CPU fp8 GEMMs with per-row scales (2.13 has); "
                         f"drop the fp8_compute row and column")


def parse_sigmas(text: str) -> list[float]:
    """--sigmas: comma-separated noise levels in (0, 1] (1 = pure noise)."""
    try:
        sigmas = [float(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--sigmas {text!r}: expected numbers separated by commas, e.g. 0.1,0.5,0.9") from None
    if not sigmas or not all(0 < s <= 1 for s in sigmas):
        raise ValueError(f"--sigmas {text!r}: each must be in (0, 1]")
    return sigmas


def check_counts(cli) -> None:
    """--max_items, --steps, --resolution: at least 1 where given (0 evaluated nothing after every row had
    trained: a ZeroDivisionError; 0 steps or pixels silently meant the config's)."""
    for flag, value in (("--max_items", cli.max_items), ("--steps", cli.steps), ("--resolution", cli.resolution)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} {value}: expected at least 1")


def main(argv=None, log=print) -> int:
    try:
        cli = build_parser().parse_args(argv)
        check_out_folder("--out", cli.out, "the matrix and its rows' runs go there")  # NotADirectoryError's traceback
        check_counts(cli)  # before any row trains (hours at full size)
        overrides = ["--max_train_steps", str(cli.steps), "--max_train_epochs", "none"] if cli.steps else []
        base = load_config(["--config_file", cli.config_file])
        if base.model_type == "llm":  # before run_args' diffusion keys, which an llm config refuses
            raise ValueError(f"{cli.config_file}: model_type llm: the precision matrix is for the diffusion models")
        if cli.resolution:
            os.makedirs(cli.out, exist_ok=True)
            overrides += ["--dataset_config", resized_dataset(base.dataset_config, cli.resolution, cli.out)]
        args = load_config(run_args(cli.config_file, overrides))
        family = get_family(args)
        if family.takes_layers:  # its targets are frames: the per-token maps and the bases' loaders are of one image
            raise ValueError(f"{cli.config_file}: model_type {args.model_type} trains on layered targets; the "
                             f"precision matrix evaluates single-image models")
        refuse_stored_base(args.pretrained_model_name_or_path, f"{cli.config_file}: pretrained_model_name_or_path",
                           "every row and column would train and deploy on that one base")
        refuse_unevaluated_networks(args, cli.config_file)
        bad = [item for item in cli.loras.split(",") if item and "=" not in item]
        if bad:
            raise ValueError(f"--loras {bad[0]!r}: expected row=path (e.g. bf16=lora.safetensors), comma-separated")
        given = dict(item.split("=", 1) for item in cli.loras.split(",") if item)
        rows = [r for r in cli.rows.split(",") if r]
        if not rows:
            raise ValueError(f"--rows {cli.rows!r}: expected at least one of {', '.join(TRAINED_ON)}")
        unknown = [r for r in list(given) + rows if r not in TRAINED_ON]
        if unknown:
            raise ValueError(f"row {unknown[0]!r}: expected one of {', '.join(TRAINED_ON)}")
        columns = list(dict.fromkeys(["bf16+lora"] + [c for c in cli.columns.split(",") if c]))  # bf16+lora: the reference
        unknown = [c for c in columns if c not in DEPLOYABLE]
        if unknown:
            raise ValueError(f"column {unknown[0]!r}: expected one of {', '.join(DEPLOYABLE)}")
        check_computed(rows, columns, cli.dtype, args.mixed_precision, cli.config_file)
        sigmas = parse_sigmas(cli.sigmas)  # before any row trains (minutes)
        unused = [r for r in given if r not in rows]
        if unused:
            raise ValueError(f"--loras {unused[0]}=...: row {unused[0]!r} is not in --rows {cli.rows}; add it there")
        for path in given.values():  # headers only: not a LoRA, or another model's, is named before any row trains
            check_lora_arch(path, family.arch)
        concept_path = find_concept(cli.concept, base.dataset_config)
        concept = Concept(concept_path, family) if concept_path else None  # read and checked before any row trains
        os.makedirs(cli.out, exist_ok=True)  # once the settings are checked: a refused run leaves no folder behind
        bases = Bases(args.pretrained_model_name_or_path, family.arch, getattr(torch, DTYPES[cli.dtype]), cli.out, cli.seed)
        loras = {r: given.get(r) or train_row(r, cli.config_file, cli.out, overrides, bases) for r in rows}
        data = eval_data(args, family, cli.max_items)
        result, base_rates = run_matrix(args, family, bases, loras, columns, data, sigmas, cli.seed, concept, log=log)
        title = (f"{family.name} {os.path.basename(args.pretrained_model_name_or_path)}, {len(data)} images, sigmas {cli.sigmas}, "
                 f"{cli.dtype} compute" + (f", concept {concept.name} ({len(concept.prompts)} trigger prompts)" if concept else ""))
        paths = write_outputs(result, cli.out, title, base_rates)
        log(f"written: {', '.join(paths.values())}")
        return 0
    except (ValueError, ConfigError, CheckpointError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    exit_without_collecting(main)
