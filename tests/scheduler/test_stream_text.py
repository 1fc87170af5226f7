"""Streamed text: incremental detokenization and stop strings, on the embedded tokenizer."""

from __future__ import annotations

import pytest

from executor_svc.weights.gguf_file import open_gguf
from executor_svc.weights.tokenizer import load_tokenizer
from scheduler_svc.detokenizer import IncrementalDetokenizer
from scheduler_svc.request import Request
from scheduler_svc.request_stream import RequestStream
from scheduler_svc.stop_strings import StopStringMatcher
from service_common.sampling_params import SamplingParams
from swarmserve.scheduler.v1 import scheduler_pb2 as pb

TEXTS = [
    "plain ascii text with spaces  and\ttabs\n",
    "東京タワー 🗼🚀🎉 naïve café — «ça va»",
    "👩‍👩‍👧‍👦 family, 🇯🇵 flag, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math letters",
    "def f(x):\n    return x ** 2  # ²\n",
]


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    return load_tokenizer(open_gguf(default_model_path)).tokenizer


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_deltas_concatenate_to_the_decoded_text_and_never_split_a_character(tokenizer, text, chunk):
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    prompt = tokenizer.encode("Say:", add_special_tokens=False).ids
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)] + [detok.flush()]
    assert "".join(deltas) == tokenizer.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)


def test_the_test_text_really_splits_characters_across_tokens(tokenizer):
    ids = tokenizer.encode(TEXTS[1], add_special_tokens=False).ids
    assert any("\ufffd" in tokenizer.decode([i]) for i in ids)


def test_special_tokens_are_skipped_unless_asked_for(tokenizer):
    ids = tokenizer.encode("hi<|im_end|>", add_special_tokens=False).ids
    skip = IncrementalDetokenizer(tokenizer, [])
    keep = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert skip.push(ids) + skip.flush() == "hi"
    assert keep.push(ids) + keep.flush() == "hi<|im_end|>"


def test_stop_string_split_across_deltas_is_cut_and_never_streamed():
    m = StopStringMatcher(["STOP", "\n\n"])
    out = [m.feed(t) for t in ["Hello wor", "ld ST", "O", "P and more"]]
    assert "".join(out) == "Hello world "
    assert m.matched == "STOP"
    assert m.feed("after") == "" and m.flush() == ""


def test_only_a_possible_start_of_a_stop_string_is_held_back():
    m = StopStringMatcher(["</answer>"])
    assert m.feed("a < b and c </ans") == "a < b and c "  # "</ans" may become "</answer>"
    assert m.feed("wer is not it") == "</answer is not it"  # it did not
    assert m.feed("x <") == "x "
    assert m.flush() == "<"
    assert m.matched is None


def test_earliest_stop_string_wins():
    m = StopStringMatcher(["bb", "a"])
    assert m.feed("xxbbxa") == "xx" and m.matched == "bb"


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Text arriving one character at a time: the output before the first stop string completed."""
    for end in range(1, len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            stop = max(ending, key=len)
            return text[: end - len(stop)], stop
    return text, None


def test_stop_strings_match_the_character_by_character_reference_however_text_is_split():
    import random

    rng = random.Random(0)
    for _ in range(1000):
        stops = ["".join(rng.choice("ab") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 4))]
        text = "".join(rng.choice("abc") for _ in range(rng.randint(0, 30)))
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(0, 6))))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        m = StopStringMatcher(stops)
        out = "".join(m.feed(p) for p in pieces) + m.flush()
        assert (out, m.matched) == reference_stop(text, stops), (stops, pieces)


def test_stop_string_matching_is_linear_in_the_new_text():
    """Issue 12, item 3: at the default limits (16 stop strings of 256 characters), with one
    holding back a long partial match, 4,000 one-character deltas took 10.7 s; now milliseconds."""
    import time

    stops = [chr(ord("c") + i) * 256 for i in range(15)] + ["a" * 255 + "b"]
    m = StopStringMatcher(stops)
    t0 = time.perf_counter()
    emitted = "".join(m.feed("a") for _ in range(4000))
    elapsed = time.perf_counter() - t0
    assert emitted == "a" * (4000 - 255) and m.matched is None
    assert elapsed < 1.0, f"{elapsed:.2f} s for 4,000 deltas"


def test_a_stop_string_completed_by_the_final_flush_ends_as_stop_string(tokenizer):
    request = Request("r", [1], SamplingParams(), 8)
    stream = RequestStream(request, tokenizer, stop_strings=["END"], include_special_tokens=False)
    stream.push_tokens(tokenizer.encode("text E", add_special_tokens=False).ids, [])
    stream.push_tokens(tokenizer.encode("ND", add_special_tokens=False).ids, [])
    stream.finish("length")
    events = []
    while not stream.events.empty():
        events.append(stream.events.get_nowait())
    text = "".join(e.delta.text for e in events if e.HasField("delta"))
    final = events[-1].final
    assert text == "text "
    assert final.finish_reason == pb.FINISH_REASON_STOP_STRING and final.stop_string == "END"


@pytest.mark.parametrize("chunk", [1, 2, 3, 64])
def test_a_stop_string_ends_the_tokens_with_the_one_that_completed_it_however_they_arrive(tokenizer, chunk):
    """A step brings 1 token or many (speculation, decode runs): the output's tokens, its text and
    its token count are the same either way, and no token after the stop string is streamed."""
    ids = tokenizer.encode("The answer is 42. Then STOP, and more text after it", add_special_tokens=False).ids
    completing = next(k for k in range(1, len(ids) + 1) if "STOP" in tokenizer.decode(ids[:k]))
    stream = RequestStream(Request("r", [1], SamplingParams(), 64), tokenizer, ["STOP"], include_special_tokens=False)
    num_output = 0
    for i in range(0, len(ids), chunk):
        num_output += stream.push_tokens(ids[i : i + chunk], [])
        if stream.has_stopped:
            break
    stream.finish("stop_string")
    events = []
    while not stream.events.empty():
        events.append(stream.events.get_nowait())
    streamed = [t for e in events if e.HasField("delta") for t in e.delta.token_ids]
    assert streamed == ids[:completing] and num_output == completing < len(ids)
    assert "".join(e.delta.text for e in events if e.HasField("delta")) == "The answer is 42. Then "
    assert events[-1].final.finish_reason == pb.FINISH_REASON_STOP_STRING


class CountingTokenizer:
    """The real tokenizer, counting how many token ids it is asked to decode."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_decoded_ids = 0

    def decode(self, ids, skip_special_tokens=True):
        self.num_decoded_ids += len(ids)
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


def byte_token_id(tokenizer, byte: int) -> int:
    from tests.support.tiny_gguf import byte_alphabet

    return tokenizer.token_to_id(byte_alphabet()[byte])


def test_tokens_that_decode_to_nothing_keep_detokenization_linear(tokenizer):
    """Issue 12, item 12: skipped special tokens used to widen the window forever."""
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, tokenizer.encode("Say:", add_special_tokens=False).ids)
    special = tokenizer.token_to_id("<|im_end|>")
    word = tokenizer.encode(" ok", add_special_tokens=False).ids
    n = 2000
    deltas = [detok.push([special]) for _ in range(n)] + [detok.push(word)] + [detok.flush()]
    assert "".join(deltas) == " ok"
    assert counting.num_decoded_ids < 30 * n, f"{counting.num_decoded_ids} token ids decoded for {n} tokens"


def test_invalid_bytes_are_streamed_as_they_settle_and_characters_still_complete(tokenizer):
    lone_continuation = byte_token_id(tokenizer, 0x80)
    e_acute = [byte_token_id(tokenizer, b) for b in "é".encode()]  # one character, two byte tokens
    n = 1000
    ids = [lone_continuation] * n + e_acute + tokenizer.encode(" done", add_special_tokens=False).ids
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [])
    deltas = [detok.push([i]) for i in ids]
    tail = detok.flush()
    assert "".join(deltas) + tail == tokenizer.decode(ids)
    assert "".join(deltas).count("\ufffd") >= n - 5, "settled invalid bytes should stream, not wait for the end"
    assert "é" in "".join(deltas)
    assert counting.num_decoded_ids < 30 * len(ids)
