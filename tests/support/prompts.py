"""Varied prompts for the correctness tests on the embedded model."""

CODE = '''def merge_sort(items):
    """Sort a list with merge sort."""
    if len(items) <= 1:
        return items
    middle = len(items) // 2
'''

PROSE = "The history of the printing press begins in the fifteenth century, when"

UNICODE = "Translate to English: 東京は日本の首都です。Café, naïve, façade — and a few emoji 🚀🎉 too:"

JSON_DOC = '{"name": "swarmserve", "version": "0.1.0", "dependencies": {"torch": ">=2.4", "grpcio":'

WHITESPACE = "Columns:\n\tname\t\tvalue\n\t----\t\t-----\n\talpha\t\t1\n\tbeta\t\t2\n\tgamma\t\t"

NUMBERS = "Fibonacci numbers: 1, 1, 2, 3, 5, 8, 13, 21, 34, 55,"

CHAT_MESSAGES = [
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You are a terse coding assistant."},
        {"role": "user", "content": "How do I reverse a list in Python?"},
    ],
]

PLAIN_PROMPTS = [CODE, PROSE, UNICODE, JSON_DOC, WHITESPACE, NUMBERS]
