import gc
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Two CPU cores in CI, one pytest-xdist worker on each (`make test` runs `pytest -n auto`): a worker's
# intra-op threads, and those of the trainers and tools its tests start (OMP_NUM_THREADS), are its share
# of the cores, so that the workers do not oversubscribe them. Alone (`pytest` without -n): two threads.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = max(1, min(2, (os.cpu_count() or 1) // WORKERS))
torch.set_num_threads(THREADS)
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))


def freeze_what_lives():
    """Moves every object alive now out of the collector's reach (gc.freeze): the imported libraries'
    ~0.5 M objects. Each in-process training run calls gc.collect() (DiffusionTask frees its encoders),
    and Python collects its oldest generation as the suite's objects grow: each walked them all again
    (0.45 s a call with torch, diffusers and transformers imported). Only objects that live as long as
    the session are frozen: what tests create later is collected as before."""
    gc.collect()
    gc.freeze()


# The files that took longest on 2 cores (`pytest --durations=0`, summed per file), longest first. Under
# `make test` (pytest -n auto --dist loadfile --no-loadscope-reorder) a worker takes the next whole file
# whenever it runs short, so starting the long ones first ends the workers together rather than leaving
# one of them alone with a long file at the end (xdist's own order, most tests first, put them last).
LONGEST_FIRST = (
    "test_memory_plan.py", "test_learning.py", "test_webui_faults.py", "test_train_lora.py", "test_precision_matrix.py",
    "test_block_swap.py", "test_webui_browser.py", "test_train_llm.py", "test_crash_safety.py", "test_webui_handlers.py",
    "test_fsdp.py", "test_residual_projection.py", "test_lora_clients.py", "test_webui_api.py", "test_validation_ema.py",
    "test_webui_peer_configs.py", "test_flux2_train.py", "test_run_lifecycle.py", "test_precision_doctor.py",
    "test_saved_attention.py", "test_chroma.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


def pytest_collection_finish(session):
    freeze_what_lives()  # the test modules and what they import


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture(scope="session")
def tiny_set(tmp_path_factory):
    """The tiny real-format model set and a generated 8-image dataset, built once per session."""
    from tools.make_tiny_dataset import make_tiny_dataset
    from tools.make_tiny_models import make_tiny_models

    root = tmp_path_factory.mktemp("tiny_set")
    paths = make_tiny_models(str(root / "models"))
    paths.update(make_tiny_dataset(str(root / "dataset")))
    paths["root"] = str(root)
    freeze_what_lives()  # diffusers and transformers, imported to write the set
    return paths


# LoRA files in every layout the reader reads (tests/lora_layouts.py), built once for the reader's tests
# (test_lora_reader.py, test_lora_refusals.py, test_lora_headers.py).
@pytest.fixture(scope="session")
def flux_loras(tmp_path_factory):
    from tests.lora_layouts import flux_loras

    return flux_loras(tmp_path_factory.mktemp("reader_flux"))


@pytest.fixture(scope="session")
def zimage_loras(tmp_path_factory):
    from tests.lora_layouts import zimage_loras

    return zimage_loras(tmp_path_factory.mktemp("reader_zimage"))


@pytest.fixture(scope="session")
def qwen_lora(tmp_path_factory) -> str:
    from tests.lora_layouts import qwen_lora

    return qwen_lora(tmp_path_factory.mktemp("reader_qwen"))


@pytest.fixture
def planned_on_a_card(monkeypatch) -> list:
    """A 24 GiB CUDA card's answer on the CPU (memory_plan.device_memory), so that train_lora plans its steps as on
    one; returns the list each training_plan call appends its step to: (references, the largest reference's size,
    layers)."""
    from library.training import memory_plan

    planned, real = [], memory_plan.training_plan

    def recording(family, args, width, height, batch, tokens, *step):
        planned.append(step)
        return real(family, args, width, height, batch, tokens, *step)

    monkeypatch.setattr(memory_plan, "device_memory", lambda device: 24 * 2**30)
    monkeypatch.setattr(memory_plan, "training_plan", recording)
    return planned
