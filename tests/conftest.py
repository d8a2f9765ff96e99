# --- linvision.kernels: run the Triton kernels in the interpreter when there is no GPU. Must be set before
# triton is imported; backend="auto" still selects the kernels for CUDA tensors only. ---
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# --- end linvision.kernels ---

import pytest


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        for item in items:  # their own deadline, longer than the default of pyproject.toml's timeout
            if "slow" in item.keywords and item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(3600))
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow (make test-all)")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A tiny image-folder dataset on disk (3 classes, 4 training and 2 validation images each, 16 px)."""
    from support import write_image_folder

    return write_image_folder(tmp_path_factory.mktemp("data"))
