"""ParsedEnum: every enum of settings and records parses a member or its text and refuses the rest by name."""

from __future__ import annotations

import pytest
from sparksteward.checkpoint.filemerging.file_merger import MergingMode
from sparksteward.checkpoint.restore import ClaimMode
from sparksteward.checkpoint.unaligned.channel_state import AlignmentMode
from sparksteward.enums import ParsedEnum
from sparksteward.errors import CheckpointError, ConfigError, InvalidRecordError, StateEncodingError
from sparksteward.jobs.result import JobStatus
from sparksteward.state.keygroups import KeyType

ENUMS = [(JobStatus, InvalidRecordError, "job status 'nope' is not one of SUCCEEDED, FAILED, CANCELLED"),
         (KeyType, StateEncodingError, "key type 'nope' is not supported: use one of string, long, int, binary "
                                       "(cast the key column to one of these)"),
         (AlignmentMode, ConfigError, "alignment='nope' is not valid: use 'aligned', 'unaligned' or "
                                      "'unaligned_max_inflight'"),
         (MergingMode, ConfigError, "file-merging mode 'nope' is not valid: use 'within' (every store) or "
                                    "'across' (local file systems only)"),
         (ClaimMode, CheckpointError, "claim_mode='nope' is not valid: use 'no_claim' or 'claim'")]


@pytest.mark.parametrize("cls, error, message", ENUMS, ids=lambda v: getattr(v, "__name__", ""))
def test_parse_takes_a_member_or_its_text_in_any_case_and_refuses_the_rest_with_its_own_error(cls, error, message):
    assert issubclass(cls, ParsedEnum) and issubclass(cls, str)
    for member in cls:
        assert cls.parse(member) is member
        assert cls.parse(member.value.upper()) is member and cls.parse(member.value.lower()) is member
    with pytest.raises(error) as info:
        cls.parse("nope")
    assert str(info.value) == message and info.value.__cause__ is None
    for bad in (None, 7, b"x", ""):
        with pytest.raises(error):
            cls.parse(bad)


def test_the_aliases_of_job_status_and_key_type():
    assert JobStatus.parse(" canceled\n") is JobStatus.CANCELLED
    assert [KeyType.parse(t) for t in ("BIGINT", "integer", "str", "bytes")] == \
        [KeyType.LONG, KeyType.INT, KeyType.STRING, KeyType.BINARY]
    with pytest.raises(InvalidRecordError):
        JobStatus.parse(b"FAILED")   # a job status is text, never bytes
