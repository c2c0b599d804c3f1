"""The command lines of train_lora.py and tools/: abbreviated flags are refused, and --help or a bad
flag is answered before torch loads."""

import importlib
import json
import subprocess
import sys

import pytest

from tools.cli import ROOT, command_line_scripts

# script -> (a command line its parser takes, the same with one flag abbreviated)
ABBREVIATED = {
    "train_lora.py": (["--learning_rate", "1e-3"], ["--learning_rat", "1e-3"]),
    "tools/caption_images.py": (["--model", "m", "--images", "i", "--batch_size", "2"],
                                ["--model", "m", "--images", "i", "--batch_siz", "2"]),
    "tools/check_dataset.py": (["d.toml", "--max_tokens", "5"], ["d.toml", "--max_token", "5"]),
    "tools/concept_demo.py": (["--config_file", "c", "--seed", "1"], ["--config_file", "c", "--se", "1"]),
    "tools/combine_loras.py": (["--lora", "a", "--save_to", "o"], ["--lora", "a", "--save_t", "o"]),
    "tools/convert_lora.py": (["in", "out", "--to", "kohya"], ["in", "out", "--t", "kohya"]),
    "tools/extract_lora.py": (["--model", "m", "--tuned", "t", "--save_to", "o"], ["--model", "m", "--tune", "t", "--save_to", "o"]),
    "tools/generate.py": (["--model_type", "flux", "--model", "m", "--ae", "a"], ["--model_typ", "flux", "--model", "m", "--ae", "a"]),
    "tools/llm_quickstart.py": (["--max_steps", "1"], ["--max_step", "1"]),
    "tools/lora_info.py": (["l.safetensors", "--json"], ["l.safetensors", "--js"]),
    "tools/make_tiny_dataset.py": (["--out", "o", "--count", "2"], ["--out", "o", "--coun", "2"]),
    "tools/make_tiny_models.py": (["--out", "o", "--seed", "1"], ["--out", "o", "--se", "1"]),
    "tools/merge_lora.py": (["--model", "m", "--lora", "l", "--save_to", "o"], ["--model", "m", "--lora", "l", "--save_t", "o"]),
    "tools/pretrain_tiny_base.py": (["--out", "o", "--dit_steps", "2"], ["--out", "o", "--dit_step", "2"]),
    "tools/convert_config.py": (["c.toml", "--model_type", "flux"], ["c.toml", "--model_typ", "flux"]),
    "tools/plan_memory.py": (["--preset", "flux1-dev", "--vram", "16"], ["--preset", "flux1-dev", "--vra", "16"]),
    "tools/plot_lr.py": (["log.csv", "--smooth", "0.5"], ["log.csv", "--smoo", "0.5"]),
    "tools/plot_timesteps.py": (["--config_file", "c", "--draws", "200"], ["--config_file", "c", "--draw", "200"]),
    "tools/post_hoc_ema.py": (["a", "b", "--save_to", "o"], ["a", "b", "--save_t", "o"]),
    "tools/precision_doctor.py": (["--model_type", "flux", "--model", "m", "--skip_fp32"],
                                  ["--model_type", "flux", "--model", "m", "--skip_fp"]),
    "tools/precision_matrix.py": (["--config_file", "c", "--max_items", "2"], ["--config_file", "c", "--max_item", "2"]),
    "tools/resize_lora.py": (["--lora", "l", "--save_to", "o", "--new_rank", "2"], ["--lora", "l", "--save_to", "o", "--new_ran", "2"]),
    "tools/webui.py": (["--port", "7861", "--host", "127.0.0.1"], ["--por", "7861", "--host", "127.0.0.1"]),
}


def build_parser(script: str):
    """The script's own parser-building function (train_lora.py's lives with the config schema)."""
    if script == "train_lora.py":
        return importlib.import_module("library.training.config").build_parser
    return importlib.import_module(script[: -len(".py")].replace("/", ".")).build_parser


def parse_error(parser, argv, capsys) -> str | None:
    """None when `argv` parses, else the error: argparse prints it and exits 2, the tools' Parser raises it."""
    try:
        parser.parse_args(argv)
    except ValueError as e:
        return str(e)
    except SystemExit as e:
        assert e.code == 2
        return capsys.readouterr().err
    return None


def test_every_command_line_is_covered():
    assert sorted(ABBREVIATED) == sorted(command_line_scripts())


@pytest.mark.parametrize("script", sorted(ABBREVIATED))
def test_abbreviated_flags_are_refused(script, capsys):
    full, abbreviated = ABBREVIATED[script]
    assert parse_error(build_parser(script)(), full, capsys) is None
    flag, meant = next((a, f) for a, f in zip(abbreviated, full) if a != f)
    error = parse_error(build_parser(script)(), abbreviated, capsys)
    assert error is not None, f"{flag} was taken for {meant}"
    assert flag in error or meant in error  # unrecognized, or the flag it stood for is missing


@pytest.mark.parametrize("script", ["tools/generate.py", "tools/merge_lora.py", "tools/extract_lora.py",
                                    "tools/convert_lora.py", "tools/resize_lora.py", "tools/combine_loras.py",
                                    "tools/post_hoc_ema.py"])
def test_a_peers_flags_name_ours(script, capsys):
    """A musubi-tuner / sd-scripts command line (--dit, --from_file, --model_org) was argparse's "required: --model"
    or "unrecognized arguments". Each peer flag is named with ours, and none of them is a flag of the tool's own."""
    parser = build_parser(script)()
    peers = parser.peer_flags
    assert peers and not set(peers) & set(parser._option_string_actions)
    error = parse_error(parser, [word for flag in peers for word in (flag, "x")], capsys)
    assert error.startswith("sd-scripts / musubi-tuner flags, which this tool names otherwise: ")
    assert all(f"{flag} -> {ours}" in error for flag, ours in peers.items())


# Runs each script given as the shell would (as __main__, sys.argv set) with --help and with a bad
# flag, in this one process, and prints {script: [exit status of each, heavy modules loaded]}. A
# script that imported one leaves it loaded for the next: only a clean run proves every script.
PARSE_ONLY = """
import contextlib, io, json, runpy, sys
results = {}
for script in sys.argv[1:]:
    codes = []
    for flag in ("--help", "--no_such_flag"):
        sys.argv = [script, flag]
        err = io.StringIO()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            try:
                runpy.run_path(script, run_name="__main__")
                codes.append(None)
            except SystemExit as e:
                codes.append(e.code)
    said = err.getvalue().splitlines()  # the bad flag's
    one_line = len(said) == 1 and said[0].startswith("error: ")  # the flag, or the required ones missing
    heavy = sorted(m for m in ("torch", "diffusers", "transformers") if m in sys.modules)
    results[script] = [*codes, one_line or said, heavy]
print(json.dumps(results))
"""


def test_help_and_bad_flags_are_answered_before_torch_loads():
    scripts = command_line_scripts()
    done = subprocess.run([sys.executable, "-c", PARSE_ONLY, *scripts], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    # a bad flag is one line naming it (generate.py, plan_memory.py, plot_lr.py, webui.py, ... printed argparse's
    # whole usage before their "error:" line)
    assert json.loads(done.stdout) == {script: [0, 2, True, []] for script in scripts}


def test_output_into_a_closed_pipe_ends_a_tool_as_it_ends_cat(tmp_path):
    """Old: `resize_lora.py ... | head -1` (or lora_info) printed a BrokenPipeError traceback once head had gone,
    and exited 1 after the file was written. A reader closed before the first line: the tool ends by SIGPIPE,
    as cat does, and says nothing."""
    import signal

    for script in ("tools/lora_info.py", "tools/convert_lora.py"):
        process = subprocess.Popen([sys.executable, script, "--help"], cwd=ROOT, stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
        process.stdout.close()  # long before its first line: the interpreter starts in ~0.1 s
        assert (process.wait(timeout=120), process.stderr.read()) == (-signal.SIGPIPE, b""), script
        process.stderr.close()


# The LoRA tools' modules as their real runs import them (after parsing): torch, our library, no
# diffusers or transformers (seconds of start-up each; library/models/latents.py keeps the latent
# packing the families import out of library/models/vae.py, which loads diffusers).
LORA_TOOLS = ("lora_info", "convert_lora", "resize_lora", "combine_loras", "merge_lora", "extract_lora", "post_hoc_ema")
IMPORT_ONLY = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module("tools." + name)
print(json.dumps(sorted(m for m in ("diffusers", "transformers") if m in sys.modules)))
"""


def test_lora_tools_run_without_loading_diffusers_or_transformers():
    done = subprocess.run([sys.executable, "-c", IMPORT_ONLY, *LORA_TOOLS], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == []


@pytest.mark.parametrize("argv, message", [
    (["--size", "0"], "--size 0: the side must be a multiple of 16"),  # was PIL's "cannot write empty image"
    (["--count", "-3"], "--count -3: must be >= 1"),  # was "wrote -3 images" (and 13 written)
    (["--count", "0"], "--count 0: must be >= 1"),  # was 8 written
    (["--count", "20"], "--count 20: the plain set has 16 different images"),  # was "wrote 20 images" (16 written)
    (["--layered", "--count", "17"], "--count 17: the layered set has 16"),  # was 17 with duplicates
    (["--edit", "--concept"], "not allowed with argument"),  # was one of the two, silently
    (["--concept", "--trigger", ""], "--trigger '': one word"),
    (["--trigger", "ohwx"], "--trigger ohwx: for --concept sets"),  # was ignored
    (["--out", ""], "--out '': expected a folder"),  # wrote into the current folder
])
def test_make_tiny_dataset_refuses_a_bad_value_in_one_line(tmp_path, capsys, argv, message):
    from tools import make_tiny_dataset

    out = [] if "--out" in argv else ["--out", str(tmp_path / "d")]
    assert make_tiny_dataset.main([*out, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "d").exists()


def test_every_command_line_exits_without_the_interpreters_last_collections():
    """Each script's last line is exit_without_collecting: tearing down torch, diffusers and transformers'
    modules walked their objects again (2.2 s after a trainer's last line on 2 idle cores, 0.4 s frozen)."""
    import gc

    from library.errors import exit_without_collecting

    for script in command_line_scripts():
        with open(f"{ROOT}/{script}") as f:
            main_block = f.read().split('\nif __name__ == "__main__":\n')[-1]
        last = main_block.rstrip().splitlines()[-1].strip()
        assert last.startswith("exit_without_collecting("), script
        # a tool's main run by it: a Ctrl-C is one line (run_main); train_lora says its own
        assert last == "exit_without_collecting(main)" or script == "train_lora.py", script
    frozen = gc.get_freeze_count()
    with pytest.raises(SystemExit) as exited:  # it freezes what lives in this worker, as tests/conftest.py does
        exit_without_collecting(3)
    assert exited.value.code == 3 and gc.get_freeze_count() > frozen


def test_run_main_gives_mains_status_0_for_what_it_made_and_130_for_a_ctrl_c(capsys):
    from library.errors import run_main

    def interrupted():
        raise KeyboardInterrupt

    assert (run_main(lambda: 2), run_main(lambda: ["made"]), run_main(interrupted)) == (2, 0, 130)
    assert capsys.readouterr().err == "interrupted\n"


# Run as a tool's __main__ block: a Ctrl-C while its output is half written (save_file interrupted).
INTERRUPTED_TOOL = """
import runpy, sys
import library.io

def interrupted(tensors, path, metadata=None):
    open(path, "wb").write(b"half")
    raise KeyboardInterrupt

library.io.save_file = interrupted
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_a_ctrl_c_in_a_tool_is_one_line_and_status_130_leaving_no_partial_output(tmp_path):
    """Every tool printed Python's traceback for a Ctrl-C (train_lora alone said one line): now the tools' shared
    exit (exit_without_collecting(main)) says 'interrupted' and exits 130; the half-written output is removed."""
    import torch
    from safetensors.torch import save_file

    m = "lora_unet_double_blocks_0_img_attn_proj"
    save_file({f"{m}.lora_down.weight": torch.randn(2, 64), f"{m}.lora_up.weight": torch.randn(64, 2),
               f"{m}.alpha": torch.tensor(1.0)}, str(tmp_path / "k.safetensors"))
    argv = [f"{ROOT}/tools/convert_lora.py", str(tmp_path / "k.safetensors"), str(tmp_path / "d.safetensors"),
            "--to", "diffusers"]
    done = subprocess.run([sys.executable, "-c", INTERRUPTED_TOOL, *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert (done.returncode, done.stderr) == (130, "interrupted\n"), done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["k.safetensors"]


def test_generates_guidance_scale_hint_says_where_musubi_tuners_scale_reads_otherwise():
    """musubi-tuner's --guidance_scale on Krea 2 is standard CFG, ours' guidance + 1 (its 5.5 is ours' 4.5), and runs
    only above 1: the hint said --guidance alone, so a ported Turbo command (--guidance_scale 1) ran CFG here."""
    from tools import generate

    said = generate.peer_flags()["--guidance_scale"]
    assert "Krea 2: its value - 1, CFG only above 1 there" in said and "Z-Image: its value, CFG only above 1" in said


def test_a_tools_path_from_the_home_folder_is_read_as_the_shell_reads_it(monkeypatch, tmp_path):
    """The web UI starts generate.py without a shell, handing it a job's TOML paths as written: `~/flux.safetensors`
    (the trainer reads `~` there) was looked for in a folder named '~'. `--flag=~/x`, which the shell leaves, too.
    A prompt is free text and a `~name` a word: both stay as typed."""
    monkeypatch.setenv("HOME", str(tmp_path))
    parser = build_parser("tools/generate.py")()
    args = parser.parse_args(["--model_type", "flux", "--model", "~/flux.safetensors", "--ae=~/ae.safetensors",
                              "--out", "~", "--prompt", "~/a cat", "--prompt=~/a dog", "--lora", "~/l.safetensors:0.5"])
    assert (args.model, args.ae, args.out) == (f"{tmp_path}/flux.safetensors", f"{tmp_path}/ae.safetensors", str(tmp_path))
    assert args.prompt == ["~/a cat", "~/a dog"]
    assert args.lora == [f"{tmp_path}/l.safetensors:0.5"]
    name = build_parser("tools/make_tiny_dataset.py")().parse_args(["--out", "~x", "--trigger", "~/zxq"])
    assert (name.out, name.trigger) == ("~x", "~/zxq")
