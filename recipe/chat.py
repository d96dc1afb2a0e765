"""The chat format shared by every stage: roles, special tokens and the Jinja template.

ChatML layout, one block per message::

    <|im_start|>{role}\\n{content}<|im_end|>\\n

A conversation rendered for training is followed by ``<|endoftext|>`` (the document separator
of packed sequences). ``<|mask|>`` is reserved for block drafts and never occurs in the data.
"""

from __future__ import annotations

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
MASK = "<|mask|>"
# NOTE: the order fixes the ids (0..3): the tokenizer trainer adds specials first.
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END, MASK)

USER = "user"
ASSISTANT = "assistant"
SHAREGPT_ROLES = {"human": USER, "gpt": ASSISTANT}

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)


Message = dict[str, str]  # {"role": ..., "content": ...}


def render(messages: list[Message], add_generation_prompt: bool = False) -> str:
    """The template's output, without Jinja (tests check that both agree)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return (text + f"{IM_START}{ASSISTANT}\n") if add_generation_prompt else text


def contains_special(text: str) -> bool:
    return any(token in text for token in SPECIAL_TOKENS)
