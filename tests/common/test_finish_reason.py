"""One finish-reason enum for both services, converted by name at each proto edge."""

from __future__ import annotations

import pytest

from service_common.finish_reason import FinishReason
from swarmserve.executor.v1 import executor_pb2 as epb
from swarmserve.scheduler.v1 import scheduler_pb2 as spb


@pytest.mark.parametrize("reason", list(FinishReason))
def test_every_reason_survives_the_scheduler_proto(reason):
    value = reason.to_pb(spb.FinishReason)
    assert value != spb.FINISH_REASON_UNSPECIFIED
    assert FinishReason.from_pb(spb.FinishReason, value) is reason


def test_every_executor_reason_has_a_member_and_unspecified_means_still_running():
    for value in epb.FinishReason.values():
        reason = FinishReason.from_pb(epb.FinishReason, value)
        if value == epb.FINISH_REASON_UNSPECIFIED:
            assert reason is None
        else:
            assert reason.to_pb(epb.FinishReason) == value
    assert FinishReason.from_pb(epb.FinishReason, epb.FINISH_REASON_CONTEXT_FULL) is FinishReason.CONTEXT_FULL


def test_reasons_read_as_their_text():
    assert FinishReason.STOP_STRING == "stop_string" and f"{FinishReason.LENGTH}" == "length"
