"""`--reasoning-parser deepseek_r1`: a reply's thinking apart from its answer, as vLLM
returns it: `reasoning_content` beside `content` (and `delta.reasoning_content` in a
stream). DeepSeek-R1 thinks in <think>...</think> before it answers; its chat template
opens the <think> itself, so a reply begins inside it. Everything before </think> is
reasoning (a <think> at its start dropped), everything after is content; a reply that
never closes its thinking is all reasoning. A stream holds back what could be the start
of </think>, as stop strings hold back theirs.
"""

from __future__ import annotations

from preload.worker.api.markers import unmarked_end

START, END = "<think>", "</think>"


def split(text: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of a whole reply; None for a part that is empty."""
    head, found, tail = text.partition(END)
    reasoning = head.removeprefix(START).lstrip("\n")
    content = tail.lstrip("\n") if found else ""
    return reasoning or None, content or None


class ReasoningStream:
    def __init__(self):
        self.text = ""
        self.reasoning_sent = 0  # characters of the reasoning (after any <think>) sent
        self.content_sent = 0  # characters of the content sent

    def delta(self, piece: str, last: bool) -> tuple[str, str]:
        """What `piece` adds: (reasoning, content)."""
        self.text += piece
        head, found, tail = self.text.partition(END)
        if not found and not last:
            head = head[: unmarked_end(head, END)]
            if START.startswith(head):  # (maybe the beginning of <think>: nothing to say yet)
                return "", ""
        reasoning = head.removeprefix(START).lstrip("\n")
        content = tail.lstrip("\n") if found else ""
        new = reasoning[self.reasoning_sent :], content[self.content_sent :]
        self.reasoning_sent, self.content_sent = len(reasoning), len(content)
        return new

