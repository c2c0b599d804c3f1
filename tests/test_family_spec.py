"""What every registered family's spec (library/models/<folder>/spec.py) must give, checked the same
way for each, so that a new family's folder is complete when these pass: the parts are there and
resolve, its fp8 rules name modules its model has, its blocks cover the model (compile, block swap),
its sampling method and config keys reach the schema, and the precision doctor drives its tiny model
through the spec alone."""

import dataclasses
import importlib
import os
import re
import uuid

import pytest
import torch
import torch.nn as nn

from library.models import core
from library.models import flow_matching as fm
from library.models.registry import FAMILIES, SAMPLING_METHODS, arch_specs, family_folder, spec_of
from library.models.spec import ConfigKey, load_symbol

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIFFUSION_ARCHS = sorted({spec_of(m).arch for m in FAMILIES})


def released_models_on_meta(arch: str) -> list[nn.Module]:
    """The architecture's planner presets (its released configs), each built on meta: no weight is made."""
    planner = arch_specs()[arch].planner
    configs = {p.transformer: load_symbol(p.transformer) for p in planner.presets.values()}
    with torch.device("meta"):
        return [load_symbol(planner.transformer)(c) for c in configs.values()]


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_family_spec_has_every_part_and_each_resolves(model_type):
    spec = spec_of(model_type)
    for part in ("lora", "lora_files", "fp8", "sampling", "transformer", "planner", "tiny", "modelspec"):
        assert getattr(spec, part) is not None, f"{spec.arch}'s spec.py gives no {part}"
    assert os.path.isfile(os.path.join(ROOT, "configs", spec.default_config)), spec.default_config
    for path in (spec.transformer.load, spec.transformer.random_inputs, spec.planner.transformer, *spec.tiny.writers):
        assert callable(load_symbol(path)), path
    assert spec.tiny.transformer, f"{spec.arch}: TinySpec.transformer names no manifest key"
    assert all(isinstance(k, ConfigKey) for k in spec.config_keys)


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_a_family_reads_a_vae_file_unless_its_wrapper_takes_the_pixels(model_type):
    """vae_file (the config key `ae` required, its file keying the latent cache) is False exactly where the
    family's VAE wrapper is the pixel pass-through, which reads no file: else a run asks for a file it never
    reads, or loads a VAE from None."""
    from library.models.family import family_class
    from library.models.vae import PixelVAE

    cls = family_class(model_type)
    assert cls.vae_file != issubclass(load_symbol(cls.vae), PixelVAE), f"{model_type}: vae_file {cls.vae_file}"


def _releases() -> dict[str, dict[str, str]]:
    """model_type -> {every release its family's model_version writes (ss_base_model_version): the
    modelspec.architecture its LoRAs carry}. The peers' strings (sd-scripts' and musubi-tuner's
    sai_model_spec) where one trains that model, else ours in their style (each spec's comment says which)."""
    from library.models.krea2.family import RAW, TURBO as KREA2_TURBO
    from library.models.qwen_image.edit import EDIT, EDIT_2509, EDIT_2511
    from library.models.zimage.family import BASE, TURBO
    from library.models.zimage.omni_family import OMNI

    return {
        "flux": {"flux1-dev": "flux-1-dev/lora", "flux1-schnell": "flux-1-schnell/lora"},  # sd-scripts
        "flux_kontext": {"flux1-kontext-dev": "Flux.1-dev/lora"},  # musubi-tuner (its Kontext)
        "chroma": {"chroma": "chroma/lora"},  # sd-scripts
        "flux3": {"flux3": "Flux.3/lora", "flux3-distilled": "Flux.3/lora"},  # ours (no peer trains FLUX.3 yet)
        "flux2": {"flux2-dev": "Flux.2-dev/lora", "flux2-klein-4b": "Flux.2-klein-4b/lora",  # musubi-tuner
                  "flux2-klein-9b": "Flux.2-klein-9b/lora", "flux2-klein": "Flux.2-klein/lora"},  # (ours: other widths)
        "qwen_image": {"qwen-image": "Qwen-Image/lora"},  # musubi-tuner, as the rest of the line but 2.1
        "qwen_image_edit": {EDIT: "Qwen-Image-Edit/lora", EDIT_2509: "Qwen-Image-Edit-Plus/lora",
                            EDIT_2511: "Qwen-Image-Edit-2511/lora"},
        "qwen_image_layered": {"qwen-image-layered": "Qwen-Image-Layered/lora"},
        "qwen_image21": {"qwen-image-2.1": "Qwen-Image-2.1/lora"},  # ours
        "zimage": {TURBO: "Z-Image/lora", BASE: "Z-Image/lora"},  # musubi-tuner
        "zimage_omni": {OMNI: "Z-Image-Omni/lora"},  # ours
        "krea2": {RAW: "Krea-2/lora", KREA2_TURBO: "Krea-2/lora"},  # musubi-tuner
        "krea2_edit": {f"{RAW}-edit": "Krea-2-Edit/lora", f"{KREA2_TURBO}-edit-kv_cache": "Krea-2-Edit/lora"},  # ours
        "ideogram4": {"ideogram4": "Ideogram-4/lora"},  # musubi-tuner
        "ernie_image": {"ernie-image": "ERNIE-Image/lora"},  # ours (ai-toolkit, which trains it, writes no modelspec)
        "nucleus_image": {"nucleus-image": "nucleus-image/lora"},  # ours (ai-toolkit, which trains it, writes none)
        "anima": {"anima": "anima-preview/lora"},  # sd-scripts' (ARCH_ANIMA_PREVIEW; ai-toolkit writes none)
        "lumina2": {"lumina2": "lumina-2/lora"},  # sd-scripts' (ARCH_LUMINA_2)
        "hunyuan_image": {"hunyuan-image-2.1": "hunyuan-image-2.1/lora"},  # sd-scripts' (ARCH_HUNYUAN_IMAGE_2_1)
        "sd3": {"sd3-medium": "stable-diffusion-3-medium/lora", "sd3.5-medium": "stable-diffusion-3-5-medium/lora",
                "sd3.5-large": "stable-diffusion-3-5-large/lora"},  # sd-scripts' (ARCH_SD3_M + its model_type)
        "hidream": {r: "hidream-i1/lora" for r in ("hidream-i1-full", "hidream-i1-dev", "hidream-i1-fast")},  # ours
        "hidream_o1": {"hidream-o1-full": "HiDream-O1-Image/lora",  # musubi-tuner
                       "hidream-o1-dev": "HiDream-O1-Image/lora"},
    }


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_family_names_each_of_its_releases_in_modelspec_as_the_peers_do(model_type):
    """A trained LoRA's header carried no modelspec.* keys (sd-scripts and musubi-tuner write them; SwarmUI and
    LoRA managers tell a LoRA's model by modelspec.architecture). Each release a registered family trains names
    its ModelSpec architecture and implementation through its own spec, and our readers take that name back as
    the family's architecture."""
    from networks.lora_arch import header_arch
    from networks.lora_files import modelspec_fields

    releases = _releases()
    assert model_type in releases, f"{model_type}: list the releases its model_version writes in _releases()"
    spec = spec_of(model_type)
    for release, written in releases[model_type].items():
        names = spec.modelspec_of(release)
        assert names is not None, f"{model_type}: its spec's modelspec names no release {release!r}"
        fields = modelspec_fields(names, "run", "1024x768", 0.0)
        assert fields["modelspec_architecture"] == written, release
        assert fields["modelspec_implementation"].startswith("https://"), release
        assert header_arch({"modelspec.architecture": written}) == spec.arch, written


@pytest.mark.parametrize("arch", DIFFUSION_ARCHS)
def test_fp8_rules_name_linears_the_released_model_has(arch):
    """A keep rule that matches nothing (a renamed module) would silently quantize an embedder."""
    rules = arch_specs()[arch].fp8
    linears = {n for model in released_models_on_meta(arch) for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    for pattern in (*rules.keep, *rules.modulation):
        assert any(re.fullmatch(pattern, n) for n in linears), f"{arch}: fp8 rule {pattern!r} matches no Linear"


@pytest.mark.parametrize("arch", DIFFUSION_ARCHS)
def test_lora_targets_name_modules_the_released_model_has(arch):
    """A target that matches nothing (a renamed module, a typo) drops its whole type from every LoRA without a
    word; each module counts for the first target it matches, as networks/lora.py selects."""
    from networks.lora_packed import packed_targets

    targets = arch_specs()[arch].lora.targets
    found = set()
    for model in released_models_on_meta(arch):
        for name, _ in [*model.named_modules(), *packed_targets(model)]:  # packed weights by parameter path
            found.update(next(([t] for t, pattern in targets.items() if re.fullmatch(pattern, name)), []))
    for mtype, pattern in targets.items():
        assert mtype in found, f"{family_folder(arch).replace('.', '/')}/spec.py: lora.targets[{mtype!r}] {pattern!r} matches no module"


@pytest.mark.parametrize("arch", DIFFUSION_ARCHS)
def test_swappable_blocks_are_every_repeated_block(arch):
    """compile, block swap and FSDP take the model's swappable_blocks(): every block list is in it."""
    for model in released_models_on_meta(arch):
        listed = {id(b) for b in model.swappable_blocks()}
        for name, child in model.named_children():
            # a list of single projections (HiDream-I1's per-block caption projections) is no block list
            if isinstance(child, nn.ModuleList) and not all(len(list(b.modules())) <= 2 for b in child):
                assert all(id(b) in listed for b in child), f"{arch}: {name} is missing from swappable_blocks()"


def test_compile_compiles_every_block_the_model_lists():
    from library.training.diffusion_task import DiffusionTask

    model = released_models_on_meta(DIFFUSION_ARCHS[0])[0]
    DiffusionTask._compile_blocks(type("Task", (), {"base": model})())
    assert all(b._compiled_call_impl is not None and b._compiled_checkpoints[core.Checkpointing()] is not None
               for b in model.swappable_blocks())


def test_sampling_methods_are_the_generic_draws_and_each_specs_own():
    own = [s.sampling.method for s in arch_specs().values() if s.sampling]
    assert SAMPLING_METHODS == ("uniform", "sigmoid", "shift", "logsnr", "mode", *dict.fromkeys(own), "qinglong")
    for method in set(own):  # architectures that share a method name share its constants
        shifts = {(s.sampling.mu, s.sampling.train_mu_steps, s.sampling.shift, s.sampling.train_shift)
                  for s in arch_specs().values()
                  if s.sampling and s.sampling.method == method}
        assert len(shifts) == 1, f"timestep_sampling {method!r} has several constants: {shifts}"
    for arch in DIFFUSION_ARCHS:  # a spec's method draws with its own mu
        sigmas = fm.sample_sigmas(4, arch_specs()[arch].sampling.method, generator=torch.Generator().manual_seed(0),
                                  image_seq_len=1024)
        base = fm.sample_sigmas(4, "sigmoid", generator=torch.Generator().manual_seed(0))
        mu = fm.resolution_mu(arch_specs()[arch].sampling, 1024)
        torch.testing.assert_close(sigmas, fm.time_shift(mu, base), rtol=0, atol=0)


def test_inference_sigmas_of_an_architecture_without_a_schedule_is_one_line():
    with pytest.raises(ValueError, match="no flow-matching schedule for 'llm'"):
        fm.inference_sigmas(4, 256, "llm")


def test_every_family_config_key_is_in_the_schema_and_shared_keys_join(monkeypatch):
    from library.training import config_schema

    for spec in arch_specs().values():
        for key in spec.config_keys:
            assert key.key in config_schema.SCHEMA and spec.title in config_schema.SCHEMA[key.key].help
    a = dataclasses.replace(arch_specs()["llm"], arch="a", title="A", config_keys=(ConfigKey("text_encoder", str, "one"),))
    b = dataclasses.replace(a, arch="b", title="B", config_keys=(ConfigKey("text_encoder", str, "two"),))
    monkeypatch.setattr(config_schema, "arch_specs", lambda: {"a": a, "b": b})
    assert config_schema.family_keys()["text_encoder"].help == "A: one; B: two"
    c = dataclasses.replace(a, arch="c", config_keys=(ConfigKey("text_encoder", int, "three"),))
    monkeypatch.setattr(config_schema, "arch_specs", lambda: {"a": a, "c": c})
    with pytest.raises(TypeError, match="'text_encoder': c declares it with another type"):
        config_schema.family_keys()


def skipped_blocks(arch: str) -> set[str]:
    """Blocks that random_inputs' forward does not run: FLUX.3's reference-mode blocks (no references given)."""
    return {f"content_mode_blocks.image_cond.{i}" for i in range(8)} if arch == "flux3" else set()


@pytest.mark.parametrize("arch", DIFFUSION_ARCHS)
def test_the_precision_doctor_drives_each_tiny_transformer_through_the_spec(arch, tiny_set):
    """tools/precision_doctor.py knows an architecture only by its spec: load its tiny transformer
    with transformer.load, make random_inputs, run one forward in float32, every block probed (the report's rows
    named FLUX's and Qwen-Image's blocks only: Z-Image's, Krea 2's, Ideogram 4's ... had none)."""
    from library.models.precision_doctor import LayerProbe
    from tools import precision_doctor as doctor

    spec = arch_specs()[arch]
    model = doctor.disk_variant(tiny_set[spec.tiny.transformer], arch, "fp32")
    inputs = doctor.make_inputs(arch, model.config, 64, 48, seed=0, text_len=8)
    probe = LayerProbe(model)  # the report's per-block rows: each of the model's blocks is hooked and seen
    try:
        out = model(**inputs.make_kwargs(0.5))
    finally:
        probe.remove()
    assert out.shape == (1, 4 * 3, doctor.token_width(model.config)) and torch.isfinite(out).all()
    assert inputs.positions.shape[-1] == len(inputs.axes_dim)
    blocks = {id(b) for b in model.swappable_blocks()}
    ran = {name for name, m in model.named_modules() if id(m) in blocks} - skipped_blocks(arch)
    assert ran and ran <= set(probe.order), sorted(ran - set(probe.order))


VARIANT_FILES = ("qwen_image_edit", "qwen_image_layered")  # a variant whose tiny file is its own (other flags)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_doctors_expected_positions_are_the_ones_each_tiny_model_uses(model_type, tiny_set):
    """The doctor's verdict reads its position audit first: the positions random_inputs expects must be the ones
    the model computes, or a correct model reads POSITION DAMAGE (Qwen-Image-Layered's layer-3D ids: 64 of them
    'changed'; its random inputs also lacked additional_t_cond, a crash before any report)."""
    from library.models import precision_doctor as precision
    from library.models.family import lora_arch
    from library.precision.stored_layouts import refuse_stored_base
    from tools import precision_doctor as doctor

    arch = lora_arch(model_type)
    path = tiny_set.get(model_type) if model_type in VARIANT_FILES else tiny_set[arch_specs()[arch].tiny.transformer]
    if path is None:
        pytest.skip(f"{model_type}: its tiny transformer is its base family's")
    try:  # a pre-quantized tiny file (Ideogram 4's nvfp4): the doctor refuses it, as tools/precision_doctor.py
        refuse_stored_base(path, "--model", "the doctor compares nothing")
    except ValueError as e:
        pytest.skip(str(e))
    model = doctor.disk_variant(path, arch, "fp32")
    # (a grid whose token count no text run shares: the audit matches calls to the inputs by shape)
    inputs = doctor.make_inputs(arch, model.config, 128, 96, seed=0, text_len=8)
    audit = precision.PositionAudit(inputs.positions, inputs.axes_dim, inputs.theta)
    with torch.no_grad(), precision.patched_rope_tables(audit.wrap):
        model(**inputs.make_kwargs(0.5))
    summary = audit.summary()
    assert summary["calls"] and summary.get("matches_inputs"), summary
    assert summary["positions_changed"] == 0 and summary["table_max_abs_diff"] < 1e-4, summary


def test_the_specs_stored_fp8_layouts_are_the_ones_the_loaders_read():
    """spec.py stays torch-free, so it spells fp8.MODES again as STORED_FP8: the two must not drift; and
    each family's FP8Rules.stored names only those layouts."""
    from library.models import spec as S
    from library.precision import fp8

    assert S.STORED_FP8 == fp8.MODES
    for arch, spec in arch_specs().items():
        assert all(set(layouts) <= set(fp8.MODES) for layouts in spec.fp8.stored.values()), arch


# A folder registered beside the others: spec.py copies the first family's spec as arch "toy" without its planner
# presets (their names are the first family's), with one change; family.py subclasses the first family's adapter.
TOY_SPEC = """import dataclasses
from library.models import spec as S
from library.models.registry import FAMILIES, spec_of
BASE = spec_of(next(iter(FAMILIES)))
SPEC = {}
"""
TOY_BASE = 'dataclasses.replace(BASE, **{{"arch": "toy", "planner": dataclasses.replace(BASE.planner, presets={{}}), **dict({})}})'
TOY_FAMILY = """from library.models.family import family_class
from library.models.registry import FAMILIES
class ToyFamily(family_class(next(iter(FAMILIES)))):
    {}
"""


def register_toy(monkeypatch, tmp_path, spec: str, family: str = 'name = "toy"') -> str:
    """A folder with that SPEC expression and ToyFamily body, registered as model_type toy: its package path."""
    package = f"toy_{uuid.uuid4().hex[:8]}"  # a fresh module per test: imports are cached
    os.makedirs(tmp_path / package)
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "spec.py").write_text(TOY_SPEC.format(spec))
    (tmp_path / package / "family.py").write_text(TOY_FAMILY.format(family))
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    monkeypatch.setitem(FAMILIES, "toy", f"{package}.family:ToyFamily")
    return package


@pytest.mark.parametrize("change, message", [
    # the first family's arch / a preset name of it: the first family's spec or preset was replaced by the toy's
    ('arch=BASE.arch', "spec.py: arch {base.arch!r} is already {base_file}'s"),
    ('planner=BASE.planner', "spec.py: planner preset {preset!r} is already {base_file}'s"),
    # an arch no model_type of the folder is: the adapter found no spec by its name
    ('arch="toy_img"', "spec.py: arch 'toy_img' is no model_type this folder registers in registry.FAMILIES (toy)"),
    ('lora_files=None', "spec.py: SPEC gives no lora_files"),
    ('fp8=None', "spec.py: SPEC gives no fp8"),
    # a plain tuple for a MuLine crashed the end-of-run samples, after training
    ('sampling=dataclasses.replace(BASE.sampling, mu=(256, 4096, 0.5, 1.15))',
     "spec.py: SPEC.sampling.mu: expected MuLine | str | None, got (256, 4096, 0.5, 1.15)"),
    ('fp8=S.FP8Rules(keep=r"img_in")', "spec.py: SPEC.fp8.keep: expected tuple[str, ...], got 'img_in'"),
    ('modelspec=None', "spec.py: SPEC gives no modelspec"),  # its LoRAs would carry no ModelSpec keys
    ('modelspec={"toy": ("Toy", "https://example.com")}',
     "spec.py: SPEC.modelspec['toy']: expected ModelSpecNames, got ('Toy', 'https://example.com')"),
])
def test_a_spec_mistake_is_one_line_at_registration_naming_the_file_and_field(monkeypatch, tmp_path, change, message):
    base = spec_of(next(iter(FAMILIES)))
    base_file = family_folder(next(iter(FAMILIES))).replace(".", "/") + "/spec.py"
    message = message.format(base=base, base_file=base_file, preset=next(iter(base.planner.presets)))
    package = register_toy(monkeypatch, tmp_path, TOY_BASE.format(change))
    with pytest.raises(ValueError) as error:
        arch_specs()
    assert str(error.value).startswith(f"{package}/spec.py: ") and message in str(error.value), str(error.value)
    assert "\n" not in str(error.value)


def test_a_spec_without_arch_is_one_line_naming_the_file(monkeypatch, tmp_path):
    package = register_toy(monkeypatch, tmp_path, 'S.ArchSpec(title="Toy")')
    with pytest.raises(ValueError, match=re.escape(f"{package}/spec.py: ArchSpec.__init__() missing 1 required "
                                                   "positional argument: 'arch'")):
        arch_specs()


@pytest.mark.parametrize("body, message", [
    ('name = "toy_img"', "ToyFamily.name is 'toy_img', registered in registry.FAMILIES as 'toy'"),
    ('name = "toy"\n    arch = "toy_img"', "ToyFamily.arch is 'toy_img', its folder's spec.py says arch 'toy'"),
])
def test_an_adapter_whose_name_or_arch_is_not_its_registration_is_one_line(monkeypatch, tmp_path, body, message):
    from library.models.family import family_class

    package = register_toy(monkeypatch, tmp_path, TOY_BASE.format(""), body)
    assert set(arch_specs()) >= {"toy"}  # the spec itself registers
    with pytest.raises(ValueError, match=re.escape(f"{package}/family.py: {message}")):
        family_class("toy")


def test_families_whose_text_encoders_take_turns_load_them_one_at_a_time():
    """text_encoders_take_turns: train_lora.py passes load_text_encoder one_at_a_time=True on a card that cannot hold
    the encoders together (memory_plan.text_encoders_one_at_a_time); a family that says so takes the argument, and
    one that takes it says so (else the planner plans them together while they take turns, or the reverse)."""
    import inspect

    from library.models.family import family_class

    for model_type in FAMILIES:
        cls = family_class(model_type)
        takes = "one_at_a_time" in inspect.signature(cls.load_text_encoder).parameters
        assert takes == cls.text_encoders_take_turns, model_type


def test_a_spec_replaced_after_the_specs_were_checked_is_checked_again(monkeypatch):
    """arch_specs keeps the specs it checked while the registration and the spec objects are the same ones; a spec
    module's SPEC replaced since (here by one claiming FLUX.1's arch) is checked again, not served from before."""
    from library.errors import SpecError

    assert "sd3" in arch_specs()  # checked and kept
    module = importlib.import_module(family_folder("sd3") + ".spec")
    monkeypatch.setattr(module, "SPEC", dataclasses.replace(module.SPEC, arch="flux"))
    with pytest.raises(SpecError, match="arch 'flux' is already library/models/flux1/spec.py's"):
        arch_specs()
    monkeypatch.undo()
    assert arch_specs()["sd3"].arch == "sd3"
