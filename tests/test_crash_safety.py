"""A process killed (SIGKILL: no handler, no cleanup) while it saves leaves the previous file under
the final name byte for byte; only a hidden `.<name>.*.tmp` may remain, and the next save
neither trips over it nor deletes anything that is not its own.

The writers are slowed inside the child process (a pause per MiB or per tensor) so that the kill
lands at a known point; the code under test, library.io.atomic_path and tools/merge_lora.py's
streaming writer, runs unchanged.
"""

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

import library.io
from library.models.flux1.checkpoint import load_flux
from library.models.qwen_image.model import load_qwen_image
from networks import lora_files
from library.training.config import load_config
from library.training.state import save_state
from networks.lora import LoRANetwork
from tools import merge_lora

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Child: write a ~25 MB LoRA through networks.lora_files.write_kohya (-> library.io.save_safetensors
# -> atomic_path). argv: path, mode ("mid_write": the bytes go out 1 MiB per 100 ms; "before_rename":
# the temporary file is complete and the child stalls where it would rename it into place).
LORA_WRITER = r"""
import os, sys, time
import torch
import library.io
from safetensors.torch import save as to_bytes
from networks import lora_files

path, mode = sys.argv[1], sys.argv[2]
if mode == "mid_write":
    def slow_save_file(tensors, filename, metadata=None):
        blob = to_bytes(tensors, metadata=metadata)
        with open(filename, "wb") as f:
            for i in range(0, len(blob), 1 << 20):
                f.write(blob[i : i + (1 << 20)])
                f.flush()
                time.sleep(0.1)
    library.io.save_file = slow_save_file
else:
    def stalled_replace(src, dst):
        open(path + ".stalled", "w").close()
        time.sleep(600)
    library.io.os.replace = stalled_replace
g = torch.Generator().manual_seed(1)
weights = {f"double_blocks.{i}.img_attn.qkv": lora_files.LoRAWeights(torch.randn(64, 3072, generator=g),
           torch.randn(9216, 64, generator=g), 64.0) for i in range(8)}
lora_files.write_kohya(weights, path)
"""

# Child: tools/merge_lora.py's main with a pause after each merged tensor; argv: merge arguments.
SLOW_MERGE = r"""
import sys, time
import tools.merge_lora as merge_lora
tensors = merge_lora.Plan.tensors
def slow_tensors(self, keys):
    for item in tensors(self, keys):
        time.sleep(0.05)
        yield item
merge_lora.Plan.tensors = slow_tensors
sys.exit(merge_lora.main(sys.argv[1:]))
"""


def start(script: str, *argv, log) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    with open(log, "w") as err:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-c", script, *map(str, argv)], cwd=ROOT, env=env,
                                stdout=subprocess.DEVNULL, stderr=err)


def kill_when(proc: subprocess.Popen, ready, log) -> None:
    """SIGKILL the child as soon as ready() holds; it must still be running then."""
    deadline = time.monotonic() + 120  # a safeguard against a hang, not a timing assertion
    while not ready():
        assert proc.poll() is None, f"child ended (status {proc.returncode}) before the kill point: {open(log).read()[-2000:]}"
        assert time.monotonic() < deadline, "kill point never reached"
        time.sleep(0.002)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL


def temporaries(folder, name) -> list[str]:
    return sorted(glob.glob(os.path.join(folder, f".{name}.*.tmp")))


def past_header(path) -> bool:
    """A safetensors file being written holds its header and at least one tensor byte."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
        return len(head) == 8 and os.path.getsize(path) > 8 + int.from_bytes(head, "little")
    except FileNotFoundError:
        return False


def snapshot(folder) -> dict[str, bytes]:
    """Every file below `folder` (hidden ones too) with its bytes."""
    out = {}
    for d, _, files in os.walk(folder):
        for f in files:
            path = os.path.join(d, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, folder)] = fh.read()
    return out


def small_lora(seed: float) -> dict:
    return {"double_blocks.0.img_attn.proj": lora_files.LoRAWeights(torch.full((2, 8), seed), torch.full((8, 2), seed), 2.0)}


# ----------------------------------------------------------------------------------------------
# LoRA files (the trainer's saves go through the same write_kohya -> save_safetensors)


@pytest.mark.parametrize("kill_point", ["mid_write", "before_rename"])
def test_sigkill_while_saving_a_lora_keeps_the_previous_file(tmp_path, kill_point):
    final = tmp_path / "lora.safetensors"
    lora_files.write_kohya(small_lora(1.0), str(final))
    (tmp_path / "notes.txt").write_text("a file the next save must not touch")
    before = snapshot(tmp_path)

    log = tmp_path.parent / f"{tmp_path.name}.log"
    child = start(LORA_WRITER, final, kill_point, log=log)
    if kill_point == "mid_write":
        kill_when(child, lambda: any(os.path.getsize(t) >= 2 << 20 for t in temporaries(tmp_path, final.name)), log)
    else:
        kill_when(child, lambda: os.path.exists(f"{final}.stalled"), log)
        os.remove(f"{final}.stalled")

    after = snapshot(tmp_path)
    leftovers = [os.path.basename(t) for t in temporaries(tmp_path, final.name)]
    assert len(leftovers) == 1  # the killed child's temporary, nothing else new
    assert {k: v for k, v in after.items() if k not in leftovers} == before  # the final name: old bytes
    stale = after[leftovers[0]]
    if kill_point == "mid_write":
        assert 2 << 20 <= len(stale) < 24 << 20  # really cut off mid-way (the whole file is ~25 MB)
    else:
        assert load_file(str(tmp_path / leftovers[0]))  # complete, yet never under the final name

    # The next save replaces the final name and leaves the stale temporary and other files alone.
    lora_files.write_kohya(small_lora(2.0), str(final))
    again = snapshot(tmp_path)
    assert sorted(again) == sorted(after) and again[leftovers[0]] == stale and again["notes.txt"] == after["notes.txt"]
    assert load_file(str(final))["lora_unet_double_blocks_0_img_attn_proj.lora_up.weight"].eq(2.0).all()


# ----------------------------------------------------------------------------------------------
# Merged checkpoints: tools/merge_lora.py streams its own writer into atomic_path / a temp folder


def lora_for(model, family, path) -> str:
    torch.manual_seed(0)
    net = LoRANetwork(model, family, 4, 4.0)
    with torch.no_grad():
        for m in net.lora_modules():
            m.lora_up.weight.normal_(0, 0.1)
    net.save(str(path))
    return str(path)


def test_sigkill_while_merging_into_a_file_keeps_the_previous_merge(tiny_set, tmp_path):
    lora = lora_for(load_flux(tiny_set["flux_bfl"]), "flux", tmp_path / "lora.safetensors")
    out = tmp_path / "merged" / "flux-merged.safetensors"
    assert merge_lora.main(["--model", tiny_set["flux_bfl"], "--lora", f"{lora}:0.5", "--save_to", str(out)]) == 0
    before = snapshot(out.parent)

    log = tmp_path / "merge.log"
    child = start(SLOW_MERGE, "--model", tiny_set["flux_bfl"], "--lora", f"{lora}:1.0", "--save_to", out, log=log)
    kill_when(child, lambda: any(past_header(t) for t in temporaries(out.parent, out.name)), log)

    after = snapshot(out.parent)
    leftovers = [os.path.basename(t) for t in temporaries(out.parent, out.name)]
    assert len(leftovers) == 1 and {k: v for k, v in after.items() if k not in leftovers} == before
    assert len(after[leftovers[0]]) < len(before[out.name])  # cut off mid-way


# Child: a tool's command line (tools/cli.check_command_line, as every tool's) writing a file through atomic_path,
# 1 MiB per 50 ms; argv: the file's path.
TOOL_WRITER = r"""
import argparse, sys, time
from library.atomic_files import atomic_path
from tools.cli import check_command_line
path, sys.argv = sys.argv[1], sys.argv[:1]
check_command_line(argparse.ArgumentParser)
with atomic_path(path) as tmp, open(tmp, "wb") as f:
    for _ in range(600):
        f.write(b"x" * (1 << 20))
        f.flush()
        time.sleep(0.05)
"""


def test_sigterm_while_a_tool_writes_removes_the_temporary_and_keeps_the_previous_file(tmp_path):
    """The web UI's Stop and `kill` send SIGTERM: a tool's command line exits 143 through its clean-ups. Python's
    default ended it where it stood, leaving the hidden temporary (a merged checkpoint's size at full size; the
    same for tools/merge_lora.py's safetensors and GGUF writes, checked by hand in the web UI)."""
    out = tmp_path / "merged.safetensors"
    out.write_bytes(b"the previous merge")
    before = snapshot(tmp_path)
    log = tmp_path.parent / f"{tmp_path.name}.log"
    child = start(TOOL_WRITER, out, log=log)
    deadline = time.monotonic() + 120  # a safeguard against a hang, not a timing assertion
    while not any(os.path.getsize(t) >= 2 << 20 for t in temporaries(tmp_path, out.name)):
        assert child.poll() is None and time.monotonic() < deadline, open(log).read()[-2000:]
        time.sleep(0.002)
    child.send_signal(signal.SIGTERM)
    assert child.wait() == 143, open(log).read()[-2000:]
    assert snapshot(tmp_path) == before  # no temporary left, the previous file untouched


def test_sigkill_while_merging_into_a_folder_keeps_the_previous_merge(tiny_set, tmp_path):
    lora = lora_for(load_qwen_image(tiny_set["qwen_image"]), "qwen_image", tmp_path / "lora.safetensors")
    out = tmp_path / "merged" / "transformer"
    assert merge_lora.main(["--model", tiny_set["qwen_image"], "--lora", f"{lora}:0.5", "--save_to", str(out)]) == 0
    before = snapshot(out)
    assert sorted(before) == ["config.json", "diffusion_pytorch_model.safetensors"]

    log = tmp_path / "merge.log"
    child = start(SLOW_MERGE, "--model", tiny_set["qwen_image"], "--lora", f"{lora}:1.0", "--save_to", out, log=log)
    shard = lambda: [os.path.join(t, "diffusion_pytorch_model.safetensors") for t in temporaries(out.parent, out.name)]  # noqa: E731
    kill_when(child, lambda: any(past_header(s) for s in shard()), log)

    assert snapshot(out) == before  # the folder under the final name: every file as it was
    leftovers = [os.path.basename(t) for t in temporaries(out.parent, out.name)]
    assert len(leftovers) == 1 and sorted(os.listdir(out.parent)) == [leftovers[0], "transformer"]


def no_space(*args, **kwargs):
    """What safetensors' writer raises on a full disk (a 400 KiB tmpfs): its own error, no OSError (faked as an
    OSError(ENOSPC) until 2026-11-28, the full disk was a traceback)."""
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def test_a_full_disk_while_saving_a_lora_keeps_the_previous_file(tmp_path, monkeypatch):
    path = tmp_path / "lora.safetensors"
    lora_files.write_kohya(small_lora(1.0), str(path))
    before = snapshot(tmp_path)
    monkeypatch.setattr(library.io, "save_file", no_space)
    with pytest.raises(OSError) as e:
        lora_files.write_kohya(small_lora(2.0), str(path))
    assert str(e.value) == f"{path}: cannot be written, no space left on device (the previous one is kept)"
    assert snapshot(tmp_path) == before  # no temporary left


def test_a_full_disk_while_saving_a_state_keeps_the_previous_state(tmp_path, monkeypatch):
    args = load_config(["--model_type", "llm", "--pretrained_model_name_or_path", "fake", "--train_data", "fake",
                        "--output_dir", str(tmp_path)])
    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = torch.optim.SGD([weight], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    folder = tmp_path / "run-state"
    save_state(str(folder), {"w": weight.detach()}, optimizer, scheduler, {"step": 1}, args)
    before = snapshot(tmp_path)
    monkeypatch.setattr(library.io, "save_file", no_space)
    with pytest.raises(OSError) as e:
        save_state(str(folder), {"w": weight.detach() * 2}, optimizer, scheduler, {"step": 2}, args)
    assert str(e.value) == f"{folder}: cannot be written, no space left on device (the previous one is kept)"
    assert snapshot(tmp_path) == before  # no temporary folder left


def test_a_full_disk_at_the_final_save_is_one_error_line(tiny_set, tmp_path, monkeypatch, capsys):
    import train_lora
    from tests.test_reliability import files_under, flux_args

    out = tmp_path / "out"
    real_save_file = library.io.save_file

    def full_below_out(tensors, filename, metadata=None):  # the image caches (elsewhere) still fit
        if str(filename).startswith(str(out)):
            no_space()
        real_save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(library.io, "save_file", full_below_out)
    capsys.readouterr()
    code = train_lora.main(flux_args(tiny_set, out))
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err
    lora = out / "tiny_flux_lora.safetensors"
    assert err.splitlines()[-1] == f"error: {lora}: cannot be written, no space left on device (nothing was written)"
    assert not any(name.endswith(".tmp") or ".tmp" + os.sep in name for name in files_under(out)), files_under(out)
