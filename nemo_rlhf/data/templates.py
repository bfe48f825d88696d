"""The one prompt formatter used by SFT, RM and PPO (so the three stages see the same text).

``chat_template=None`` uses the prompt as is (completion style, e.g. ``3+3*6=``).
``"chatml"`` wraps it in ChatML roles (system optional)::

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n

The response follows the formatted prompt directly; the tokenizer's EOS ends it (for a
ChatML tokenizer that is usually ``<|im_end|>``). Simplified: single-turn only.
"""

from __future__ import annotations

from typing import Optional

CHAT_TEMPLATES = (None, "chatml")


def check_template(template: Optional[str], key: str = "data.chat_template") -> None:
    """Raise ``ValueError`` naming ``key`` when ``template`` is not a known template."""
    if template not in CHAT_TEMPLATES:
        raise ValueError(f"{key}={template!r}: valid choices are {list(CHAT_TEMPLATES)}")


def format_prompt(prompt: str, template: Optional[str] = None,
                  system_prompt: Optional[str] = None) -> str:
    """The text the model sees before its response.

    Args:
        prompt: the user's prompt (the dataset's ``prompt`` field).
        template: ``None`` (raw prompt) or ``"chatml"``.
        system_prompt: ChatML system message; ignored (must be None) without a template.

    Raises:
        ValueError: unknown template, or a system prompt without a template.
    """
    check_template(template)
    if template is None:
        if system_prompt:
            raise ValueError("data.system_prompt is set but data.chat_template is null; "
                             "a system prompt needs a chat template ('chatml')")
        return prompt
    parts = []
    if system_prompt:
        parts.append(f"<|im_start|>system\n{system_prompt}<|im_end|>\n")
    parts.append(f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    return "".join(parts)
