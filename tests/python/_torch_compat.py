"""What the tests need to know of the torch release they run on (the front
end supports torch 2.6 and newer; CI runs the suite on 2.13.0 and on 2.6.0)."""
import pytest
import torch

# A gradient of another dtype than its parameter: torch allows one through
# Tensor.grad_dtype (absent from 2.9.1 and older, which refuse the gradient).
HAS_GRAD_DTYPE = hasattr(torch.Tensor, "grad_dtype")

needs_grad_dtype = pytest.mark.skipif(
    not HAS_GRAD_DTYPE,
    reason="torch %s has no Tensor.grad_dtype: a gradient of another dtype than "
           "its parameter cannot be made" % torch.__version__)
