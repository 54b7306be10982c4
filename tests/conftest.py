"""Suite-wide conventions: Triton runs in its CPU interpreter, kernels default to the reference
(kernel tests ask for Triton explicitly), GPU tests skip without a GPU."""

import os
import sys


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


@pytest.fixture(autouse=True)
def _reset_aux_loss_scale():
    """The aux-loss gradient scale is process-global (as Megatron's MoEAuxLossAutoScaler); a Trainer run
    in-process sets it to 1/micro-batches, which must not leak into the next test's reference."""
    yield
    balancing = sys.modules.get("models.deepseek_v3.balancing")
    if balancing is not None:
        balancing.MoEAuxLossAutoScaler.set_loss_scale(1.0)
