"""The attention-pairs count both services use for the cost model (service_common/attention_pairs.py)."""

import pytest

from service_common.attention_pairs import attention_pairs


def test_each_row_attends_its_context_and_itself():
    assert attention_pairs(0, 1) == 1  # a prompt's first token: itself
    assert attention_pairs(999, 1) == 1000  # a decode row at 1,000 tokens of context
    assert attention_pairs(4096, 256) == sum(4096 + i for i in range(1, 257))  # a chunk at 4k of context
    assert attention_pairs(7, 0) == 0


def test_a_prompt_counts_the_same_however_it_is_chunked():
    whole = attention_pairs(0, 1000)
    assert whole == attention_pairs(0, 256) + attention_pairs(256, 256) + attention_pairs(512, 488)


def test_negative_counts_are_refused():
    with pytest.raises(ValueError, match="non-negative"):
        attention_pairs(-1, 3)
