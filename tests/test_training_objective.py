"""What reaches the transformer in a training step, and what the loop does with the loss.

The family-level tests wrap the tiny models in a recorder and assert exactly what each forward
receives (sigma, guidance, the resolution shift, the text mask), against the draws recomputed from
the same seeds. The loop tests run train_lora.Trainer on a small fake task whose loss is known, so
gradient accumulation, clipping and resume are checked as numbers.
"""

import argparse
import json
import math
import os

import pytest
import torch
import torch.nn as nn

import train_lora
from library.models.family import DiffusionFamily, family_class
from library.models.flux1.family import FluxFamily
from library.models.qwen_image.family import QwenImageFamily
from library.models.latents import pack_latents
from library.models import flow_matching as fm
from library.models.registry import FAMILIES
from library.training.config import load_config
from library.training.run_length import plan_steps


class Recorder(nn.Module):
    """Wraps a model: records every forward's keyword arguments, returns the model's output."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model, self.calls = model, []

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)

    def forward(self, **kwargs):
        self.calls.append({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})
        return self.model(**kwargs)


def loss_args(**overrides):
    values = dict(timestep_sampling=None, discrete_flow_shift=3.0, sigmoid_scale=1.0, guidance_scale=1.0,
                  weighting_scheme="none", loss_type="l2", huber_c=0.1)
    return argparse.Namespace(**{**values, **overrides})


def expected_draws(seeds, latent_shape, method, tokens):
    """Noise then sigma, drawn from each sample's generator in the order training_loss draws them."""
    noise, sigmas = [], []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        noise.append(torch.randn(latent_shape, generator=g, dtype=torch.float32))
        sigmas.append(fm.sample_sigmas(1, method, generator=g, image_seq_len=tokens))
    return torch.stack(noise), torch.cat(sigmas)


# ----------------------------------------------------------------------------------------------
# Family level: what the transformer receives


def test_flux_step_feeds_sigma_in_0_1_the_guidance_and_the_token_count_shift(tiny_set):
    family = FluxFamily(tiny_set["flux_bfl"])
    model = Recorder(family.load_transformer(torch.float32))
    latents = torch.randn(2, 16, 8, 16)  # 4 x 8 patches: 32 image tokens, 128 latent pixels
    text = {"t5": torch.randn(2, 7, 32), "clip_pooled": torch.randn(2, 32)}
    seeds = [11, 12]
    loss, sigmas = family.training_loss(model, latents, text, loss_args(guidance_scale=3.0),
                                        [torch.Generator().manual_seed(s) for s in seeds])
    noise, expected = expected_draws(seeds, latents.shape[1:], "flux_shift", tokens=32)
    (call,) = model.calls
    assert torch.equal(call["timesteps"], expected) and torch.equal(sigmas, expected)
    assert 0.0 < expected.min() and expected.max() < 1.0  # sigma itself, not 1000 * sigma
    _, latent_pixel_count = expected_draws(seeds, latents.shape[1:], "flux_shift", tokens=128)
    assert not torch.equal(latent_pixel_count, expected)  # the shift depends on the count used: tokens
    assert torch.equal(call["guidance"], torch.full((2,), 3.0))
    assert torch.equal(call["img"], pack_latents(fm.noisy_input(latents, noise, expected)))
    assert torch.equal(call["txt"], text["t5"]) and torch.equal(call["y"], text["clip_pooled"])
    pred = model.model(**call)
    assert loss.item() == pytest.approx(((pred - pack_latents(noise - latents)) ** 2).mean().item(), rel=1e-6)


@pytest.mark.parametrize("random_strength", [False, True])
def test_ip_noise_gamma_perturbs_the_input_noise_not_the_target(tiny_set, random_strength):
    """sd-scripts' input perturbation (refused until 2026-12-01): the transformer sees (1 - s) x0 + s (noise + g xi),
    xi drawn after the sample's noise and sigma from its generator, g = gamma or uniform in [0, gamma) per sample;
    the loss still targets noise - x0. gamma = 0 leaves the step as it was, bit for bit."""
    family = FluxFamily(tiny_set["flux_bfl"])
    model = Recorder(family.load_transformer(torch.float32))
    latents, seeds = torch.randn(2, 16, 8, 16), [21, 22]
    text = {"t5": torch.randn(2, 7, 32), "clip_pooled": torch.randn(2, 32)}
    args = loss_args(ip_noise_gamma=0.5, ip_noise_gamma_random_strength=random_strength)
    loss, sigmas = family.training_loss(model, latents, text, args, [torch.Generator().manual_seed(s) for s in seeds])
    noise, expected_input = [], []
    for seed in seeds:  # the sample's draws in training_loss' order: noise, sigma, xi (and its strength)
        g = torch.Generator().manual_seed(seed)
        noise.append(torch.randn(latents.shape[1:], generator=g))
        fm.sample_sigmas(1, "flux_shift", generator=g, image_seq_len=32)
        xi = torch.randn(latents.shape[1:], generator=g)
        strength = float(torch.rand(1, generator=g)) * 0.5 if random_strength else 0.5
        assert 0 <= strength < 0.5 if random_strength else strength == 0.5
        expected_input.append(noise[-1] + strength * xi)
    noise, expected_input = torch.stack(noise), torch.stack(expected_input)
    (call,) = model.calls
    assert torch.allclose(call["img"], pack_latents(fm.noisy_input(latents, expected_input, sigmas)), atol=1e-6)
    assert not torch.allclose(call["img"], pack_latents(fm.noisy_input(latents, noise, sigmas)), atol=1e-3)
    pred = model.model(**call)
    assert loss.item() == pytest.approx(((pred - pack_latents(noise - latents)) ** 2).mean().item(), rel=1e-6)
    off = loss_args(ip_noise_gamma=0.0)
    plain, _ = family.training_loss(model, latents, text, off, [torch.Generator().manual_seed(s) for s in seeds])
    unset, _ = family.training_loss(model, latents, text, loss_args(),
                                    [torch.Generator().manual_seed(s) for s in seeds])
    assert torch.equal(plain, unset) and torch.equal(model.calls[-1]["img"], model.calls[-2]["img"])


def test_the_timestep_bias_reaches_the_sigma_draw(tiny_set):
    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    latents, seeds = torch.randn(2, 16, 8, 16), [31, 32]
    text = {"t5": torch.randn(2, 7, 32), "clip_pooled": torch.randn(2, 32)}
    _, sigmas = family.training_loss(model, latents, text, loss_args(timestep_bias="high_noise"),
                                     [torch.Generator().manual_seed(s) for s in seeds])
    expected = []
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        torch.randn(latents.shape[1:], generator=g)
        expected.append(fm.sample_sigmas(1, "flux_shift", generator=g, image_seq_len=32, bias="high_noise"))
    assert torch.equal(sigmas, torch.cat(expected))


def test_a_schnell_checkpoint_draws_unshifted_sigmas_by_default(tiny_set):
    """FLUX.1 schnell (no guidance embedding) samples without a shift; with timestep_sampling unset it
    trained on FLUX.1-dev's flux_shift draw (86% of sigmas above 0.5 at 1024 px). The unshifted sigmoid
    draw now, as the schnell config sets it."""
    family = FluxFamily(tiny_set["flux_bfl"])
    model = family.load_transformer(torch.float32)
    model.guidance_in = None
    latents, text, seeds = torch.randn(2, 16, 8, 16), {"t5": torch.randn(2, 7, 32), "clip_pooled": torch.randn(2, 32)}, [3, 4]
    _, sigmas = family.training_loss(model, latents, text, loss_args(), [torch.Generator().manual_seed(s) for s in seeds])
    assert torch.equal(sigmas, expected_draws(seeds, latents.shape[1:], "sigmoid", tokens=32)[1])
    assert family.default_timestep_sampling(model) == "sigmoid"


def test_qwen_image_step_feeds_the_text_mask_and_sigma(tiny_set):
    family = QwenImageFamily(tiny_set["qwen_image"])
    model = Recorder(family.load_transformer(torch.float32))
    latents = torch.randn(2, 16, 8, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.long)
    width = model.model.config.joint_attention_dim
    text = {"embeds": torch.randn(2, 5, width), "mask": mask}
    seeds = [3, 4]
    family.training_loss(model, latents, text, loss_args(), [torch.Generator().manual_seed(s) for s in seeds])
    _, expected = expected_draws(seeds, latents.shape[1:], "qwen_shift", tokens=16)
    (call,) = model.calls
    assert torch.equal(call["txt_mask"], mask.bool())
    assert torch.equal(call["timesteps"], expected) and call["img_shapes"] == [(1, 4, 4)] * 2
    # the mask matters: without it the padded tokens change the prediction
    assert not torch.allclose(model.model(**call), model.model(**{**call, "txt_mask": None}), atol=1e-5)


def test_qwen_true_cfg_rescales_the_guided_velocity_to_the_conditional_norm(monkeypatch):
    family = QwenImageFamily("unused")
    cond, uncond = torch.randn(1, 6, 64), torch.randn(1, 6, 64)
    monkeypatch.setattr(family, "predict", lambda model, x, s, text, h, w, g: cond if text == "c" else uncond)
    out = family.guided_velocity(None, None, None, "c", "u", 2, 3, 4.0)
    guided = uncond + 4.0 * (cond - uncond)
    expected = guided * cond.norm(dim=-1, keepdim=True) / guided.norm(dim=-1, keepdim=True)
    assert torch.allclose(out, expected, atol=1e-6)
    assert torch.allclose(out.norm(dim=-1), cond.norm(dim=-1), atol=1e-5)


def test_every_occurrence_in_a_step_gets_its_own_draw_and_steps_differ(tiny_set, tmp_path, monkeypatch):
    """4 repeats, batch 2, accumulation 2: each step holds repeats of the same images; no two
    samples of a step may share a sigma, and no step may repeat another's."""
    from test_train_lora import flux_args

    cfg = tmp_path / "ds.toml"
    image_dir = os.path.join(os.path.dirname(tiny_set["dataset_config"]), "images")
    cfg.write_text(f'[general]\nresolution = 64\nbatch_size = 2\n[[datasets]]\n[[datasets.subsets]]\n'
                   f'image_dir = "{image_dir}"\nnum_repeats = 4\n')
    sigmas: list[torch.Tensor] = []
    real = FluxFamily.predict
    monkeypatch.setattr(FluxFamily, "predict", lambda self, m, x, s, *a: (sigmas.append(s.clone()), real(self, m, x, s, *a))[1])
    assert train_lora.main(flux_args(tiny_set, tmp_path / "out", "--dataset_config", str(cfg), "--max_train_steps", "4",
                                     "--gradient_accumulation_steps", "2", "--sample_prompts", "")) == 0
    steps = [torch.cat(sigmas[i : i + 2]).tolist() for i in range(0, 8, 2)]
    assert len(sigmas) == 8
    for step in steps:
        assert len(set(step)) == len(step), step
    assert len({v for step in steps for v in step}) == 16

    # One image, one repeat: the same key in every step, so only the step number can vary its draw.
    single = tmp_path / "single"
    single.mkdir()
    first = sorted(f for f in os.listdir(image_dir) if f.endswith(".png"))[0]
    for suffix in (".png", ".txt"):
        (single / first.replace(".png", suffix)).write_bytes((open(os.path.join(image_dir, first.replace(".png", suffix)), "rb")).read())
    cfg.write_text(f'[general]\nresolution = 64\n[[datasets]]\n[[datasets.subsets]]\nimage_dir = "{single}"\n')
    sigmas.clear()
    assert train_lora.main(flux_args(tiny_set, tmp_path / "out1", "--dataset_config", str(cfg), "--max_train_steps", "3",
                                     "--sample_prompts", "")) == 0
    assert len({s.item() for s in sigmas}) == 3, sigmas


# ----------------------------------------------------------------------------------------------
# The training-noise hook (DiffusionFamily.model_noise)


# the families whose models were trained on other noise than the standard normal draw (their own tests cover it)
OWN_NOISE = ("hidream_o1",)


@pytest.mark.parametrize("model_type", [t for t in FAMILIES if t not in OWN_NOISE])
def test_every_familys_training_noise_is_the_draw_itself(model_type):
    """model_noise is the identity for every other registered family (the same tensor: its loss bit for bit as
    before)."""
    cls = family_class(model_type)
    noise = torch.randn(2, 16, 4, 4)
    assert cls.model_noise(object.__new__(cls), noise, torch.tensor([0.2, 0.9])) is noise


class LinearFamily(DiffusionFamily):
    """A family whose 'model' is a fixed linear map of x_t and sigma: the loss is a plain function of its inputs."""

    name = "linear"
    arch = "flux"

    def predict(self, model, x_t, sigmas, text, h, w, guidance):
        return 0.5 * x_t + sigmas[:, None, None]


class ScaledNoiseFamily(LinearFamily):
    def model_noise(self, noise, sigmas):
        return noise * (8.0 - sigmas[:, None, None, None])


@pytest.mark.parametrize("perturbed", [False, True])
def test_the_training_noise_hook_makes_both_the_noisy_input_and_the_target(perturbed):
    """loss_at with a family's model_noise equals loss_at of the plain family given the hooked noise: x_t and the
    flow target both take it (and the input perturbation's noise too), to the bit."""
    g = torch.Generator().manual_seed(0)
    latents, noise, extra = (torch.randn(2, 16, 8, 8, generator=g) for _ in range(3))
    sigmas, mask = torch.tensor([0.25, 0.75]), torch.rand(2, 1, 8, 8, generator=g)
    input_noise = noise + 0.1 * extra if perturbed else None
    hooked = ScaledNoiseFamily("model")
    scaled = hooked.model_noise(noise, sigmas)
    scaled_input = hooked.model_noise(input_noise, sigmas) if perturbed else None
    loss = hooked.loss_at(None, latents, {}, noise, sigmas, None, mask=mask, input_noise=input_noise)
    plain = LinearFamily("model").loss_at(None, latents, {}, scaled, sigmas, None, mask=mask, input_noise=scaled_input)
    assert torch.equal(loss, plain)
    unscaled = LinearFamily("model").loss_at(None, latents, {}, noise, sigmas, None, mask=mask, input_noise=input_noise)
    assert not torch.equal(loss, unscaled)
    x_t = fm.noisy_input(latents, scaled_input if perturbed else scaled, sigmas)  # by hand: pred vs target
    by_hand = ((0.5 * pack_latents(x_t) + sigmas[:, None, None] - pack_latents(scaled - latents)) ** 2
               * pack_latents(mask.expand_as(latents))).mean()
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)


# ----------------------------------------------------------------------------------------------
# The loop, on a fake task with a known loss


class FakeTask:
    """batches_per_epoch batches of scalars; loss of batch b = 0.5 * (w * x_b - 1)^2 summed."""

    def __init__(self, batches_per_epoch: int, values=None):
        self.n = batches_per_epoch
        self.module = nn.Linear(1, 1, bias=False)
        nn.init.constant_(self.module.weight, 2.0)
        self.values = values or [float(i + 1) for i in range(batches_per_epoch)]
        self.seen: list[tuple[int, int, int]] = []  # (step, epoch, batch)

    def param_groups(self, lr):
        return [{"name": "lora", "params": list(self.module.parameters()), "lr": lr}]

    def batches_per_epoch(self):
        return self.n

    def loss_weight(self, epoch, batch, step_batches):
        return 1, len(step_batches)  # the mean of the step's micro-batches, as DiffusionTask

    def data_items(self):
        return [f"batch {b}: {x}" for b, x in enumerate(self.values)]

    def epoch_settings(self):
        return None

    def epoch_batches(self, epoch, skip=0):
        return [(epoch, b) for b in range(skip, self.n)]

    def batch_inputs(self, batch, step):
        self.seen.append((step, *batch))
        torch.rand(3)  # as dropout does: training draws from the global RNG
        return (torch.tensor([[self.values[batch[1]]]]),)

    def trainable_parameters(self):
        return list(self.module.parameters())

    def trainable_tensors(self):
        return {k: v.detach() for k, v in self.module.state_dict().items()}

    def load_trainable_tensors(self, tensors):
        self.module.load_state_dict(tensors)

    def save(self, path, metadata, dtype):
        from library.io import save_safetensors

        save_safetensors(self.trainable_tensors(), path)

    def step_extras(self):
        return {}

    def validation_size(self):
        return 0

    def after_step(self, step, output_dir):
        pass

    def evaluates_after(self, step):
        return False

    def render_samples(self, out_dir, tag, stop=None, first=0):
        return []

    def finish(self, output_dir, stop=None):
        pass

    def metadata(self):
        return {"base_model_version": "fake", "base_precision": "fake", "resolution": "fake", "batch_size": 1,
                "timestep_sampling": "fake", "dataset": []}


class LossModule(nn.Module):
    def __init__(self, linear):
        super().__init__()
        self.linear = linear

    def forward(self, x):
        return 0.5 * ((self.linear(x) - 1.0) ** 2).sum()


def fake_run(tmp_path, monkeypatch, task, *extra):
    task.module = LossModule(task.module)
    monkeypatch.setattr(train_lora, "build_task", lambda args, accelerator, state=None, held=None: task)
    args = load_config(["--model_type", "llm", "--pretrained_model_name_or_path", "fake", "--train_data", "fake",
                        "--output_dir", str(tmp_path), "--output_name", "fake", "--optimizer_type", "torch.optim.SGD",
                        "--learning_rate", "1.0", "--mixed_precision", "no", *extra])
    return train_lora.Trainer(args)


def test_accumulation_stays_inside_epochs_and_the_last_partial_group_steps(tmp_path, monkeypatch, capsys):
    task = FakeTask(4)
    trainer = fake_run(tmp_path, monkeypatch, task, "--gradient_accumulation_steps", "3", "--max_train_epochs", "2",
                       "--max_grad_norm", "0", "--learning_rate", "1e-3")
    assert trainer.max_steps == 4 == plan_steps(trainer.args, 4)
    # max_train_epochs replaced max_train_steps without a word (sd-scripts says the steps it came to)
    assert "max_train_epochs = 2: 4 optimizer steps (2 an epoch), in place of max_train_steps" in capsys.readouterr().out
    assert trainer.run() == 0
    by_step = {}
    for step, epoch, batch in task.seen:
        by_step.setdefault(step, []).append((epoch, batch))
    assert by_step == {0: [(0, 0), (0, 1), (0, 2)], 1: [(0, 3)], 2: [(1, 0), (1, 1), (1, 2)], 3: [(1, 3)]}
    import csv

    with open(tmp_path / "fake_log.csv") as f:
        logged = [float(r["loss"]) for r in csv.DictReader(f)]
    assert len(logged) == 4  # and the first step's logged loss is the mean of its 3 micro-batches:
    w = 2.0
    assert logged[0] == pytest.approx(sum(0.5 * (w * x - 1) ** 2 for x in (1.0, 2.0, 3.0)) / 3, rel=1e-6)


def test_max_train_steps_says_the_epochs_it_comes_to(tmp_path, monkeypatch, capsys):
    """4 batches an epoch, 3 to a step: 2 steps an epoch, 5 steps in 3 epochs (the old line said nothing)."""
    fake_run(tmp_path, monkeypatch, FakeTask(4), "--gradient_accumulation_steps", "3", "--max_train_steps", "5")
    assert "max_train_steps = 5: 3 epochs of 2 optimizer steps" in capsys.readouterr().out


def test_a_step_follows_the_mean_gradient_of_its_micro_batches(tmp_path, monkeypatch):
    task = FakeTask(2, values=[1.0, 3.0])
    trainer = fake_run(tmp_path, monkeypatch, task, "--gradient_accumulation_steps", "2", "--max_train_steps", "1",
                       "--max_grad_norm", "0", "--learning_rate", "0.01")
    assert trainer.run() == 0
    w = 2.0
    mean_grad = sum((w * x - 1) * x for x in (1.0, 3.0)) / 2  # d/dw of the mean micro-batch loss
    assert task.module.linear.weight.item() == pytest.approx(w - 0.01 * mean_grad, rel=1e-6)


def test_gradient_clipping_bounds_the_step(tmp_path, monkeypatch):
    task = FakeTask(1, values=[3.0])
    trainer = fake_run(tmp_path, monkeypatch, task, "--max_train_steps", "1", "--max_grad_norm", "0.5")
    assert trainer.run() == 0
    grad = (2.0 * 3.0 - 1) * 3.0  # 15, clipped to 0.5
    assert task.module.linear.weight.item() == pytest.approx(2.0 - 0.5, rel=1e-5)
    assert abs(grad) > 0.5


def test_resume_restores_the_global_rng_state(tmp_path, monkeypatch):
    task = FakeTask(2)
    trainer = fake_run(tmp_path, monkeypatch, task, "--max_train_steps", "2", "--save_state", "true")
    assert trainer.run() == 0
    folder = tmp_path / "fake-state"
    saved = torch.get_rng_state().clone()  # the state was written right after the last step
    torch.rand(1000)  # anything drawing from the global RNG (dropout, module_dropout) moves it
    assert not torch.equal(torch.get_rng_state(), saved)
    fake_run(tmp_path, monkeypatch, FakeTask(2), "--max_train_steps", "4", "--save_state", "true",
             "--resume", str(folder))
    assert torch.equal(torch.get_rng_state(), saved)


# ----------------------------------------------------------------------------------------------
# fp8 block scales


def test_fp8_block_scale_is_the_smallest_bf16_not_below_absmax_over_448():
    from library.precision.fp8 import BLOCK, FP8_MAX, quantize_weight

    torch.manual_seed(0)
    w = torch.randn(64, 256) * torch.logspace(-4, 1, 64)[:, None]  # many magnitudes, many roundings
    _, scale = quantize_weight(w, "fp8_scaled")
    target = w.reshape(64, -1, BLOCK).abs().amax(-1) / FP8_MAX  # fp32
    assert scale.dtype == torch.bfloat16
    assert bool((scale.float() >= target).all())  # never below: no block can pass 448
    below = (scale.view(torch.int16) - 1).view(torch.bfloat16).float()  # the next smaller bf16
    assert bool((below < target).all())  # and the smallest such bf16
    assert math.isfinite(scale.float().max().item())


# ----------------------------------------------------------------------------------------------
# Issue-10 regressions: dropouts act in training, sd-scripts files load, caches key every input,
# missing model paths are named


def count_lora_forwards(monkeypatch) -> dict:
    from networks.lora_module import LoRAModule

    counts = {"train": 0, "eval": 0}
    real = LoRAModule.forward

    def forward(self, x):
        counts["train" if self.training else "eval"] += 1
        return real(self, x)

    monkeypatch.setattr(LoRAModule, "forward", forward)
    return counts


def test_lora_dropouts_act_during_training_steps_and_not_in_samples(tiny_set, tmp_path, monkeypatch):
    from test_train_lora import flux_args

    counts = count_lora_forwards(monkeypatch)
    assert train_lora.main(flux_args(tiny_set, tmp_path / "a", "--max_train_steps", "2", "--sample_at_first", "true",
                                     "--network_dropout", "0.5", "--network_args", "rank_dropout=0.5",
                                     "module_dropout=0.5")) == 0
    assert counts["train"] > 0 and counts["eval"] > 0, counts  # steps in train mode, samples in eval
    # The same step with and without dropout gives other losses: the dropouts really act.
    from test_train_lora import read_losses

    assert train_lora.main(flux_args(tiny_set, tmp_path / "b", "--max_train_steps", "2", "--sample_prompts", "",
                                     "--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "1e-2")) == 0
    assert train_lora.main(flux_args(tiny_set, tmp_path / "c", "--max_train_steps", "2", "--sample_prompts", "",
                                     "--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "1e-2",
                                     "--network_args", "rank_dropout=0.9")) == 0
    assert read_losses(tmp_path / "b")[1] != read_losses(tmp_path / "c")[1]


def test_llm_lora_gets_network_dropout_and_trains_in_train_mode(tiny_set, tmp_path, monkeypatch):
    from test_train_llm import llm_args

    from library.training.llm_task import LLMTask

    counts = count_lora_forwards(monkeypatch)
    built = []
    real_init = LLMTask.__init__
    monkeypatch.setattr(LLMTask, "__init__", lambda self, *a: (real_init(self, *a), built.append(self))[0])
    assert train_lora.main(llm_args(tiny_set, tmp_path, "--pretrained_model_name_or_path", tiny_set["llm"],
                                    "--max_train_steps", "2", "--network_dropout", "0.25", "--eval_every_n_steps", "1",
                                    "--save_format", "kohya", "--output_name", "lm")) == 0
    assert {m.dropout for m in built[0].network.lora_modules()} == {0.25}
    assert counts["train"] > 0 and counts["eval"] > 0, counts
    # The file's header records the dropout it trained with (ss_network_args was network_args alone: {}).
    from safetensors import safe_open

    with safe_open(str(tmp_path / "lm.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["ss_network_args"]) == {"dropout": 0.25}


def sd_scripts_flux_lora(tiny_set, path):
    """What sd-scripts' lora_flux writes by default: every Linear of the double and single blocks,
    modulation included, kohya names, alpha per module."""
    from networks.lora import LoRANetwork

    model = FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32)
    net = LoRANetwork(model, "flux", 4, 2.0)
    torch.manual_seed(1)
    for m in net.lora_modules():
        nn.init.normal_(m.lora_up.weight, std=0.05)
    net.save(str(path))
    return net


def test_sd_scripts_flux_lora_loads_as_network_weights_and_in_generate(tiny_set, tmp_path):
    from safetensors import safe_open

    from networks.lora import LoRANetwork
    from test_train_lora import flux_args
    from tools import generate

    path = tmp_path / "sd_scripts.safetensors"
    reference = sd_scripts_flux_lora(tiny_set, path)
    with safe_open(str(path), "pt") as f:
        keys = set(f.keys())
    assert {"lora_unet_double_blocks_0_img_mod_lin.alpha", "lora_unet_single_blocks_0_modulation_lin.alpha"} <= keys

    # A network built without modulation adapts to the file: it adds the modules the file names.
    model = FluxFamily(tiny_set["flux_bfl"]).load_transformer(torch.float32)
    narrow = LoRANetwork(model, "flux", 4, 2.0, network_args={"train_modulation": False})
    counts = narrow.load_weights(str(path), strict=False)
    assert counts["added"] == sum("mod" in m.name for m in reference.lora_modules()) > 0
    assert {k: v for k, v in narrow.state_dict().items()}.keys() == reference.state_dict().keys()

    assert train_lora.main(flux_args(tiny_set, tmp_path / "train", "--max_train_steps", "1", "--sample_prompts", "",
                                     "--network_dim", "4", "--network_alpha", "2", "--network_weights", str(path),
                                     "--network_args", "train_modulation=false")) == 0
    assert generate.main(["--model_type", "flux", "--model", tiny_set["flux_bfl"], "--ae", tiny_set["flux_vae_single"],
                          "--clip_l", tiny_set["clip_l"], "--t5xxl", tiny_set["t5xxl"], "--prompt", "a red square",
                          "--width", "64", "--height", "64", "--steps", "2", "--dtype", "fp32", "--lora", f"{path}:0.7",
                          "--out", str(tmp_path / "gen")]) == 0
    assert len(os.listdir(tmp_path / "gen")) == 1


def test_changing_the_t5_token_length_re_encodes_every_cached_caption(tiny_set, tmp_path, monkeypatch):
    from test_train_lora import flux_args

    from library.data import caches

    encoded = []
    real = caches.cache_text

    def recording(items, encode_fn, *a, **k):
        n = real(items, encode_fn, *a, **k)
        encoded.append((n, [caches.read_cache(it.text_cache)["t5"].shape[0] for it in items]))
        return n

    monkeypatch.setattr("library.training.diffusion_task.cache_text", recording)
    common = ["--max_train_steps", "1", "--sample_prompts", "", "--cache_text_encoder_outputs_to_disk", "true"]
    dataset_copy = tmp_path / "data"
    import shutil

    shutil.copytree(os.path.dirname(tiny_set["dataset_config"]), dataset_copy)
    cfg = dataset_copy / "dataset.toml"
    cfg.write_text(cfg.read_text().replace(os.path.dirname(tiny_set["dataset_config"]), str(dataset_copy)))
    for length in ("32", "16", "16"):
        assert train_lora.main(flux_args(tiny_set, tmp_path / "out", "--dataset_config", str(cfg), *common,
                                         "--t5xxl_max_token_length", length)) == 0
    (n32, lengths32), (n16, lengths16), (again, _) = encoded
    assert lengths32 == [32] * 8 and lengths16 == [16] * 8
    assert n16 == 8 and again == 0  # a new length re-encodes all; the same length reuses all


@pytest.mark.parametrize("model_type, key", [
    ("flux", "ae"), ("flux", "clip_l"), ("flux", "t5xxl"), ("flux", "pretrained_model_name_or_path"),
    ("qwen_image", "ae"), ("qwen_image", "text_encoder"), ("qwen_image", "pretrained_model_name_or_path"),
])
def test_a_missing_model_path_is_named_before_anything_loads(tiny_set, tmp_path, capsys, model_type, key):
    paths = {"flux": {"pretrained_model_name_or_path": tiny_set["flux_bfl"], "ae": tiny_set["flux_vae_single"],
                      "clip_l": tiny_set["clip_l"], "t5xxl": tiny_set["t5xxl"]},
             "qwen_image": {"pretrained_model_name_or_path": tiny_set["qwen_image"], "ae": tiny_set["qwen_image_vae"],
                            "text_encoder": tiny_set["qwen_image_text_encoder"]}}[model_type]
    argv = ["--model_type", model_type, "--dataset_config", tiny_set["dataset_config"], "--output_dir", str(tmp_path / "o"),
            "--cache_latents_to_disk", "true", "--cache_text_encoder_outputs_to_disk", "true"]
    for k, v in paths.items():
        if k != key:
            argv += [f"--{k}", v]
    capsys.readouterr()
    assert train_lora.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"key '{key}' is required" in err[0], err
    assert not (tmp_path / "o").exists() or not os.listdir(tmp_path / "o")
