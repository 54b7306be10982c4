"""Suite-wide conventions: Triton runs in its CPU interpreter, kernels default to the reference
(kernel tests ask for Triton explicitly), GPU tests skip without a GPU."""

import os


def _gpu_visible() -> bool:
    """Cheap GPU probe that imports no kernel package (the interpreter must be decided first)."""
    import torch

    musa = getattr(torch, "musa", None)
    return torch.cuda.is_available() or bool(musa is not None and musa.is_available())


# Must be set before any @triton.jit runs: the interpreter is chosen at decoration time. On a GPU the
# kernels compile for real; on a CPU they run in Triton's interpreter.
if not _gpu_visible():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("DSV3_KERNEL_IMPL", "reference")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if _gpu_visible():
        return
    skip = pytest.mark.skip(reason="needs a CUDA or MUSA GPU; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
