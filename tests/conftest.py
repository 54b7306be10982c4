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


@pytest.fixture
def nan_uninitialized():
    """While the test runs, every tensor torch allocates without writing it (``torch.empty``, ``new_empty``,
    ``empty_like``, a resize; the kernels' ``registry.empty`` outputs, parameters left for an init) comes filled
    with NaN (integers: their largest value): torch's ``fill_uninitialized_memory``, which acts in deterministic
    mode. A read of memory that nothing wrote then fails on every run, not only when the allocator happens to hand
    back garbage that is inf or NaN. ``warn_only``: ops without a deterministic implementation still run (the fill
    is the point here, not the mode)."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill
