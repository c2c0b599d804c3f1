"""Schedule-free optimizers (schedulefree's AdamWScheduleFree and its kin, sd-scripts' and musubi-tuner's names):
stepped in train mode, their averaged weights read (saved, sampled, validated) in eval mode; the keys they do not
run with refused before caching; a resumed run bit-identical to a straight one."""

import pytest
import torch
from safetensors.torch import load_file

import train_lora
from library.training.config import ConfigError, load_config
from library.training.optim import create_optimizer, effective_lrs
from library.training.schedule_free import OptimizerModes, is_schedule_free
from tests.test_train_lora import flux_args, read_losses

schedulefree = pytest.importorskip("schedulefree")
STEPS = ["--optimizer_type", "AdamWScheduleFree", "--optimizer_args", "warmup_steps=2", "betas=(0.8,0.99)",
         "--learning_rate", "3e-3", "--sample_prompts", ""]


def test_the_peers_names_build_schedulefrees_optimizers():
    """They were refused ("this trainer does not switch" its modes) though sd-scripts and musubi-tuner train them."""
    p = torch.nn.Parameter(torch.zeros(2, 2))
    for name, cls in (("AdamWScheduleFree", schedulefree.AdamWScheduleFree), ("radamschedulefree", schedulefree.RAdamScheduleFree),
                      ("SGDScheduleFree", schedulefree.SGDScheduleFree),
                      ("schedulefree.AdamWScheduleFree", schedulefree.AdamWScheduleFree)):
        built = create_optimizer([{"params": [p]}], name, 1e-3, {})
        assert type(built) is cls and is_schedule_free(built)
    assert not is_schedule_free(create_optimizer([{"params": [p]}], "AdamW", 1e-3, {}))


def test_reading_switches_to_the_average_once_and_back(tmp_path):
    p = torch.nn.Parameter(torch.zeros(3))
    optimizer = schedulefree.AdamWScheduleFree([p], lr=0.1, warmup_steps=2)
    modes = OptimizerModes(optimizer)
    modes.train()
    for _ in range(3):
        p.grad = torch.ones(3)
        optimizer.step()
    y = p.detach().clone()
    with modes.reading():
        x = p.detach().clone()
        with modes.reading():  # nested (a save while sampling): no second switch
            assert torch.equal(p, x)
        assert torch.equal(p, x)
    assert not torch.equal(x, y) and torch.equal(p, y)  # y put back as it was (train() gave it within ~1 ulp)
    z = optimizer.state[p]["z"]  # x = y + (1 - 1/beta1)(z - y): the average the step keeps
    assert torch.allclose(x, torch.lerp(y, z, 1 - 1 / 0.9), atol=1e-7)
    # the lr logged is the one its own warmup applied at the last step, not the set one
    assert effective_lrs(optimizer) == {"lr/group0": pytest.approx(0.1)}
    fresh = schedulefree.AdamWScheduleFree([torch.nn.Parameter(torch.zeros(1))], lr=0.1, warmup_steps=4)
    OptimizerModes(fresh).train()
    fresh.param_groups[0]["params"][0].grad = torch.ones(1)
    fresh.step()
    assert effective_lrs(fresh) == {"lr/group0": pytest.approx(0.1 / 4)}


@pytest.mark.parametrize("extra, message", [
    (["--lr_scheduler", "cosine"], 'it runs at a constant learning_rate, not lr_scheduler = "cosine"'),
    (["--lr_warmup_steps", "10"], 'its warmup is its own, optimizer_args = ["warmup_steps=N"], not lr_warmup_steps = 10'),
    (["--ema_decay", "0.99"], "ema_decay would average the point it steps at"),
    (["--optimizer_args", "betas=(0.9,)"], "optimizer_args (betas=(0.9,)) do not fit AdamWScheduleFree: its first step"),
])
def test_what_it_does_not_run_with_is_refused_before_caching(tiny_set, tmp_path, extra, message):
    with pytest.raises(ConfigError) as error:
        load_config(flux_args(tiny_set, tmp_path, *STEPS, *extra))
    assert message in str(error.value), error.value


def test_a_run_saves_the_average_and_resumes_bit_identical(tiny_set, tmp_path, monkeypatch):
    """The LoRA written is the optimizer's average x (eval mode), x = lerp(y, z, 1 - 1/beta1) from the point y it
    steps at and its z, read off the trainer after the run; the state holds y in train mode. A run resumed from
    a 2-step run's state ends where the straight 4-step run ends, bit for bit, though only the first saved at
    step 2: the weights it steps at are put back after each read (eval() then train() left them ~1 ulp off, 3e-8
    in the LoRA, where the straight run did not save at step 2)."""
    trainers = []
    run = train_lora.Trainer.run
    monkeypatch.setattr(train_lora.Trainer, "run", lambda self: trainers.append(self) or run(self))
    straight, short = tmp_path / "straight", tmp_path / "short"
    assert train_lora.main(flux_args(tiny_set, straight, *STEPS, "--max_train_steps", "4")) == 0
    trainer = trainers[-1]
    optimizer = trainer.optimizer.optimizer  # accelerate's wrapper's
    final = load_file(str(straight / "tiny_flux_lora.safetensors"))
    trained = trainer.task.named_trainable_parameters()
    assert set(trained) <= set(final) and optimizer.param_groups[0]["train_mode"]
    for name, y in trained.items():
        x = torch.lerp(y.detach(), optimizer.state[y]["z"], 1 - 1 / 0.8)
        assert torch.allclose(final[name], x, rtol=1e-6, atol=1e-9), name
        assert not torch.allclose(final[name], y.detach(), rtol=1e-4, atol=1e-7), name  # (the old line's y)

    assert train_lora.main(flux_args(tiny_set, short, *STEPS, "--max_train_steps", "2",
                                     "--save_state_on_train_end", "true")) == 0
    assert all(g["train_mode"] for g in torch.load(short / "tiny_flux_lora-state" / "optimizer.pt",
                                                      weights_only=True)["param_groups"])
    assert train_lora.main(flux_args(tiny_set, short, *STEPS, "--max_train_steps", "4",
                                     "--resume", str(short / "tiny_flux_lora-state"))) == 0
    resumed = load_file(str(short / "tiny_flux_lora.safetensors"))
    assert all(torch.equal(final[k], resumed[k]) for k in final)
    assert read_losses(short) == read_losses(straight)
