"""Hostile input 9: property tests of the wire decoder and of `SamplingParams`.

Random bytes and random msgpack maps never crash a decoder: a message either decodes into a
valid one or raises `SchemaError`. Random `SamplingParams` arguments either construct or raise
`ValueError` naming a field. (Random scheduler operation sequences are already covered by
`tests/engine/test_scheduler.py::test_random_operations_keep_invariants`.)
"""

from __future__ import annotations

import dataclasses
import math

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import SamplingParams
from queueing.schema import (
    SAMPLING_FIELDS,
    VERSION,
    Abort,
    GenerateRequest,
    SchemaError,
    TokenChunk,
    WorkerInfo,
)
from service.delivery import _peek_request_id

MESSAGES = [GenerateRequest, TokenChunk, Abort, WorkerInfo]
FIELD_NAMES = sorted(
    {f.name for m in MESSAGES for f in dataclasses.fields(m)}
    | set(SAMPLING_FIELDS)
    | {"v", "role", "content"}
)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(FIELD_NAMES) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
# Maps that look like messages: mostly known field names, the version usually right.
message_maps = st.dictionaries(
    st.sampled_from(FIELD_NAMES) | st.text(max_size=8), values, max_size=10
).map(lambda m: {"v": VERSION, **m} if len(m) % 4 else m)


def _decodes_cleanly(cls, data: bytes) -> None:
    try:
        message = cls.decode(data)
    except SchemaError:
        return
    message.validate()  # what decoded is a valid message
    assert cls.decode(message.encode()) == message


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
@SETTINGS
@given(data=st.binary(max_size=200))
def test_random_bytes_are_rejected_cleanly(cls, data):
    _decodes_cleanly(cls, data)
    _peek_request_id(data)  # the worker's look at an undecodable entry never raises


@pytest.mark.parametrize("cls", MESSAGES, ids=lambda c: c.__name__)
@SETTINGS
@given(obj=message_maps)
def test_random_msgpack_maps_are_rejected_or_valid(cls, obj):
    data = msgpack.packb(obj, use_bin_type=True)
    _decodes_cleanly(cls, data)
    _peek_request_id(data)


def _wire_value(types: tuple[type, ...]) -> st.SearchStrategy:
    """Any value of the wire types of one sampling field, with random contents."""
    by_type = {
        type(None): st.none(),
        bool: st.booleans(),
        int: st.integers(min_value=-(2**40), max_value=2**40),
        float: st.floats(allow_nan=True, allow_infinity=True),
        list: st.lists(st.text(max_size=300) | st.integers(-5, 10**6) | st.none(), max_size=20),
        dict: st.dictionaries(st.text("0123456789x", max_size=7), scalars, max_size=4),
    }
    return st.one_of(*(by_type[t] for t in types))


# What the wire lets through (queueing.schema checks each sampling field's type only).
wire_sampling = st.fixed_dictionaries(
    {}, optional={name: _wire_value(types) for name, types in SAMPLING_FIELDS.items()}
)


@SETTINGS
@given(kwargs=wire_sampling)
def test_random_sampling_params_construct_or_raise_value_error(kwargs):
    """Every value the wire admits either makes valid params or a ValueError naming a field
    (the worker answers that as a bad request)."""
    try:
        params = SamplingParams(**kwargs)
    except ValueError as e:
        assert str(e).split()[0] in SAMPLING_FIELDS, e
        return
    assert params.n >= 1 and (params.max_tokens is None or params.max_tokens >= 1)
    assert params.temperature >= 0 and not math.isnan(params.temperature)
    assert 0 < params.top_p <= 1 and 0 <= params.min_p <= 1
