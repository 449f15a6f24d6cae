"""What the fine-tuning tests build on: a character tokenizer with ChatML's two special tokens,
SmolLM2's chat template (its default system prompt shortened), arithmetic conversations answered
in one JSON shape (chat_fixtures.py makes the model and the chat file from them)."""

from __future__ import annotations

from decoderlm.tokenizer import Tokenizer

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are terse.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHARACTERS = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789{}\":,.?!'\n_"


def chat_tokenizer() -> Tokenizer:
    """One token per character, and <|im_start|>, <|im_end|> one token each."""
    backend = Tokenizer.train_char([CHARACTERS]).backend
    backend.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    return Tokenizer(backend)


def conversation(a: int, b: int) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"add {a} and {b}"},
            {"role": "assistant", "content": f'{{"sum": {a + b}}}'},
        ]
    }
