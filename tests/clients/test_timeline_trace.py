"""The timeline's Chrome trace names and annotates each request's drafts: a chain's, and a tree's shape."""

from __future__ import annotations

from clients.timeline import chrome_trace
from swarmserve.scheduler.v1 import scheduler_pb2 as pb


def test_a_tree_slice_says_its_depth_and_leaves_and_a_chain_slice_does_not():
    step = pb.TimelineStep(
        step_id=7, start_time_s=1.0, duration_s=0.01, num_requests=3, draft_depth=6, num_draft_leaves=4
    )
    step.requests.add(request_id="chain", is_decode=True, num_drafted_tokens=4, num_accepted_tokens=2,
                      num_new_tokens=3, draft_depth=4, num_draft_leaves=1)  # fmt: skip
    step.requests.add(request_id="tree", is_decode=True, num_drafted_tokens=5, num_accepted_tokens=2,
                      num_new_tokens=3, draft_depth=2, num_draft_leaves=3)  # fmt: skip
    step.requests.add(request_id="plain", is_decode=True, num_new_tokens=1)
    events = chrome_trace(pb.GetTimelineResponse(steps=[step]))["traceEvents"]
    slices = {e["tid"]: e for e in events if e.get("cat") == "decode"}  # request tracks in order of appearance
    assert {tid: e["name"] for tid, e in slices.items()} == {
        1: "decode +3 (2/4 drafts)",
        2: "decode +3 (2/5 drafts in a tree 2 deep, 3 leaves)",
        3: "decode",
    }
    assert (slices[1]["args"]["draft_depth"], slices[1]["args"]["draft_leaves"]) == (4, 1)
    assert (slices[2]["args"]["draft_depth"], slices[2]["args"]["draft_leaves"]) == (2, 3)
    (step_event,) = [e for e in events if e.get("cat") == "step"]
    assert (step_event["args"]["draft_depth"], step_event["args"]["draft_leaves"]) == (6, 4)
