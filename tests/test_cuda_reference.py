"""tests/test_reference_bf16.py's bounds on a GPU (issue 11 item 5): our bf16 model on CUDA (the
Triton kernels) against transformers' bf16 Qwen3 (logits on the same GPU, gradients on the
CPU) and float64 on the CPU —
logits and RL-loss gradients no further from float64 than transformers bf16's, and each bf16
error above the floor that shows bf16's rounding points act. Skipped without CUDA.
Run (CUDA machine): `python3 -m pytest -q tests/test_cuda_reference.py`.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytest.importorskip("transformers")

from test_reference_bf16 import check_gradients, check_logits  # noqa: E402


def test_cuda_bf16_logits_no_further_from_float64_than_transformers_bf16():
    check_logits("cuda")


def test_cuda_bf16_rl_gradients_no_further_from_float64_than_transformers_bf16():
    check_gradients("cuda")
