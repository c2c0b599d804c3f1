"""EMA of the trained weights (ema_decay, ema_warmup, ema_start_step, sample_with_ema): the _ema
file equals an EMA computed here from the raw weights recorded after every optimizer step, loads
through our loader with the outputs the EMA tensors give, is bit-identical across a resume, works
for LoRA, DoRA, LyCORIS, Qwen-Image and the LLM, and bad values are one-line config errors."""

import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import train_lora
from library.training.config import ConfigError, load_config
from library.training.ema import TrainableEMA, ema_decay_at
from tests.test_train_llm import llm_args
from tests.test_train_lora import flux_args

ADAMW = ["--optimizer_type", "AdamW", "--optimizer_args", "--learning_rate", "3e-3", "--sample_prompts", "",
         "--save_precision", "fp32"]


def hand_ema(weights: list[dict], decay: float, warmup: bool = False, start: int = 0, inv_gamma: float = 1.0,
             power: float = 2 / 3, skipped: tuple = ()) -> dict:
    """The oracle, in float64: weights[0] before training, weights[s] after optimizer step s; no
    update after the `skipped` steps. Warmup: diffusers' EMAModel(use_ema_warmup=True)."""
    ema = {k: v.double() for k, v in weights[0].items()}
    for s in range(1, len(weights)):
        if s in skipped:
            continue
        t = s - start - 1
        d = 0.0 if s <= start else (min(decay, 1 - (1 + t / inv_gamma) ** -power) if warmup else decay)
        ema = {k: d * ema[k] + (1 - d) * weights[s][k].double() for k in ema}
    return ema


@pytest.fixture
def recorded(monkeypatch):
    """The trainable tensors (the network's state dict, the file layout) before training and after
    each optimizer step, as the loop leaves them: weights[s] is after step s."""
    weights = []
    real_init, real_finish = train_lora.Trainer.__init__, train_lora.Trainer.finish_step

    def snapshot(trainer):
        return {k: v.detach().double().clone() for k, v in trainer.task.trainable_tensors().items()}

    def init(self, args, *rest):
        real_init(self, args, *rest)
        weights.clear()
        weights.append(snapshot(self))

    def finish(self, loss, *stepped):
        real_finish(self, loss, *stepped)
        assert len(weights) == self.step  # one record per optimizer step
        weights.append(snapshot(self))

    monkeypatch.setattr(train_lora.Trainer, "__init__", init)
    monkeypatch.setattr(train_lora.Trainer, "finish_step", finish)
    return weights


def assert_matches(path: str, expected: dict):
    saved = load_file(path)
    assert set(saved) == set(expected)
    for k, v in expected.items():
        torch.testing.assert_close(saved[k].double(), v, rtol=1e-5, atol=1e-7, msg=k)


def max_change(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


# ----------------------------------------------------------------------------------------------
# The decay schedule and the update, alone


def test_warmup_is_diffusers_ema_warmup_with_its_first_update_copying():
    """ema_warmup = diffusers' EMAModel(use_ema_warmup=True, inv_gamma, power, update_after_step =
    ema_start_step): the same decay after every step (0 = a copy up to the first update after the
    start), and the same EMA of the same weights."""
    from diffusers.training_utils import EMAModel

    steps = [1, 2, 3, 4, 5, 10, 100, 1000, 50_000]
    for start, shape in ((0, {}), (3, {"inv_gamma": 2.0, "power": 0.75})):
        p = torch.nn.Parameter(torch.zeros(3))
        ema = TrainableEMA({"w": p}, 0.999, warmup=True, start_step=start, **shape)
        ref = EMAModel([p], decay=0.999, use_ema_warmup=True, update_after_step=start, **shape)
        assert [ema.decay_at_step(s) for s in steps] == pytest.approx([ref.get_decay(s) for s in steps], abs=1e-12)
        for s in range(1, 8):
            p.data.copy_(torch.randn(3))
            ema.update(s)
            ref.step([p])
            torch.testing.assert_close(ema.shadow["w"], ref.shadow_params[0], rtol=1e-6, atol=1e-7)
    assert ema_decay_at(0.999, 0, warmup=False) == 0.999
    assert ema_decay_at(0.999, 1, warmup=True) == pytest.approx(1 - 2 ** (-2 / 3))
    assert ema_decay_at(0.999, 10**6, warmup=True) == 0.999  # capped at ema_decay


def test_update_and_swap_on_a_bf16_parameter():
    """float32 EMA of a bf16 weight; swapping in and back leaves the weight bit-identical."""
    p = torch.nn.Parameter(torch.tensor([1.0, -2.0], dtype=torch.bfloat16))
    ema = TrainableEMA({"w": p}, 0.5)
    values = [torch.tensor([3.0, 5.0]), torch.tensor([-1.0, 0.5])]
    for step, v in enumerate(values, 1):
        p.data.copy_(v)
        ema.update(step)
    expected = 0.5 * (0.5 * torch.tensor([1.0, -2.0]) + 0.5 * values[0]) + 0.5 * values[1]  # [0.5, 1.0]
    assert ema.shadow["w"].dtype == torch.float32 and torch.equal(ema.shadow["w"], expected)
    with ema.swapped_in():
        assert torch.equal(p.float(), expected)
    assert torch.equal(p, values[1].bfloat16())


# ----------------------------------------------------------------------------------------------
# Training runs on the tiny FLUX


def test_ema_equals_hand_computed_ema_of_each_optimizer_step(tiny_set, tmp_path, recorded):
    """Warmup (decay 0 (a copy), 0.26, 0.41, 0.50, then capped at 0.55) with 2 micro-batches per
    step: an EMA updated per micro-batch or with another decay would miss the oracle."""
    out = tmp_path / "run"
    args = flux_args(tiny_set, out, *ADAMW, "--max_train_steps", "6", "--gradient_accumulation_steps", "2",
                     "--ema_decay", "0.55", "--ema_warmup", "true", "--ema_inv_gamma", "2", "--ema_power", "0.75")
    assert train_lora.main(args) == 0
    assert len(recorded) == 7
    expected = hand_ema(recorded, 0.55, warmup=True, inv_gamma=2.0, power=0.75)
    assert_matches(str(out / "tiny_flux_lora_ema.safetensors"), expected)
    assert_matches(str(out / "tiny_flux_lora.safetensors"), recorded[-1])  # the LoRA itself stays raw
    assert max_change(expected, recorded[-1]) > 1e-4  # the EMA is not the raw weights
    with safe_open(str(out / "tiny_flux_lora_ema.safetensors"), "pt") as f:
        meta = f.metadata()
    assert (meta["ss_ema"], meta["ss_ema_decay"], meta["ss_ema_warmup"]) == ("true", "0.55", "true")
    assert (meta["ss_ema_inv_gamma"], meta["ss_ema_power"]) == ("2.0", "0.75")
    assert meta["ss_network_module"] == "networks.lora" and meta["ss_max_train_steps"] == "6"


def test_no_ema_update_on_a_step_the_fp16_grad_scaler_skips(tiny_set, tmp_path, recorded, monkeypatch):
    """fp16's GradScaler (accelerate's, on the CPU here) finds an inf gradient in step 2 and skips
    it: the weights stay, and so must the EMA (an update would pull it towards them once more)."""
    from accelerate.optimizer import AcceleratedOptimizer

    init = train_lora.Trainer.__init__  # `recorded`'s

    def with_scaler(self, args, *rest):  # what accelerate's fp16 on a GPU sets up
        init(self, args, *rest)
        self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        self.optimizer = AcceleratedOptimizer(self.optimizer.optimizer, False, self.accelerator.scaler)
        backward = self.accelerator.backward

        def inf_in_step_2(loss, **kwargs):
            backward(loss, **kwargs)
            if self.step == 1:
                next(iter(self.task.trainable_parameters())).grad.fill_(float("inf"))

        self.accelerator.backward = inf_in_step_2

    monkeypatch.setattr(train_lora.Trainer, "__init__", with_scaler)
    out = tmp_path / "run"
    assert train_lora.main(flux_args(tiny_set, out, *ADAMW, "--max_train_steps", "3", "--ema_decay", "0.5")) == 0
    assert max_change(recorded[2], recorded[1]) == 0 and max_change(recorded[3], recorded[2]) > 1e-5  # a real skip
    assert_matches(str(out / "tiny_flux_lora_ema.safetensors"), hand_ema(recorded, 0.5, skipped=(2,)))


def straight_args(tiny_set, out, *extra):
    """Decay 0.5 after ema_start_step 2; a save (LoRA + _ema) at step 3; the state on."""
    return flux_args(tiny_set, out, *ADAMW, "--ema_decay", "0.5", "--ema_start_step", "2", "--save_every_n_steps",
                     "3", "--save_state", "true", *extra)


@pytest.fixture(scope="module")
def straight_run(tiny_set, tmp_path_factory):
    out = tmp_path_factory.mktemp("ema") / "straight"
    weights, real = [], train_lora.Trainer.finish_step

    def finish(self, loss, *stepped):  # as `recorded`, at module scope (the run is shared by three tests)
        real(self, loss, *stepped)
        weights.append({k: v.detach().double().clone() for k, v in self.task.trainable_tensors().items()})

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_lora.Trainer, "finish_step", finish)
        assert train_lora.main(straight_args(tiny_set, out, "--max_train_steps", "6")) == 0
    return out, weights


def test_start_step_and_intermediate_ema_file(straight_run):
    out, after = straight_run  # after[s - 1]: after step s; steps 1-2 follow the raw weights
    placeholder = {k: torch.zeros_like(v) for k, v in after[0].items()}  # ignored: step 1 <= start
    assert_matches(str(out / "tiny_flux_lora-step000003_ema.safetensors"), hand_ema([placeholder] + after[:3], 0.5, start=2))
    assert_matches(str(out / "tiny_flux_lora_ema.safetensors"), hand_ema([placeholder] + after, 0.5, start=2))
    assert_matches(str(out / "tiny_flux_lora-step000003.safetensors"), after[2])


def test_ema_file_loads_through_our_loader_with_the_ema_output(tiny_set, straight_run):
    """network_from_file (read_lora) on the tiny FLUX: each adapted Linear gives
    x W^T + b + (alpha / rank) x down^T up^T with the EMA tensors, computed here by hand."""
    from library.models.flux1.checkpoint import load_flux
    from networks.factory import network_from_file

    path = str(straight_run[0] / "tiny_flux_lora_ema.safetensors")
    ema = load_file(path)
    model = load_flux(tiny_set["flux_bfl"]).eval()
    network = network_from_file(model, "flux", path)
    network.apply()
    checked = 0
    for path_name, linear in model.named_modules():
        key = "lora_unet_" + path_name.replace(".", "_")
        if key + ".lora_down.weight" not in ema:
            continue
        down, up, alpha = ema[key + ".lora_down.weight"], ema[key + ".lora_up.weight"], ema[key + ".alpha"]
        xi = torch.randn(4, linear.in_features)
        bias = 0 if linear.bias is None else linear.bias
        by_hand = xi @ linear.weight.T + bias + (alpha / down.shape[0]) * (xi @ down.T @ up.T)
        torch.testing.assert_close(linear(xi), by_hand, rtol=1e-5, atol=1e-6)
        checked += 1
    assert checked == len(network.lora_modules()) == sum(k.endswith(".alpha") for k in ema) > 0
    network.remove()


def test_resumed_ema_is_bit_identical(tiny_set, tmp_path, straight_run, capsys):
    out = tmp_path / "resumed"
    assert train_lora.main(straight_args(tiny_set, out, "--max_train_steps", "4")) == 0
    state = load_file(str(out / "tiny_flux_lora-state" / "ema.safetensors"))
    assert state and all(v.dtype == torch.float32 for v in state.values())
    assert train_lora.main(straight_args(tiny_set, out, "--max_train_steps", "6", "--resume",
                                         str(out / "tiny_flux_lora-state"))) == 0
    for name in ("tiny_flux_lora_ema.safetensors", "tiny_flux_lora.safetensors"):
        a, b = load_file(str(out / name)), load_file(str(straight_run[0] / name))
        assert all(torch.equal(a[k], b[k]) for k in b), name
    # The other way round: a state with an EMA resumed without one. The old line dropped the EMA and
    # left the step-4 _ema file beside a later LoRA.
    capsys.readouterr()
    assert train_lora.main(flux_args(tiny_set, out, *ADAMW, "--save_every_n_steps", "3", "--save_state", "true",
                                     "--max_train_steps", "6", "--resume", str(out / "tiny_flux_lora-state"))) == 2
    assert "state was written with ema_decay = 0.5, this run has 0.0" in capsys.readouterr().err


def test_resume_with_ema_needs_a_state_with_ema(tiny_set, tmp_path, capsys):
    out = tmp_path / "run"
    plain = flux_args(tiny_set, out, *ADAMW, "--max_train_steps", "1", "--save_state", "true")
    assert train_lora.main(plain) == 0
    assert train_lora.main(plain + ["--ema_decay", "0.9", "--resume", str(out / "tiny_flux_lora-state")]) == 2
    assert "state was written with ema_decay = None, this run has 0.9" in capsys.readouterr().err


def test_samples_render_with_ema_weights_and_training_keeps_raw(tiny_set, tmp_path, recorded, monkeypatch):
    from library.training.diffusion_task import DiffusionTask

    seen = {}

    def render(self, out_dir, tag, stop=None, first=0):
        seen[tag] = {k: v.detach().double().clone() for k, v in self.trainable_tensors().items()}
        return []

    monkeypatch.setattr(DiffusionTask, "render_samples", render)
    out = tmp_path / "run"
    args = flux_args(tiny_set, out, *ADAMW, "--max_train_steps", "4", "--ema_decay", "0.6", "--sample_with_ema",
                     "true", "--sample_every_n_steps", "2", "--sample_prompts", tiny_set["sample_prompts"])
    assert train_lora.main(args) == 0
    assert sorted(seen) == ["final", "step000002"]  # step 4's are the final ones
    ema2 = hand_ema(recorded[:3], 0.6)
    assert max_change(seen["step000002"], ema2) < 1e-6 and max_change(ema2, recorded[2]) > 1e-4
    assert max_change(seen["final"], hand_ema(recorded, 0.6)) < 1e-6
    assert_matches(str(out / "tiny_flux_lora.safetensors"), recorded[-1])  # the raw weights came back


def test_llm_evals_use_the_ema_weights_as_its_final_one_does(tiny_set, tmp_path):
    """With sample_with_ema an LLM's eval at each eval_every_n_steps (its sample) ran on the raw weights
    and its final one on the EMA: at step 2 of 2 the two printed other val_loss numbers for one model."""
    import csv

    out = tmp_path / "lm"
    args = llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name", "lm",
                    "--optimizer_type", "AdamW", "--learning_rate", "1e-2", "--network_dim", "4", "--max_train_steps", "2",
                    "--eval_every_n_steps", "2", "--ema_decay", "0.5", "--sample_with_ema", "true")
    assert train_lora.main(args) == 0
    with open(out / "lm_eval.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["step"] for r in rows] == ["2", "final"] and rows[0]["val_loss"] == rows[1]["val_loss"]


# ----------------------------------------------------------------------------------------------
# Other networks and families


@pytest.mark.parametrize("kind", ["dora", "lokr", "qwen_image", "llm"])
def test_ema_for_dora_lycoris_qwen_image_and_llm(kind, tiny_set, tmp_path, recorded):
    out, name = tmp_path / kind, "tiny_flux_lora"
    ema = ["--ema_decay", "0.5", "--max_train_steps", "3", "--save_precision", "fp32"]
    if kind == "dora":
        args = flux_args(tiny_set, out, *ADAMW, "--network_args", "dora=True", *ema)
    elif kind == "lokr":
        args = flux_args(tiny_set, out, *ADAMW, "--network_module", "lycoris.kohya", "--network_args", "algo=lokr",
                         "factor=4", *ema)
    elif kind == "qwen_image":
        name = "qwen"
        args = ["--model_type", "qwen_image", "--pretrained_model_name_or_path", tiny_set["qwen_image"], "--ae",
                tiny_set["qwen_image_vae"], "--text_encoder", tiny_set["qwen_image_text_encoder"], "--dataset_config",
                tiny_set["dataset_config"], "--output_dir", str(out), "--output_name", name, "--mixed_precision", "no",
                "--network_dim", "4", "--optimizer_type", "AdamW", "--learning_rate", "1e-3", *ema]
    else:
        name = "lm"
        args = llm_args(tiny_set, out, "--pretrained_model_name_or_path", tiny_set["llm"], "--output_name", name,
                        "--optimizer_type", "AdamW", "--learning_rate", "1e-2", "--network_dim", "4",
                        "--save_format", "peft+kohya", *ema)
    assert train_lora.main(args) == 0
    if kind == "llm":  # the EMA goes out in every format the LoRA does
        assert (out / f"{name}_ema" / "adapter_config.json").exists() and (out / name / "adapter_config.json").exists()
    expected = hand_ema(recorded, 0.5)
    assert_matches(str(out / f"{name}_ema.safetensors"), expected)
    assert max_change(expected, recorded[-1]) > 1e-5
    if kind == "dora":
        assert any(k.endswith("dora_scale") for k in expected) and max_change(
            {k: v for k, v in expected.items() if k.endswith("dora_scale")}, recorded[-1]) > 0


# ----------------------------------------------------------------------------------------------
# Config errors


@pytest.mark.parametrize("extra, message", [
    (["--ema_decay", "1.0"], "key 'ema_decay' must be in \\[0, 1\\) \\(0 = off\\), got 1.0"),
    (["--ema_decay", "-0.5"], "key 'ema_decay' must be in \\[0, 1\\)"),
    (["--ema_decay", "0.9", "--ema_start_step", "-1"], "key 'ema_start_step' must be >= 0"),
    (["--sample_with_ema", "true"], "command line: key 'sample_with_ema' needs ema_decay > 0"),
    (["--ema_warmup"], "key 'ema_warmup' needs ema_decay > 0"),
    (["--ema_decay", "0.9", "--ema_warmup", "--ema_power", "0"], "key 'ema_power' must be > 0, got 0.0"),
    (["--ema_decay", "0.9", "--ema_warmup", "--ema_inv_gamma", "-1"], "key 'ema_inv_gamma' must be > 0, got -1.0"),
    (["--ema_decay", "0.9", "--ema_power", "0.75"], "command line: key 'ema_power' needs ema_warmup = true"),
    (["--ema_decay", "0.9", "--ema_device", "gpu"], "key 'ema_device' must be one of same, cpu"),
    # the old line trained and saved an _ema file equal to the raw LoRA
    (["--ema_decay", "0.9", "--ema_start_step", "5", "--max_train_steps", "5"],
     "command line: key 'ema_start_step' = 5 is not before max_train_steps = 5: the EMA would equal the raw weights"),
])
def test_ema_config_errors_name_the_key(tiny_set, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        load_config(flux_args(tiny_set, tmp_path, *extra))
    assert load_config(flux_args(tiny_set, tmp_path, "--ema_decay", "0.999", "--ema_warmup")).ema_decay == 0.999


def test_ema_keys_in_the_example_configs():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for name in ("flux1_dev_24gb.toml", "qwen_image.toml", "flux2_klein_4b.toml", "flux2_klein_9b.toml",
                 "flux2_dev.toml"):
        with open(os.path.join(root, "configs", name)) as f:
            text = f.read()
        assert all(k in text for k in ("ema_decay", "ema_warmup", "sample_with_ema")), name


def test_keep_last_n_saves_prunes_the_ema_files_too(tiny_set, tmp_path):
    out = tmp_path / "run"
    args = flux_args(tiny_set, out, *ADAMW, "--max_train_steps", "4", "--ema_decay", "0.9", "--save_every_n_steps",
                     "1", "--save_last_n_saves", "2")
    assert train_lora.main(args) == 0
    assert sorted(f for f in os.listdir(out) if f.endswith(".safetensors")) == [
        "tiny_flux_lora-step000002.safetensors", "tiny_flux_lora-step000002_ema.safetensors",
        "tiny_flux_lora-step000003.safetensors", "tiny_flux_lora-step000003_ema.safetensors",
        "tiny_flux_lora.safetensors", "tiny_flux_lora_ema.safetensors"]
