"""The venv the integration tests run in is the one scripts/sglang_env.sh pins."""

from __future__ import annotations

import sglang
import torch


def test_sglang_is_the_pinned_release():
    assert sglang.__version__ == "0.5.23"


def test_torch_is_the_local_cpu_wheel():
    # sglang asks for another torch; a CUDA build here means pip replaced the CPU wheel.
    assert torch.__version__.startswith("2.13.0"), torch.__version__
    assert torch.version.cuda is None, torch.version.cuda
