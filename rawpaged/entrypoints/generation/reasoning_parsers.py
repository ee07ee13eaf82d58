"""Reasoning models' thinking split out of the answer (vLLM's ``--reasoning-parser``, ``vllm/reasoning/``):
text between ``<think>`` and ``</think>`` goes to the message's ``reasoning`` (and ``reasoning_content``,
the older name many clients read), the rest to ``content``, in full messages and in stream deltas. Tool
parsing sees only the content.

- ``qwen3``: the output reasons only if it begins with ``<think>`` (Qwen3 with
  ``chat_template_kwargs: {"enable_thinking": false}`` begins with the answer: nothing is parsed).
- ``deepseek_r1``: the chat template opens ``<think>`` in the prompt, so the output starts in reasoning
  (a ``<think>`` it repeats is dropped) until ``</think>``.

An output cut off before ``</think>`` is all reasoning. The engine's side (structured outputs apply after
the reasoning ends) is ``EngineConfig.reasoning_parser``.
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"
#: parser name -> whether the output starts in reasoning
PARSERS = {"qwen3": False, "deepseek_r1": True}


def _held_tail(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag`` (held back: the tag may be arriving)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    """One choice's text, fed piece by piece (``feed``, then ``finish`` once): each call returns the
    ``(reasoning, content)`` it adds. Text that may begin a tag is held back until it is known."""

    def __init__(self, name: str):
        if name not in PARSERS:
            raise ValueError(f"reasoning parser {name!r} is not one of {sorted(PARSERS)}")
        self.starts_in_reasoning = PARSERS[name]
        self.state = "start"  # nothing decided yet, then "reasoning", then "content"
        self.buffer = ""
        self.reasoned = False  # whether any of the output was reasoning

    def feed(self, text: str) -> tuple:
        self.buffer += text
        reasoning, content = "", ""
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(THINK_START):
                self.buffer = head[len(THINK_START) :]
                self.state = "reasoning"
            elif THINK_START.startswith(head):  # "", "<", "<th": not known yet
                return "", ""
            else:
                self.state = "reasoning" if self.starts_in_reasoning else "content"
            self.reasoned = self.state == "reasoning"
        if self.state == "reasoning":
            end = self.buffer.find(THINK_END)
            if end < 0:
                keep = _held_tail(self.buffer, THINK_END)
                reasoning, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                return reasoning, ""
            reasoning, self.buffer = self.buffer[:end], self.buffer[end + len(THINK_END) :]
            self.state = "content"
        if self.state == "content":
            content, self.buffer = self.buffer, ""
        return reasoning, content

    def finish(self) -> tuple:
        """What is still held back: reasoning inside an unfinished ``<think>``, else content."""
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning" or (self.state == "start" and self.starts_in_reasoning):
            self.reasoned = True
            return rest, ""
        return "", rest


def split_reasoning(name: str, text: str) -> tuple:
    """``(reasoning or None, content)`` of a whole output."""
    parser = ReasoningParser(name)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return (r1 + r2 if parser.reasoned else None), c1 + c2


def reasoning_token_count(name: str | None, tokenizer, token_ids) -> int:
    """How many of an output's ``token_ids`` are its reasoning, by parser ``name`` (None: no parser, 0):
    the tokens up to the one that completes ``</think>`` (the tags counted with the reasoning, as OpenAI's
    ``reasoning_tokens`` count every hidden token); all of them for an output cut off inside its reasoning;
    0 for one that did not reason."""
    if name is None or not token_ids:
        return 0
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    reasoning, _ = split_reasoning(name, text)
    if reasoning is None:
        return 0
    if THINK_END not in text:
        return len(token_ids)
    lo, hi = 1, len(token_ids)  # the fewest leading tokens whose text holds THINK_END
    while lo < hi:
        mid = (lo + hi) // 2
        if THINK_END in tokenizer.decode(token_ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo
