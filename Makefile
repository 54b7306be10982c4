# The two commands: `make demo` (the main job) and `make test` (the whole suite); `make test-torch211` reruns
# the numerics and equivalence tests under the GPU environment's torch 2.11 + Triton 3.6.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TORCH_PIN ?= torch==2.13.0

# The GPU environment's versions (benchmarks/gpu_check.sh): torch 2.11 + Triton 3.6, in a second venv.
# PyPI's torch 2.11 wheel is a CUDA build (~5 GB with its nvidia-* wheels) that runs on a CPU.
# numpy < 2.4: Triton 3.6's interpreter holds every scalar as a 1-element array and turns it into a loop
# bound with int(array), which NumPy deprecated in 1.25 and made an error in 2.4 (TypeError: only
# 0-dimensional arrays can be converted to Python scalars); Triton 3.9 squeezes first. The compiled
# kernels never use numpy, so the pin changes only what the interpreter can run.
VENV211 ?= .venv-torch211
PY211 := $(VENV211)/bin/python
STAMP211 := $(VENV211)/.installed
TORCH211_PINS ?= torch==2.11.0 "numpy<2.4"
# What it runs (README, "Torch versions"): the combination matrix; the overlapped / EP / recompute / pipeline
# equivalence tests against one process; the trace test (all-to-all hidden in both directions); HF parity
# and the model tests (V3 and V3.2 DSA); every kernel (fused ops included) under Triton 3.6's interpreter and its
# compile gates; FP8 health and the BF16 shadow; the
# version check. An explicit list, so a renamed or deleted file fails loudly here instead of dropping out.
TESTS211 ?= \
	tests/test_v4_hf_parity.py tests/test_v4_indexer_training.py tests/test_v4_init_from.py tests/test_v4_checkpoint.py tests/test_v4_model.py tests/test_v4_generate.py \
	tests/test_v4_training.py tests/test_v4_training_slow.py \
	tests/test_v4_planner.py tests/test_v4_export.py \
	tests/test_combinations.py tests/test_training_overlap.py tests/test_model_recompute.py \
	tests/test_training_recompute.py tests/test_training.py tests/test_training_dualpipe.py \
	tests/test_training_eplb.py tests/test_v3_layout.py tests/test_expert_parallel.py tests/test_expert_parallel_fused.py \
	tests/test_interleaved_schedule.py tests/test_training_interleaved.py tests/test_compile.py tests/test_compile_train.py tests/test_compile_bench.py \
	tests/test_dualpipe_runtime.py tests/test_trace.py tests/test_run_teardown.py tests/test_model.py tests/test_model_checkpoint.py \
	tests/test_model_generate.py tests/test_model_gpu.py tests/test_deep_gemm_cast.py \
	tests/test_deep_gemm_gemm.py tests/test_deep_gemm_grouped.py tests/test_deep_gemm_linear.py \
	tests/test_deep_gemm_mxfp8.py tests/test_muon.py tests/test_muon_dist.py tests/test_mxfp4.py tests/test_indexer_fp4.py tests/test_fp4_experts.py tests/test_deep_gemm_fp8_fp4.py tests/test_checkpoint_ue8m0.py tests/test_flash_mla_attention.py \
	tests/test_flash_mla_decode.py tests/test_flash_mla_inputs.py tests/test_flash_mla_sparse.py tests/test_flash_mla_sparse_sink.py tests/test_v4_kernels.py tests/test_v4_kernels_decode.py \
	tests/test_deep_gemm_mqa_logits.py tests/test_fused_ce.py tests/test_fused_ops.py tests/test_opcheck.py \
	tests/test_fused_ops_compile.py tests/test_compile_ops.py tests/test_fused_dispatch.py \
	tests/test_kernel_overflow.py tests/test_kernel_registry.py tests/test_verify_project_ops.py \
	tests/test_kernel_compile.py tests/test_plan.py tests/test_torch_support.py tests/test_dsa.py \
	tests/test_dsa_combinations.py tests/test_fused_ops_model.py tests/test_fused_ops_gpu.py \
	tests/test_fp8_health.py tests/test_fp8_shadow.py tests/test_residual_fusion.py \
	tests/test_fp8_handoff.py tests/test_deep_gemm_precast.py tests/test_schedule.py tests/test_context_parallel_plan.py \
	tests/test_context_parallel.py

.PHONY: venv test test-fast test-torch211 lint demo clean

venv: $(STAMP)

# torch goes in first, pinned, so that a CPU machine takes the local CPU wheel instead of a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

$(STAMP211): pyproject.toml Makefile
	test -x $(PY211) || python3 -m venv $(VENV211)
	$(PY211) -m pip install -q --upgrade pip
	$(PY211) -m pip install -q $(TORCH211_PINS)
	$(PY211) -m pip install -q -e '.[test]' $(TORCH211_PINS)
	touch $(STAMP211)

test: $(STAMP)
	$(PY) -m pytest -q

test-fast: $(STAMP)
	$(PY) -m pytest -q -m "not slow"

# The interpreter's int(array) warns once per loop bound under numpy < 2.4: silenced, it says nothing.
test-torch211: $(STAMP211)
	$(PY211) -c "import torch, triton, numpy; print('torch', torch.__version__, 'triton', triton.__version__, 'numpy', numpy.__version__)"
	$(PY211) -m pytest -q -W "ignore:Conversion of an array with ndim > 0:DeprecationWarning" $(TESTS211)

lint: $(STAMP)
	$(VENV)/bin/ruff check .

demo: $(STAMP)
	$(PY) -m recipes.train --config recipes/configs/tiny_cpu.toml

clean:
	rm -rf $(VENV) $(VENV211) .pytest_cache .ruff_cache
