"""The value and key encoding of keyed state: round trips, ordering, and clear errors."""

from __future__ import annotations

import numpy as np
import pytest
from sparksteward.errors import StateEncodingError
from sparksteward.state.encoding import (
    KIND_MAP,
    KIND_VALUE,
    TAG_BYTES,
    TAG_JSON,
    decode_value,
    encode_value,
    group_bounds,
    key_prefix,
    split_key,
    state_key,
)


@pytest.mark.parametrize("value", [0, -5, 2**62, 1.5, "héllo", True, False, [1, "a", None],
                                   {"n": 3, "tags": ["x"], "nested": {"y": 1.25}}, b"\x00\xffraw", b""])
def test_round_trip(value):
    assert decode_value(encode_value(value)) == value


def test_tags_are_the_documented_ones():
    assert encode_value(7) == bytes([TAG_JSON]) + b"7"
    assert encode_value(b"ab") == bytes([TAG_BYTES]) + b"ab"
    assert decode_value(encode_value(np.int64(3))) == 3
    assert decode_value(encode_value({"a": np.array([1, 2])})) == {"a": [1, 2]}


class Session:  # an object a user might try to store
    pass


def test_unencodable_values_name_the_value_and_the_fix():
    with pytest.raises(StateEncodingError, match=r"state value <.*Session object.*> of type Session cannot be "
                                                 r"encoded.*must be JSON values.*or bytes"):
        encode_value(Session())
    with pytest.raises(StateEncodingError, match=r"state value nan of type float cannot be encoded"):
        encode_value(float("nan"))
    with pytest.raises(StateEncodingError, match=r"state value \{1: 'a'\} of type dict cannot be encoded"):
        encode_value({1: "a"})
    with pytest.raises(StateEncodingError, match="None cannot be stored.*clear"):
        encode_value(None)


def test_unknown_tag_is_a_newer_version():
    with pytest.raises(StateEncodingError, match="tag 0x07.*newer spark-steward"):
        decode_value(b"\x07abc")


def test_key_layout_and_key_group_ranges_are_contiguous():
    k = state_key(300, KIND_VALUE, "count", b"user-1")
    assert k[:2] == (300).to_bytes(2, "big")
    assert split_key(k) == (300, KIND_VALUE, "count", b"user-1", b"")
    m = state_key(5, KIND_MAP, "seen", b"u", "page")
    assert split_key(m)[4] == encode_value("page")
    lo, hi = group_bounds(10, 20)
    inside = [state_key(g, KIND_VALUE, "s", b"\xff" * 9) for g in range(10, 20)]
    outside = [state_key(g, KIND_VALUE, "s", b"") for g in (9, 20, 21)]
    assert all(lo <= x < hi for x in inside)
    assert not any(lo <= x < hi for x in outside)
    # a key that is a prefix of another key cannot run into its map entries
    assert not state_key(1, KIND_MAP, "m", b"ab", 1).startswith(key_prefix(1, KIND_MAP, "m", b"a"))


def test_bad_names():
    with pytest.raises(StateEncodingError, match="at most 255"):
        key_prefix(0, KIND_VALUE, "x" * 300, b"")
    with pytest.raises(StateEncodingError, match="non-empty str"):
        key_prefix(0, KIND_VALUE, "", b"")
