"""Chat messages -> the token ids the policy reads, one turn at a time.

An episode is one token sequence: the opening prompt, then each reply *as sampled* (its token ids, never
re-tokenised from its text), then what the environment said, then the next reply. :class:`Renderer` gives the
opening's ids and, after each reply, the ids that continue the sequence to the next generation prompt.

Chat models go through their chat template. The continuation is the template's own text: the conversation so far
is rendered with the last reply replaced by a placeholder, once without and once with the new messages and the
generation prompt; what the second adds to the first, after the template's end-of-turn text (less the
end-of-sequence token the reply already ends with), is the continuation. Written by hand because transformers'
templates render whole conversations only; verl and TRL extend episodes the same way. A template that rewrites
earlier turns when new ones arrive (some drop a reasoning block from past replies) does not extend its own text:
then :meth:`Renderer.continuation` returns None and the caller starts a new sequence from the whole conversation.

Models without a chat template (the built-in one) read plain text: each message's content and a newline; a reply
ends with the end-of-sequence token.

Tools: a template that shows tools (``apply_chat_template(tools=...)`` changes its output) gets them that way;
otherwise, and for plain models, a system message describes them and the text protocol of
:mod:`grpolab.env.tools` (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``).
"""

from __future__ import annotations

from grpolab.env.protocol import EnvError

PLACEHOLDER = "grpolabreplyplaceholder"


class Renderer:
    """Messages to token ids for ``policy`` (a :class:`grpolab.models.policy.Policy`); ``tools``: JSON schemas the model
    may call (``grpolab.env.tools.tool_schemas``)."""

    def __init__(self, policy, tools: list[dict] | None = None):
        self.policy, self.tok = policy, policy.tokenizer
        self.processor = getattr(policy, "processor", None)  # a vision-language model's: its template, its images
        self.template = self.processor or self.tok
        self.tools = list(tools or [])
        self.chat = bool(policy.chat)
        self.native_tools = bool(self.tools) and self.chat and _template_shows_tools(self.template, self.tools)
        self.tool_role = "tool" if not self.chat or _template_renders(self.template, "tool") else "user"
        eos = self.tok.eos_token_id
        self.eos_text = self.tok.decode([eos]) if eos is not None else ""

    # ------------------------------------------------------------------ what the template sees
    def template_messages(self, messages: list[dict]) -> list[dict]:
        """The messages as given to the template: the run's system prompt first when they have none
        (:meth:`grpolab.models.policy.Policy.chat_messages`), the tools' description when the template does not show
        tools, tool results as user messages for a template that has no tool role."""
        msgs = self.policy.chat_messages({"prompt": list(messages)}) if self.chat else list(messages)
        if self.tools and not self.native_tools:
            from grpolab.env.tools import tool_instructions

            msgs = _with_system_text(msgs, tool_instructions(self.tools))
        if self.tool_role != "tool":
            msgs = [
                {"role": "user", "content": "Tool result:\n" + m["content"]} if m["role"] == "tool" else m for m in msgs
            ]
        if self.policy.family is not None:  # every content a list of parts, as vision-language templates read them
            from grpolab.vision.processing import with_image_parts

            msgs = with_image_parts(msgs, 0)
        return msgs

    def _render(self, messages: list[dict], generation: bool) -> str:
        kwargs = {"tools": self.tools} if self.native_tools else {}
        try:
            return self.template.apply_chat_template(
                self.template_messages(messages), tokenize=False, add_generation_prompt=generation, **kwargs
            )
        except Exception as e:  # noqa: BLE001 - a template that refuses a conversation: say which, in one line
            raise EnvError(f"the chat template cannot render this conversation: {type(e).__name__}: {e}") from None

    def _ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def _inputs(self, text: str, messages: list[dict]):
        """``(ids, media)`` of a rendered ``text`` that shows ``messages``' images (a vision-language policy's: each
        image's placeholder expanded, its pixels in a :class:`grpolab.vision.media.Media`); ``(ids, None)`` else."""
        if self.processor is None:
            return self._ids(text), None
        from grpolab.vision.processing import encode_text, part_images

        return encode_text(self.processor, self.policy.family, text, part_images(messages))

    # ------------------------------------------------------------------ the two pieces of a sequence
    def opening_inputs(self, messages: list[dict]):
        """:meth:`opening` with the images its messages show: ``(ids, media)`` (media None without images)."""
        if self.chat:
            return self._inputs(self._render(messages, generation=True), messages)
        msgs = list(messages)
        if self.tools:
            from grpolab.env.tools import tool_instructions

            msgs = _with_system_text(msgs, tool_instructions(self.tools))
        bos = self.tok.bos_token_id
        return ([bos] if bos is not None else []) + self._ids(_plain(msgs)), None

    def continuation_inputs(self, conversation: list[dict], ended: bool, new: list[dict]):
        """:meth:`continuation` with the images the ``new`` messages show: ``(ids, media)``, or None."""
        if not self.chat:
            return ([] if ended else [self.tok.eos_token_id]) + self._ids(_plain(new)), None
        text = self._continuation_text(conversation, ended, new)
        return None if text is None else self._inputs(text, new)

    def opening(self, messages: list[dict]) -> list[int]:
        """The prompt of a sequence that starts with ``messages``, ending with the generation prompt."""
        return self.opening_inputs(messages)[0]

    def continuation(self, conversation: list[dict], ended: bool, new: list[dict]) -> list[int] | None:
        """The ids after the last reply of ``conversation`` (its last message, the assistant's) up to the next
        generation prompt, with the ``new`` messages between; ``ended``: the reply ends with the end-of-sequence
        token. None when the template's text for the longer conversation does not extend its text for this one."""
        got = self.continuation_inputs(conversation, ended, new)
        return None if got is None else got[0]

    def _continuation_text(self, conversation: list[dict], ended: bool, new: list[dict]) -> str | None:
        """The text of :meth:`continuation` (chat templates), or None."""
        head = conversation[:-1] + [{"role": "assistant", "content": PLACEHOLDER}]
        before = self._render(conversation[:-1], generation=True)
        upto = self._render(head, generation=False)
        after = self._render(head + new, generation=True)
        if not (upto.startswith(before + PLACEHOLDER) and after.startswith(upto)):
            return None
        closing = upto[upto.rindex(PLACEHOLDER) + len(PLACEHOLDER) :]  # the template's end of an assistant turn
        if ended and self.eos_text and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text) :]  # the reply's own last token already is it
        return closing + after[len(upto) :]


def _plain(messages: list[dict]) -> str:
    """Plain text of messages: each one's content and a newline (roles are not written)."""
    return "".join(m["content"] + "\n" for m in messages)


def _with_system_text(messages: list[dict], text: str) -> list[dict]:
    """``text`` appended to the first system message (or as a system message of its own, first)."""
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"].rstrip() + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def _template_shows_tools(tok, tools: list[dict]) -> bool:
    """Whether the chat template's output changes when it is given ``tools`` (many ignore them)."""
    msgs = [{"role": "user", "content": "hi"}]
    try:
        plain = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        shown = tok.apply_chat_template(msgs, tools=tools, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that fails on tools does not show them
        return False
    return shown != plain


def _template_renders(tok, role: str) -> bool:
    """Whether the chat template renders a message of ``role`` after an assistant turn."""
    msgs = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "x"},
        {"role": role, "content": "y"},
    ]
    try:
        return "y" in tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that refuses the role does not render it
        return False
