import os

import pytest
import torch

# Test modules import transformers (which may import triton) before minikv: without CUDA, Triton's
# interpreter must be on before triton is first imported (see minikv/kernels/interpreter.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, torch.get_num_threads()))


@pytest.fixture(scope="module")
def one_torch_thread():
    """tiny-random is far too small for two threads to pay; on a busy machine they spin-wait. A module
    that runs tiny engines uses it: `pytestmark = pytest.mark.usefixtures("one_torch_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_dir():
    from minikv.model.named import prepare_smollm2

    return prepare_smollm2()


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a few seconds (real model)")
