"""A stand-in for torch.distributed.GradBucket, for driving the DDP hook without DDP.

Imported by the check scripts under mpiexec (``from fake_bucket import FakeBucket``: their own
directory is on ``sys.path``) and by in-process tests (``from scripts.fake_bucket import
FakeBucket``: ``tests/`` is on ``sys.path``).
"""

from __future__ import annotations


class FakeBucket:
    """The part of torch.distributed.GradBucket the hook uses.

    Parameters
    ----------
    index : int
        The bucket's position in the iteration.
    buffer : torch.Tensor
        The flat gradient of ``params``, concatenated.
    params : list of torch.Tensor
        The bucket's parameters, in ``buffer`` order.
    last : bool
        Whether it is the iteration's last bucket.
    """

    def __init__(self, index, buffer, params, last):
        self._i, self._b, self._p, self._last = index, buffer, params, last

    def index(self):
        return self._i

    def buffer(self):
        return self._b

    def parameters(self):
        return self._p

    def is_last(self):
        return self._last
