import gc
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Two CPU cores in CI: keep intra-op threads matched so tests do not oversubscribe.
torch.set_num_threads(min(2, os.cpu_count() or 1))


def freeze_what_lives():
    """Moves every object alive now out of the collector's reach (gc.freeze): the imported libraries'
    ~0.5 M objects. Each in-process training run calls gc.collect() (DiffusionTask frees its encoders),
    and Python collects its oldest generation as the suite's objects grow: each walked them all again
    (0.45 s a call with torch, diffusers and transformers imported). Only objects that live as long as
    the session are frozen: what tests create later is collected as before."""
    gc.collect()
    gc.freeze()


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
