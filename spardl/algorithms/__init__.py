"""One module per algorithm, each a short composition of kernels and `spardl.comm` calls."""

from .base import Allreducer, NonFiniteError, Reduced, budget
from .dense import Dense

__all__ = ["Allreducer", "NonFiniteError", "Reduced", "budget", "Dense"]
