"""The memory planner's checkpoint-keeping keys (checkpoint_saves_attention / _projections): unset keys
turn on where the planned step fits the card (memory_plan.settle_keeping_keys), on every dataset's
largest step, before caching."""


import pytest
import torch
from library.data.image_folders import LargestStep
from tests.test_memory_plan import tiny_flux


def _planned_peaks(monkeypatch, peaks: dict):
    """memory_plan.training_plan answering from `peaks`: {(saves attention, saves projections): bytes}."""
    from library.training import memory_plan

    class Plan:
        def __init__(self, peak):
            self.peak = peak

        def phase(self, blocks_to_swap=0):
            return self

    monkeypatch.setattr(memory_plan, "training_plan", lambda family, args, *rest: Plan(peaks[(
        bool(args.checkpoint_saves_attention), bool(args.checkpoint_saves_projections))]))


GIB = 2**30
KEPT_PEAKS = {(False, False): 10 * GIB, (True, False): 11 * GIB, (False, True): 12 * GIB, (True, True): 13 * GIB}


def test_unset_checkpoint_keeping_keys_turn_on_where_the_planned_step_fits_the_card(tiny_set, monkeypatch):
    """checkpoint_saves_attention / _projections left unset (the default): with gradient checkpointing,
    each turns on where the step planned with it fits the card with 5% to spare, attention first, else
    off, one line saying which; keys set stay as set, and without checkpointing unset means off."""
    import copy

    from library.training.memory_plan import CUDA_CONTEXT_BYTES, KEEPING_MARGIN, settle_keeping_keys
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    args.gradient_checkpointing = True
    assert args.checkpoint_saves_attention is None and args.checkpoint_saves_projections is None  # the default
    _planned_peaks(monkeypatch, KEPT_PEAKS)
    card = lambda peak: CUDA_CONTEXT_BYTES + peak * KEEPING_MARGIN / 0.95 + 1  # noqa: E731  just fits

    roomy = copy.copy(args)
    said = settle_keeping_keys(family, roomy, card(13 * GIB), LargestStep(64, 64, 1, 0))
    assert roomy.checkpoint_saves_attention is True and roomy.checkpoint_saves_projections is True
    assert said.startswith(f"gradient checkpointing on this {card(13 * GIB) / GIB:.1f} GiB card: "
                           f"checkpoint_saves_attention on (+1.00 GiB, the step planned at 11.00 GiB of "), said
    assert "checkpoint_saves_projections on (+2.00 GiB, the step planned at 13.00 GiB" in said, said

    tight = copy.copy(args)
    said = settle_keeping_keys(family, tight, card(12.5 * GIB), LargestStep(64, 64, 1, 0))
    assert tight.checkpoint_saves_attention is True and tight.checkpoint_saves_projections is False
    assert "checkpoint_saves_projections off (+2.00 GiB, the step planned at 13.00 GiB: over 12.50" in said, said
    assert said.endswith("less 5%); set a key true or false to choose"), said

    chosen = copy.copy(args)
    chosen.checkpoint_saves_attention = False  # set: stays, and only the unset key is planned
    said = settle_keeping_keys(family, chosen, card(13 * GIB), LargestStep(64, 64, 1, 0))
    assert "checkpoint_saves_attention" not in said
    assert chosen.checkpoint_saves_attention is False and chosen.checkpoint_saves_projections is True

    off = copy.copy(args)
    off.gradient_checkpointing = False
    assert settle_keeping_keys(family, off, card(13 * GIB), LargestStep(64, 64, 1, 0)) is None
    assert off.checkpoint_saves_attention is False and off.checkpoint_saves_projections is False


def test_unset_keeping_keys_are_off_on_the_cpu_without_a_plan(monkeypatch):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from library.training import memory_plan
    from library.training.diffusion_task import DiffusionTask

    monkeypatch.setattr(memory_plan, "settle_keeping_keys", None)  # never planned: no card
    task = SimpleNamespace(args=SimpleNamespace(checkpoint_saves_attention=None, checkpoint_saves_projections=True,
                                               checkpoint_saves_dequantized=False, gradient_checkpointing=True),
                           accelerator=SimpleNamespace(distributed_type=DistributedType.NO), device=torch.device("cpu"))
    DiffusionTask._settle_keeping_keys(task)
    assert task.args.checkpoint_saves_attention is False and task.args.checkpoint_saves_projections is True


def test_the_keeping_keys_are_planned_for_the_largest_step_of_all_datasets(tmp_path, monkeypatch):
    """The trainer plans the keeping keys for the step tools/plan_memory.py plans (image_folders.largest_step):
    the largest resolution by area, the largest batch, the most references and the largest reference image by
    area (an edit family may encode it at its own size), each from any dataset."""
    from types import SimpleNamespace

    from PIL import Image
    from accelerate.utils import DistributedType

    from library.data.dataset_config import parse_dataset_config
    from library.data.image_folders import largest_step
    from library.training import memory_plan
    from library.training.diffusion_task import DiffusionTask

    for folder, names in (("plain", ["a"]), ("edit", ["b"]), ("refs", ["b_0", "b_1"])):
        (tmp_path / folder).mkdir()
        for name in names:
            Image.new("RGB", (96, 48) if name == "b_1" else (64, 64)).save(tmp_path / folder / f"{name}.png")
    blueprint = parse_dataset_config({"datasets": [
        {"resolution": 512, "batch_size": 4, "subsets": [{"image_dir": str(tmp_path / "plain")}]},
        {"resolution": [768, 640], "batch_size": 1,
         "subsets": [{"image_dir": str(tmp_path / "edit"), "control_directory": str(tmp_path / "refs")}]}]})
    assert largest_step(blueprint) == (768, 640, 4, 2, (96, 48), None)
    # A bucketed resolution off the 16-pixel grid is an area: the plans sized 72 x 72 (9 x 9 latents, which no
    # latent packs: train_lora stopped on a card, plan_memory failed) until 2026-11-27; its largest bucket now.
    off_grid = parse_dataset_config({"datasets": [{"resolution": 72, "enable_bucket": True, "bucket_reso_steps": 16,
                                                   "min_bucket_reso": 16,
                                                   "max_bucket_reso": 320, "subsets": [{"image_dir": str(tmp_path / "plain")}]}]})
    assert largest_step(off_grid)[:2] == (80, 64)  # of the buckets of the largest area under 72 x 72, the squarest

    planned = []
    monkeypatch.setattr(memory_plan, "device_memory", lambda device: 80 * GIB)
    monkeypatch.setattr(memory_plan, "settle_keeping_keys", lambda family, args, card, step: planned.append(step))
    task = SimpleNamespace(args=SimpleNamespace(checkpoint_saves_attention=None, checkpoint_saves_projections=None,
                                               gradient_checkpointing=True), blueprint=blueprint, family=None,
                           accelerator=SimpleNamespace(distributed_type=DistributedType.NO), device=torch.device("cuda"))
    DiffusionTask._settle_keeping_keys(task)
    assert planned == [(768, 640, 4, 2, (96, 48), None)]


def test_plan_memory_with_its_overrides_reads_no_reference_folder(tmp_path, monkeypatch):
    """plan_memory's --references, --resolution and --batch_size replace the dataset's largest step. With
    --references the control_directory was read all the same (largest_step counted them first): a config
    whose references were not made yet failed ("no reference image in control_directory") where it planned
    before. Now the count given is planned and the folders are not read."""
    from types import SimpleNamespace

    from PIL import Image

    from library.data import dataset_config
    from library.data.dataset_config import parse_dataset_config
    from library.models import family
    from library.training import config, diffusion_checks
    from tools import plan_memory

    for folder in ("edit", "refs"):
        (tmp_path / folder).mkdir()
    Image.new("RGB", (64, 64)).save(tmp_path / "edit" / "a.png")  # its reference (refs/a.png) not made yet
    blueprint = parse_dataset_config({"datasets": [
        {"resolution": [768, 640], "batch_size": 4,
         "subsets": [{"image_dir": str(tmp_path / "edit"), "control_directory": str(tmp_path / "refs")}]}]})
    monkeypatch.setattr(config, "load_config", lambda argv: SimpleNamespace(dataset_config="run.toml", blocks_to_swap=0))
    monkeypatch.setattr(dataset_config, "load_dataset_config", lambda path: blueprint)
    monkeypatch.setattr(family, "get_family", lambda run: SimpleNamespace(
        name="edit", arch="edit", min_controls=1, max_controls=3, check_model_files=lambda: None, stored_layout=lambda: None))
    # a stub run: no network, no checkpoint
    monkeypatch.setattr(diffusion_checks, "check_before_caching", lambda *args: (None, None))

    def planned(*argv):
        _, _, step = plan_memory.what_to_plan(plan_memory.build_parser().parse_args(["--config_file", "run.toml", *argv]))
        return (step.width, step.height), step.batch, step.references

    assert planned("--references", "2") == ((768, 640), 4, 2)
    assert planned("--references", "3", "--resolution", "512", "--batch_size", "1") == ((512, 512), 1, 3)
    with pytest.raises(ValueError, match="no reference image in control_directory"):
        planned()  # the dataset's own count is read from its folders


def test_train_lora_settles_the_keeping_keys_before_caching_on_a_card(tiny_set, tmp_path, capsys, monkeypatch):
    import train_lora
    from library.models import core
    from library.training import diffusion_task, memory_plan
    from tests.test_train_lora import flux_args

    kept, caching = [], diffusion_task.DiffusionTask._fill_caches
    build = diffusion_task.LoRALoss
    monkeypatch.setattr(diffusion_task, "LoRALoss", lambda family, base, *rest: kept.append(
        base.gradient_checkpointing) or build(family, base, *rest))
    monkeypatch.setattr(diffusion_task.DiffusionTask, "_fill_caches", lambda self: kept.append(
        (self.args.checkpoint_saves_attention, self.args.checkpoint_saves_projections)) or caching(self))
    _planned_peaks(monkeypatch, KEPT_PEAKS)
    monkeypatch.setattr(memory_plan, "device_memory", lambda device: 80 * GIB)
    assert train_lora.main(flux_args(tiny_set, tmp_path, "--max_train_steps", "1", "--gradient_checkpointing", "true")) == 0
    assert kept == [(True, True), core.Checkpointing(True, True)], kept  # settled before caching, then built
    lines = [line for line in capsys.readouterr().out.splitlines() if "gradient checkpointing on this" in line]
    assert len(lines) == 1 and "checkpoint_saves_attention on (+1.00 GiB" in lines[0], lines
