"""Output preservation (library/training/preservation.py, ai-toolkit's diff_output_preservation and
blank_prompt_preservation): the term is the mean squared difference between the LoRA's and the base's
prediction for the second prompt at the same noisy input; the second prompts are the captions with the
trigger replaced (whole words) and are cached with them; the keys are refused in one line where they do
nothing or disagree; block swap and checkpointing give the same gradients; the planner counts the graphs."""

import pytest
import torch
from safetensors import safe_open

import train_lora
from library.data.caches import read_text_cache
from library.models.family import Preservation
from library.training.preservation import class_caption, network_off
from tests.test_reliability import flux_args, one_error_line

DOP = ("--diff_output_preservation", "true", "--trigger_word", "circle", "--diff_output_preservation_class", "shape")


@pytest.mark.parametrize("caption, expected", [
    ("a red circle on a white background", "a red shape on a white background"),
    ("circle, (circle), red", "shape, (shape), red"),
    ("circles and semicircle", None),  # whole words only
    ("a Circle", None),  # case as written
])  # fmt: skip
def test_the_trigger_is_replaced_as_whole_words(caption, expected):
    assert class_caption(caption, "circle", "shape") == expected


def test_a_second_prompt_the_encoder_cuts_is_said_and_one_it_refuses_stops_the_run():
    """Until 2026-11-29 a class caption longer than a cutting encoder keeps (T5-XXL at t5xxl_max_token_length)
    was cut without a word, though check_dataset and the run warn of such captions."""
    from types import SimpleNamespace

    from library.data.check import TokenLimit
    from library.training.preservation import set_preservation_captions

    subset = SimpleNamespace(is_reg=False, keep_tokens_separator=None, control_directory=None)
    items = [SimpleNamespace(image_path=f"{k}.png", caption=c, subset=subset, preservation_caption=None)
             for k, c in enumerate(["a circle", "a red circle", "a square"])]
    args = SimpleNamespace(diff_output_preservation=True, blank_prompt_preservation=False, trigger_word="circle",
                           diff_output_preservation_class="big round shape", diff_output_preservation_multiplier=1.0)
    words = lambda text: len(text.split())  # noqa: E731
    said = set_preservation_captions(items, args, TokenLimit("T5-XXL", 4, words))
    assert said.endswith("; warning: 1 of these second prompts are longer than the 4 T5-XXL tokens the encoder "
                         "keeps, the rest is cut (first: 1.png, 5 tokens)"), said  # "a red big round shape"
    assert "warning" not in set_preservation_captions(items, args, TokenLimit("T5-XXL", 5, words))
    with pytest.raises(ValueError, match=r"^1.png: its caption with 'circle' replaced by 'big round shape' has 5 "):
        set_preservation_captions(items, args, TokenLimit("Qwen3-VL", 4, words, refuses=True))


@pytest.mark.parametrize("extra, message", [
    (("--diff_output_preservation", "true", "--diff_output_preservation_class", "shape"),
     "key 'trigger_word' must be set with diff_output_preservation = true"),
    (("--diff_output_preservation", "true", "--trigger_word", "circle"),
     "key 'diff_output_preservation_class' must be set with diff_output_preservation = true"),
    (("--diff_output_preservation", "true", "--trigger_word", "circle", "--diff_output_preservation_class", "circle"),
     "diff_output_preservation_class is the trigger_word ('circle')"),
    ((*DOP, "--blank_prompt_preservation", "true"),
     "keys 'diff_output_preservation' and 'blank_prompt_preservation' are both true; keep one"),
    (("--trigger_word", "circle"), "key 'trigger_word' does nothing with diff_output_preservation = false"),
    (("--blank_prompt_preservation_multiplier", "2"),
     "key 'blank_prompt_preservation_multiplier' does nothing with blank_prompt_preservation = false"),
    ((*DOP, "--diff_output_preservation_multiplier", "0"), "key 'diff_output_preservation_multiplier' must be > 0"),
    ((*DOP[:2], "--trigger_word", "zxq", *DOP[4:]), "trigger_word 'zxq' is in none of the 8 training captions"),
])  # fmt: skip
def test_keys_that_disagree_or_do_nothing_are_refused_in_one_line(tiny_set, tmp_path, capsys, extra, message):
    capsys.readouterr()
    line = one_error_line(capsys, train_lora.main(flux_args(tiny_set, tmp_path / "out", *extra)))
    assert message in line, line


def flux_with_lora(tiny_set, seed=1):
    """The tiny FLUX.1, its family and a rank-4 LoRA with nonzero up weights."""
    from library.models.flux1.family import FluxFamily
    from tests.test_merge_convert import lora

    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    network = lora(model, "flux", rank=4, alpha=4.0, seed=seed)
    network.apply()
    return family, model, network


def flux_batch():
    g = torch.Generator().manual_seed(3)
    latents = torch.randn(2, 16, 8, 8, generator=g)
    text = {"t5": torch.randn(2, 7, 32, generator=g), "clip_pooled": torch.randn(2, 32, generator=g)}
    kept = {k: torch.randn(v.shape, generator=g) for k, v in text.items()}
    return latents, text, kept


def preservation_args():
    from tests.test_training_objective import loss_args

    return loss_args(guidance_scale=3.5)


def test_the_term_is_the_mean_squared_difference_to_the_base_at_the_same_noisy_input(tiny_set):
    family, model, network = flux_with_lora(tiny_set)
    latents, text, kept = flux_batch()
    args, gens = preservation_args(), lambda: [torch.Generator().manual_seed(i) for i in range(2)]
    weights = torch.tensor([1.0, 0.0])
    p = Preservation(kept, weights, 0.5, lambda: network_off(network))
    with_term, sigmas = family.training_loss(model, latents, text, args, gens(), preservation=p)
    without, same_sigmas = family.training_loss(model, latents, text, args, gens())
    assert torch.equal(sigmas, same_sigmas)
    noise = torch.stack([torch.randn(latents.shape[1:], generator=g) for g in gens()])
    from library.models import flow_matching as fm

    x_t = family.pack_target(fm.noisy_input(latents, noise, sigmas))
    with torch.no_grad():
        on = family.predict(model, x_t, sigmas, kept, 4, 4, 3.5)
        with network_off(network):
            off = family.predict(model, x_t, sigmas, kept, 4, 4, 3.5)
    expected = 0.5 * ((on - off).pow(2).flatten(1).mean(1) * weights).mean()
    assert expected > 1e-6  # the LoRA changes the prediction
    torch.testing.assert_close(with_term - without, expected, rtol=1e-4, atol=1e-9)
    torch.testing.assert_close(p.loss, expected, rtol=1e-4, atol=1e-9)
    assert all(m.multiplier == 1.0 for m in network.lora_modules())  # restored after the base's prediction
    with_term.backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(p.grad is not None for p in network.trainable_parameters())


@pytest.mark.parametrize("network_args", [{"algo": "lokr", "dora_wd": "true"}, {"algo": "locon", "dora_wd": "true"},
                                          {"algo": "loha"}, {"dora": "true"}])
def test_the_base_prediction_is_the_base_with_every_network_kind(tiny_set, network_args):
    """Until 2026-11-29 a LyCORIS module with dora_wd kept its whole update at multiplier 0 (the multiplier
    blends only its magnitude): the 'base' prediction differed from the base's by up to 0.18 on the tiny FLUX.1."""
    from library.models.flux1.family import FluxFamily
    from networks.factory import build_network

    family, (_, text, _) = FluxFamily(tiny_set["flux_bfl"]), flux_batch()
    model = family.load_transformer(torch.float32)
    x_t, sigmas = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(5)), torch.tensor([0.3, 0.8])
    with torch.no_grad():
        base = family.predict(model, x_t, sigmas, text, 4, 4, 3.5)
        module = "networks.lora" if "dora" in network_args else "lycoris.kohya"
        network = build_network(module, model, "flux", 4, 4.0, network_args=network_args)
        for p in network.parameters():  # a trained update and magnitude
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.1)
        network.apply()
        on = family.predict(model, x_t, sigmas, text, 4, 4, 3.5)
        with network_off(network):
            off = family.predict(model, x_t, sigmas, text, 4, 4, 3.5)
    assert (on - base).abs().max() > 1e-2
    assert torch.equal(off, base)
    assert torch.equal(family.predict(model, x_t, sigmas, text, 4, 4, 3.5), on)  # restored


def test_block_swap_and_checkpointing_give_the_same_gradients_with_the_term(tiny_set):
    from library.models.block_swap import enable_block_swap

    grads = []
    for swap, checkpoint in ((0, False), (2, True)):
        family, model, network = flux_with_lora(tiny_set)
        model.gradient_checkpointing = checkpoint
        if swap:
            enable_block_swap(model, swap, torch.device("cpu"))
        latents, text, kept = flux_batch()
        p = Preservation(kept, torch.ones(2), 1.0, lambda: network_off(network))
        gens = [torch.Generator().manual_seed(i) for i in range(2)]
        loss, _ = family.training_loss(model, latents, text, preservation_args(), gens, preservation=p)
        loss.backward()
        grads.append([q.grad.clone() for q in network.trainable_parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_run_caches_the_second_prompts_logs_the_term_and_names_it_in_the_header(tiny_set, tmp_path, capsys):
    out = tmp_path / "out"
    capsys.readouterr()
    assert train_lora.main(flux_args(tiny_set, out, *DOP, "--max_train_steps", "2", "--cache_text_encoder_outputs_to_disk", "true",
                                     "--dataset_config", copy_of_dataset(tiny_set, tmp_path))) == 0
    said = capsys.readouterr().out
    assert "diff_output_preservation: 'circle' -> 'shape' in 4 of 8 training captions (x1); the 4 without 'circle' " \
           "get no preservation term" in said, said
    with safe_open(str(out / "tiny_flux_lora.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_output_preservation"] == "diff: circle -> shape x1"
    caches = sorted((tmp_path / "data" / "images").glob("0*_te.safetensors"))
    with_circle = [c for c in caches if read_text_cache(str(c), "preserve")]
    assert len(caches) == 8 and len(with_circle) == 4
    header, *rows = (out / "tiny_flux_lora_log.csv").read_text().splitlines()
    column = header.split(",").index("loss_preservation")
    assert len(rows) == 2 and all(float(row.split(",")[column]) >= 0 for row in rows)


def copy_of_dataset(tiny_set, tmp_path) -> str:
    from tests.test_reliability import copy_dataset

    return copy_dataset(tiny_set, tmp_path / "data")


def test_blank_prompt_preservation_holds_every_sample_to_the_base_on_the_empty_caption(tiny_set, tmp_path, capsys):
    """A family whose encoder does not see references takes the empty caption's one encoding (no copy per item);
    the term is 0 at the first step (the LoRA's up weights start at 0) and live from the second."""
    out = tmp_path / "out"
    assert train_lora.main(flux_args(tiny_set, out, "--blank_prompt_preservation", "true", "--max_train_steps", "2",
                                     "--cache_text_encoder_outputs_to_disk", "true",
                                     "--dataset_config", copy_of_dataset(tiny_set, tmp_path))) == 0
    assert "blank_prompt_preservation: every sample's prediction for the empty prompt" in capsys.readouterr().out
    caches = sorted((tmp_path / "data" / "images").glob("0*_te.safetensors"))  # (prompt-*: the empty caption's)
    assert len(caches) == 8 and not any(read_text_cache(str(c), "preserve") for c in caches)
    header, *rows = (out / "tiny_flux_lora_log.csv").read_text().splitlines()
    terms = [float(row.split(",")[header.split(",").index("loss_preservation")]) for row in rows]
    assert terms[0] == 0.0 and terms[1] > 0.0, terms
    with safe_open(str(out / "tiny_flux_lora.safetensors"), framework="pt") as f:
        assert f.metadata()["ss_output_preservation"] == "blank x1"


def test_the_planner_counts_the_second_prompts_graph(tiny_set):
    import copy

    from library.training.memory_plan import training_plan
    from tests.test_memory_plan import tiny_flux
    from tools import plan_memory

    family, args = tiny_flux(tiny_set), plan_memory.default_args("flux")
    kept_args = copy.copy(args)
    kept_args.blank_prompt_preservation = True
    plain, kept = training_plan(family, args, 64, 64, 2, 8), training_plan(family, kept_args, 64, 64, 2, 8)
    graphs = [plan.activations - plan.lora_grads for plan in (plain, kept)]  # the step's peak, less the LoRA's grads
    assert graphs[1] > 1.5 * graphs[0], graphs
    assert kept.inputs > plain.inputs and kept.base == plain.base


def test_a_batch_without_a_second_prompt_runs_no_extra_forwards(tiny_set, tmp_path, monkeypatch):
    """The two extra forwards were run for a term of 0 wherever no caption of the batch held the trigger."""
    import collections
    import os

    from library.models.family import DiffusionFamily

    dataset = copy_of_dataset(tiny_set, tmp_path)
    captions = {f: (tmp_path / "data" / "images" / f).read_text().split() for f in os.listdir(tmp_path / "data" / "images")
                if f.endswith(".txt")}
    counts = collections.Counter(w for words in captions.values() for w in set(words))
    word = next(w for w, n in sorted(counts.items()) if n == 1)  # in one caption: one batch of the 4 holds it
    calls = []
    real = DiffusionFamily.preservation_term
    monkeypatch.setattr(DiffusionFamily, "preservation_term", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = tmp_path / "out"
    assert train_lora.main(flux_args(tiny_set, out, "--diff_output_preservation", "true", "--trigger_word", word,
                                     "--diff_output_preservation_class", "shape", "--max_train_steps", "4",
                                     "--dataset_config", dataset)) == 0
    assert len(calls) == 1
    header, *rows = (out / "tiny_flux_lora_log.csv").read_text().splitlines()
    terms = [row.split(",")[header.split(",").index("loss_preservation")] for row in rows]
    assert len(terms) == 4 and sum(float(t) == 0.0 for t in terms) >= 3, terms
