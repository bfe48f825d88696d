"""The one prompt formatter used by SFT, RM and PPO (so the three stages see the same text).

``chat_template=None`` uses the prompt as is (completion style, e.g. ``3+3*6=``).
``"chatml"`` wraps it in ChatML roles (system optional)::

    <|im_start|>system\\n{system}<|im_end|>\\n<|im_start|>user\\n{prompt}<|im_end|>\\n<|im_start|>assistant\\n

``"model"`` renders the model's own Jinja chat template (the tokenizer folder's
``chat_template.jinja``, or the ``chat_template`` of its ``tokenizer_config.json``, which
``nemo-rlhf-ckpt import-hf`` copies) the way Hugging Face's ``apply_chat_template(messages,
add_generation_prompt=True)`` renders it: a sandboxed Jinja environment with
``trim_blocks`` and ``lstrip_blocks``, the special tokens' texts (``bos_token``,
``eos_token``, ``pad_token``, ``unk_token``), ``raise_exception`` and ``strftime_now``.
The template writes the BOS itself where it wants one (Llama-3's does), so nothing is
prepended (:func:`nemo_rlhf.data.datasets.encode_prompt`).

The response follows the formatted prompt directly; the tokenizer's EOS ends it (for a
ChatML tokenizer that is usually ``<|im_end|>``). A chat row's conversation (``messages``,
ending with a user turn) is rendered whole by ``chatml`` and ``model``.
"""

from __future__ import annotations

from typing import Optional

from nemo_rlhf.config import check_choice

CHAT_TEMPLATES = (None, "chatml", "model")


def check_template(template: Optional[str], key: str = "data.chat_template") -> None:
    """Raise ``ValueError`` naming ``key`` when ``template`` is not a known template."""
    check_choice(key, template, CHAT_TEMPLATES)


def format_prompt(prompt: str, template: Optional[str] = None,
                  system_prompt: Optional[str] = None, tokenizer=None,
                  messages: Optional[list[dict]] = None) -> str:
    """The text the model sees before its response.

    Args:
        prompt: the user's prompt (the dataset's ``prompt`` field).
        template: ``None`` (raw prompt), ``"chatml"`` or ``"model"``.
        system_prompt: the system message; must be None without a template.
        tokenizer: a :class:`~nemo_rlhf.data.tokenizer.Tokenizer`; needed by ``"model"``
            (its ``chat_template`` and special tokens).
        messages: a conversation ending with a user turn (a chat row), rendered instead of
            ``prompt`` (its last user turn); ``system_prompt`` goes first unless the
            conversation has its own system message. Needs a template.

    Raises:
        ValueError: unknown template, a system prompt without a template, ``"model"``
            without a tokenizer that has a chat template, or the template's own
            ``raise_exception``.
    """
    check_template(template)
    if template is None:
        if system_prompt:
            raise ValueError("data.system_prompt is set but data.chat_template is null; "
                             "a system prompt needs a chat template ('chatml' or 'model')")
        if messages is not None and len(messages) > 1:
            raise ValueError("a chat row ('messages') with more than one message needs a chat "
                             "template: set data.chat_template=model or chatml")
        return prompt
    if messages is None:
        messages = [{"role": "user", "content": prompt}]
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if template == "model":
        return render_model_template(tokenizer, messages)
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) \
        + "<|im_start|>assistant\n"


def render_model_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """``messages`` through the tokenizer's Jinja chat template, as transformers'
    ``apply_chat_template(..., tokenize=False)`` renders it.

    Raises:
        ValueError: no tokenizer, a tokenizer without a chat template (names its folder and
            the files read), or the template's ``raise_exception(message)``.
    """
    if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
        where = "no tokenizer given" if tokenizer is None else (
            f"tokenizer {tokenizer.path} has none (looked for chat_template.jinja and the "
            f"'chat_template' of tokenizer_config.json)")
        raise ValueError(f"data.chat_template='model' needs the model's chat template: {where}; "
                         f"valid choices are {list(CHAT_TEMPLATES)}")
    template = _compiled(tokenizer.chat_template)
    specials = {k: getattr(tokenizer, k, None) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
    return template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                           tools=None, documents=None, **{k: v for k, v in specials.items() if v is not None})


_TEMPLATES: dict = {}


def _compiled(text: str):
    """The template compiled once per text (transformers' environment settings)."""
    if text not in _TEMPLATES:
        from datetime import datetime

        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ValueError(f"the model's chat template refused the messages: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        _TEMPLATES[text] = env.from_string(text)
    return _TEMPLATES[text]
