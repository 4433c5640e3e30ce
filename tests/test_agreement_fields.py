"""The cross-rank agreement's fields (spardl.comm.signature_field, the fixed-length signature of
spardl.algorithms.base.collective_check): every value fits one int64 field of a fixed-length
message, equal values give equal fields, and different values (or lists) different ones."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from spardl.algorithms.base import SIGNATURE_LEN, _fixed_signature
from spardl.comm import name_hash, signature_field

INT64_MIN = -(2**63)

values = st.one_of(
    st.integers(),  # Python ints past int64 too
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.floats(allow_nan=False),
    st.booleans(),
    st.text(max_size=8),
    st.none(),
)


def _key(v):
    """What must decide equality of fields: the value and, for non-integers, its type."""
    if isinstance(v, (int, np.integer)) and not isinstance(v, bool):
        return ("int", int(v))
    return (type(v).__qualname__, repr(v))


@given(values)
def test_every_value_is_one_int64_field_that_negates(v):
    f = signature_field(v)
    assert INT64_MIN < f < 2**63  # -2**63 would wrap when negated in the MAX trick
    assert signature_field(v) == f
    assert signature_field(f) == f  # a field maps to itself


@given(st.integers(-(2**63) + 1, 2**63 - 1))
def test_integers_in_range_are_themselves(i):
    """So a field maps to itself (collective_check's fields pass through Comm.agree again)."""
    assert signature_field(i) == i == signature_field(np.uint64(i) if i >= 0 else np.int64(i))
    assert signature_field(signature_field(i)) == i


@given(values, values)
def test_fields_are_equal_exactly_when_the_values_are(a, b):
    assert (signature_field(a) == signature_field(b)) == (_key(a) == _key(b))


@given(st.lists(values, max_size=20), st.lists(values, max_size=20))
def test_signatures_have_one_length_and_differ_when_their_fields_do(a, b):
    sa, sb = _fixed_signature(a), _fixed_signature(b)
    assert len(sa) == len(sb) == SIGNATURE_LEN
    pad = [0] * 20  # a shorter list is the longer one's prefix padded with zeros
    same = [signature_field(v) for v in a] + pad[: 20 - len(a)] == [
        signature_field(v) for v in b
    ] + pad[: 20 - len(b)]
    assert (sa == sb) == same


@given(st.text(), st.text())
def test_name_hash_is_62_bits_and_tells_names_apart(a, b):
    assert 0 <= name_hash(a) < 2**62
    assert (name_hash(a) == name_hash(b)) == (a == b)


def test_words_of_a_check_are_built_only_when_it_fails():
    """collective_check takes its words as a callable, called only for a failed check: a check
    made every step does not build them every step."""
    import pytest
    from mpi4py import MPI

    from spardl.algorithms.base import collective_check
    from spardl.comm import Comm

    comm = Comm(MPI.COMM_SELF)
    built = []

    def words():
        built.append(1)
        return {"n": 5}

    collective_check(comm, None, [name_hash("x"), 5], words)
    assert built == []
    assert comm.agree(True, [name_hash("x"), 2**70, "s"]) == (True, True)
    assert comm.agree_fields(False, [signature_field(2**70)]) == (False, True)
    with pytest.raises(ValueError, match="bad n"):
        collective_check(comm, ValueError("bad n"), [name_hash("x"), 5], words)
    assert built == [1]
