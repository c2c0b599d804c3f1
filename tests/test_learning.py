"""The first tests that check learning, not parity: a LoRA trained by train_lora.py on each learned tiny
base (learned/<model_type>, tools/pretrain_tiny_base.py) teaches it a concept it never saw, "zxq" = a
purple star, as the pixel-space detector reads the renders; and the same training with the flow
target's sign flipped (a broken objective) does not."""

import os
import weakref

import pytest
import torch

import networks.factory
import tools.concept_demo
import train_lora
from library.models import flow_matching
from tools.concept_demo import concept_demo
from tools.learned_base import learned_families, learned_paths, learned_spec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Fast settings per family (spec.LearnedBase.learning_test; each family's learned.py says what it measured): AdamW at
# 3e-3 on the bf16 (fp32-compute) base, rank 8, batch 8 (concept + reg images, make_tiny_dataset's concept set), each
# family's quickstart otherwise: (steps, share of the trigger prompts rendered with the concept after training, share
# of the unrelated prompts the base renders right still right with the LoRA). LearnedBase.before_at_most: the share
# of the trigger prompts the base may render as a purple star before the LoRA (by chance: it never saw purple or a
# star).

# Every family with a learned base: its files ship in learned/ (a missing one fails, it is not skipped).
BASES = learned_families()


@pytest.fixture(scope="module")
def concept_set(tmp_path_factory):
    from tools.make_tiny_dataset import make_concept_dataset

    return make_concept_dataset(str(tmp_path_factory.mktemp("concept")), count=10)


@pytest.fixture(scope="module")
def base_renders() -> dict:
    """concept_demo's renders (and scores) of a base without the LoRA, kept for the module's other
    tests: they depend only on the base (its files and precision), the concept set's prompts and the
    seed, the same in every test here. A family's flipped-target test reuses those its first test made
    instead of rendering the same base again."""
    return {}


@pytest.fixture
def each_base_rendered_once(monkeypatch, base_renders):
    """Patches concept_demo to take a render of the base without a LoRA from base_renders (keyed by the
    family, the base's dtypes and the seed: the rest is the module's), rendering it the first time. A
    model a LoRA was read onto (network_from_file) is always rendered."""
    render_and_score, read_lora = tools.concept_demo.render_and_score, networks.factory.network_from_file
    with_lora = weakref.WeakSet()

    def network_from_file(model, *args, **kwargs):
        with_lora.add(model)
        return read_lora(model, *args, **kwargs)

    def render_and_score_once(family, model, vae, text, wanted, seed):
        if model in with_lora:
            return render_and_score(family, model, vae, text, wanted, seed)
        key = (family.arch, tuple(sorted({str(t.dtype) for t in model.state_dict().values()})), seed)
        if key not in base_renders:
            base_renders[key] = render_and_score(family, model, vae, text, wanted, seed)
        return base_renders[key]

    monkeypatch.setattr(networks.factory, "network_from_file", network_from_file)
    monkeypatch.setattr(tools.concept_demo, "render_and_score", render_and_score_once)


def learn(concept_set, out, model_type: str, network_args: tuple[str, ...] = (), flags: tuple[str, ...] = ()) -> dict:
    """Train the concept LoRA with the fast settings; its concept rate before and after on the bf16 base.
    The latents and captions are cached to disk beside the module's concept set, so a family's second
    run (the flipped target) reuses its first run's caches: the same bf16 tensors the in-memory caches
    hold, without loading the VAE and text encoder again or encoding 210 images."""
    overrides = [f"--{k}={v}" for k, v in learned_paths(model_type).items()] + [
        "--dataset_config", concept_set["concept_dataset_config"], "--output_dir", str(out),
        "--fp8_base", "false", "--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "3e-3",
        "--max_train_steps", str(learned_spec(model_type).learning_test[0]),
        "--sample_prompts", "", "--sample_at_first", "false",
        "--save_every_n_steps", "0", "--cache_latents_to_disk", "true", "--cache_text_encoder_outputs_to_disk", "true"]
    if network_args:
        overrides += ["--network_args", *network_args]
    overrides += list(flags)
    config = os.path.join(ROOT, "configs", learned_spec(model_type).config)
    assert train_lora.main(["--config_file", config, *overrides]) == 0
    return concept_demo(config, concept_set["concept"], grid_path=str(out / "grid.png"), overrides=overrides)["bf16"]


@pytest.mark.parametrize("model_type", BASES)
def test_lora_teaches_the_concept(concept_set, each_base_rendered_once, tmp_path, model_type):
    result = learn(concept_set, tmp_path, model_type)
    learned = learned_spec(model_type)
    n, (_, threshold, kept) = result["trigger_prompts"], learned.learning_test
    assert result["before"] / n <= learned.before_at_most, result
    assert result["after"] / n >= threshold, result
    assert result["unrelated_kept"] >= kept * result["unrelated_right_before"], result


@pytest.mark.parametrize("model_type", BASES[:1])
def test_flipped_flow_target_does_not_teach_it(concept_set, each_base_rendered_once, tmp_path, monkeypatch, model_type):
    """The check above fails on a broken objective: target = x0 - noise instead of noise - x0. On the first base
    alone: every family's loss takes flow_matching.flow_target, and the check is the same detector at each
    family's threshold (Qwen-Image's, 120 steps: 23 s of the suite for no other line of code)."""
    real = flow_matching.flow_target
    monkeypatch.setattr(flow_matching, "flow_target", lambda x0, noise: -real(x0, noise))
    assert torch.equal(flow_matching.flow_target(torch.zeros(1), torch.ones(1)), -torch.ones(1))
    result = learn(concept_set, tmp_path, model_type)
    assert result["after"] / result["trigger_prompts"] < learned_spec(model_type).learning_test[1], result


@pytest.mark.parametrize("flags, learns", [(("--max_timestep", "300"), False),
                                           (("--min_timestep", "700", "--preserve_distribution_shape", "true"), True)])
def test_the_concept_is_learned_at_high_noise_not_at_low(concept_set, each_base_rendered_once, tmp_path, flags, learns):
    """min_timestep / max_timestep reach training: what a purple star is (colour, shape, place) is decided at high
    noise. Measured (2026-12-04, the learned FLUX.1, the fast settings): every sigma 15/18; sigmas in [0, 0.3] 0/18;
    in [0.7, 1] scaled 7/18, cut to it (preserve_distribution_shape) 15/18; 10 of 10 unrelated kept in each."""
    result = learn(concept_set, tmp_path, "flux", flags=flags)
    n, (_, threshold, kept) = result["trigger_prompts"], learned_spec("flux").learning_test
    if learns:
        assert result["after"] / n >= threshold, result
    else:
        assert result["after"] / n <= learned_spec("flux").before_at_most, result
    assert result["unrelated_kept"] >= kept * result["unrelated_right_before"], result


def test_a_lora_of_the_packed_experts_alone_teaches_the_concept(concept_set, each_base_rendered_once, tmp_path):
    """networks/lora_packed.py on a learned mixture of experts: the routed experts' own factors (experts_dim, every
    Linear type at rank 0) learn the concept through packed_bmm's adapters. Measured (2026-12-01, 120 steps): 0/18
    before, 8/18 after, 10 of 11 unrelated kept (the default targets 14/18; both 16/18)."""
    off = [f"{t}_dim=0" for t in ("attn", "context", "mod", "mlp", "router")]
    result = learn(concept_set, tmp_path, "nucleus_image", ("experts_dim=8", *off))
    n = result["trigger_prompts"]
    assert result["before"] / n <= 0.1 and result["after"] / n >= 0.3, result
    assert result["unrelated_kept"] >= 0.5 * result["unrelated_right_before"], result


# The edit task on a learned base: tools/make_tiny_dataset.py --edit's 48 pairs (a grey shape -> the same shape
# red, each caption "make the shape red"), 36 trained on, 12 held out. The caption says neither shape nor position:
# a render shows the reference's only where the model reads its reference. Measured (2026-12-01, the shipped
# bases, 2 threads, seed 100 + i per render), held-out references right in colour, shape and position:
# FLUX.2 0/12 before (red 0, shape 2, position 6 of 12 by chance); after 300 steps 3/12, 600 steps 9/12, 1000 at
# 2e-3 11/12 (red and position 12/12 from 300 steps on). FLUX.1 Kontext on the learned FLUX.1 base: 0/12 -> 9/12
# at 600 steps, its samples' references at the trained 64 px (patched: its pipeline's are ~1 MP, 256x the tokens:
# 0/12 after, which training now warns about). Qwen-Image-Edit (2509, its config's flags) on the learned Qwen-Image
# base (2026-12-01; edit_base: its VL encoder built from the base's): 0/12 -> 11/12 at 600 steps (seeds 1, 2, 3:
# 7, 8, 9; 300 steps 6/12, 400 7/12; red and position 12/12 after). The references' tokens are placed as the
# pipelines place them (FLUX.2 at t = 10, Kontext at first axis 1, Qwen-Image-Edit as frame 1 of img_shapes); a
# LoRA cannot learn this from a model that drops them (Qwen-Image-Edit: 0/12).
EDIT_STEPS, EDIT_HELD_OUT, EDIT_CAPTION = 600, 12, "make the shape red"


def held_out_edit_set(out) -> tuple[dict, list]:
    """The edit set with its last EDIT_HELD_OUT pairs moved out of training: (paths, [(reference, scene)])."""
    import random
    import shutil

    from tools.make_tiny_dataset import edit_scenes, make_tiny_edit_dataset

    count = 48
    paths = make_tiny_edit_dataset(str(out / "edit"), count=count)
    scenes = edit_scenes(count, random.Random(0))  # the set's own draw (seed 0)
    held = []
    for i in range(count - EDIT_HELD_OUT, count):
        reference = str(out / f"held_{i:03d}.png")
        shutil.move(os.path.join(paths["edit_control_dir"], f"{i:03d}.png"), reference)
        for ext in (".png", ".txt"):
            os.remove(os.path.join(paths["edit_image_dir"], f"{i:03d}{ext}"))
        held.append((reference, scenes[i]))
    return paths, held


def edits_right(family, model, vae, texts: list[dict], held: list) -> int:
    """How many held-out references render red in the reference's shape at its position (texts[i]: the prompt's
    for reference i)."""
    from library.data.shape_detector import detect
    from tools.learned_base import to_images

    right = 0
    for i, ((reference, scene), text) in enumerate(zip(held, texts)):
        width, height, images = family.sample_references([reference], 64, 64)
        latents = family.sample_latents(model, text, width, height, 8, 100 + i, 1.0,
                                        control=[vae.encode(image) for image in images])
        right += detect(to_images(vae.decode(latents))[0]).shows("red", scene.shape, scene.position)
    return right


def edit_base(model_type: str, base: str, out, monkeypatch) -> dict:
    """The learned base's files for the edit model, its samples' references at the trained 64 px (the pipelines'
    are ~1 MP: 256x the tokens, which training warns about). Qwen-Image-Edit's text encoder is a Qwen2.5-VL:
    the base's language model (and tokenizer) with a seeded random vision tower (write_edit_text_encoder); it sees
    each reference at 64 px too (4 vision tokens; 2509's ~384x384 gives 64 here, capped by the tiny processor's
    max_pixels: the same learning, a 20% longer step), and the edit template's system prefix is dropped as the
    pipelines drop it (the 64 tokens it is with the released tokenizer, 169 with the base's)."""
    from transformers import AutoTokenizer

    from library.models.flux1 import kontext
    from library.models.qwen_image import edit, edit_encoder
    from library.models.qwen_image.learned import write_edit_text_encoder

    paths = learned_paths(base)
    monkeypatch.setattr(kontext, "PREFERRED_RESOLUTIONS", [(64, 64)])
    monkeypatch.setattr(edit, "VAE_IMAGE_AREA", 64 * 64)
    monkeypatch.setattr(edit, "CONDITION_IMAGE_AREA", 64 * 64)
    if model_type == "qwen_image_edit":
        paths["text_encoder"] = write_edit_text_encoder(paths["text_encoder"], str(out / "vl"))
        tokenizer = AutoTokenizer.from_pretrained(os.path.join(paths["text_encoder"], "processor"))
        system = edit_encoder.EDIT_PLUS_PROMPT_TEMPLATE.split("{}")[0]
        monkeypatch.setattr(edit_encoder, "EDIT_DROP_TOKENS", len(tokenizer(system).input_ids))
    return paths


def edit_texts(family, base: str, held: list) -> list[dict]:
    """The caption's text per held-out reference: an edit model's own where its encoder sees the reference, else
    its base's (an edit model's text is its base's), the same for each."""
    from library.data.controls import encode_prompts as encode_with_references
    from library.models.family import stack_text
    from tools.learned_base import encode_prompts, learned_family

    if not family.text_sees_controls:
        return [encode_prompts(learned_family(base), [EDIT_CAPTION])] * len(held)
    encode = family.load_text_encoder("fp32")
    return [{k: v.float() for k, v in stack_text(encode_with_references(encode, [EDIT_CAPTION], [[reference]],
                                                                         True)).items()} for reference, _ in held]


@pytest.mark.parametrize("model_type, base", [("flux2", "flux2"), ("flux_kontext", "flux"),
                                              ("qwen_image_edit", "qwen_image")])
def test_an_edit_lora_learns_to_draw_what_its_reference_shows(tmp_path, monkeypatch, model_type, base):
    from library.models.family import get_family
    from library.training.config import load_config
    from networks.factory import network_from_file

    paths, held = held_out_edit_set(tmp_path)
    config = ["--config_file", os.path.join(ROOT, "configs", learned_spec(base).config), "--model_type", model_type,
              *(f"--{k}={v}" for k, v in edit_base(model_type, base, tmp_path, monkeypatch).items()),
              "--dataset_config", paths["edit_dataset_config"], "--output_dir", str(tmp_path / "out"), "--output_name",
              "edit", "--fp8_base", "false", "--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "3e-3",
              "--network_dim", "16", "--network_alpha", "16", "--max_train_steps", str(EDIT_STEPS), "--sample_prompts",
              "", "--sample_at_first", "false", "--save_every_n_steps", "0"]
    assert train_lora.main(config) == 0
    family = get_family(load_config(config))
    texts = edit_texts(family, base, held)
    model, vae = family.load_transformer(torch.float32).requires_grad_(False).eval(), family.load_vae(torch.float32)
    before = edits_right(family, model, vae, texts, held)
    network_from_file(model, family.arch, str(tmp_path / "out" / "edit.safetensors")).apply()
    after = edits_right(family, model, vae, texts, held)
    assert before <= 1 and after >= EDIT_HELD_OUT // 2, (before, after)
