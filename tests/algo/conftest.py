import pytest
import torch


@pytest.fixture(autouse=True)
def float64_default():
    """The math is checked in float64; the default dtype is restored so other tests see float32."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)
