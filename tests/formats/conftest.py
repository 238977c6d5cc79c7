import pytest
import torch


@pytest.fixture(autouse=True)
def one_torch_thread():
    """These tensors are small: with other work on a 2-core machine, intra-op threads only
    contend (the folder runs about 3x faster on one thread). Restored after each test."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
