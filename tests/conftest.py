import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

# Two CPU cores in CI: keep intra-op threads matched so tests do not oversubscribe.
torch.set_num_threads(min(2, os.cpu_count() or 1))


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
    return paths
