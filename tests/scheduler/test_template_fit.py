"""template_fit: a conversation fitted to what the chat template renders, found by probing it."""

from __future__ import annotations

from scheduler_svc.template_fit import fold_mid_system, render_prompt, renders_mid_system
from tests.support.tiny_gguf import CHATML_TEMPLATE, HERMES_TOOLS_TEMPLATE

# A template that reads only a leading system message and skips any other, as many do.
FIRST_SYSTEM_ONLY_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}<<SYS>>{{ messages[0]['content'] }}<</SYS>>\n{% endif %}"
    "{% for m in messages %}{% if m['role'] != 'system' %}[{{ m['role'] }}] {{ m['content'] }}\n{% endif %}{% endfor %}"
)
# One that refuses a system message anywhere but first (Llama 2's, Mistral's kind).
STRICT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('System role only at the start') }}{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n"
    "{% endfor %}"
)
CONVERSATION = [
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "hello"},
    {"role": "system", "content": "The date is today."},
    {"role": "user", "content": "what now?"},
]


def test_templates_that_render_a_mid_conversation_system_message_keep_it_a_system_turn():
    assert renders_mid_system(CHATML_TEMPLATE) and renders_mid_system(HERMES_TOOLS_TEMPLATE)
    prompt = render_prompt(CHATML_TEMPLATE, CONVERSATION, None)
    assert "<|im_start|>system\nThe date is today.<|im_end|>\n<|im_start|>user\nwhat now?" in prompt


def test_elsewhere_it_is_folded_into_the_next_user_turn():
    for template in (FIRST_SYSTEM_ONLY_TEMPLATE, STRICT_TEMPLATE):
        assert not renders_mid_system(template)
        prompt = render_prompt(template, CONVERSATION, None)
        assert "[user] The date is today.\n\nwhat now?" in prompt
    assert fold_mid_system([*CONVERSATION[:3], CONVERSATION[3]])[-1] == {
        "role": "user",
        "content": "The date is today.",
    }
