"""What every reasoning parser is: ``ReasoningParser``."""

from __future__ import annotations

from typing import ClassVar, Protocol


class ReasoningParser(Protocol):
    """Splits one choice's text as it streams into the reasoning and the content (one per choice).

    ``feed(text, final)`` -> (reasoning, content) of ``text``: what may still become a tag is held back
    until it is complete; ``final``: the choice ended, nothing more comes."""

    end: ClassVar[str]  # the text that closes the reasoning: a structured output's grammar applies after it

    __slots__ = ()

    def __init__(self, opened_by_prompt: bool) -> None:
        """``opened_by_prompt``: the prompt left the model inside the reasoning (``prompt_opens``)."""

    @staticmethod
    def prompt_opens(prompt_text: str) -> bool:
        """The rendered prompt ends inside the reasoning (a template that opens it for the model)."""
        ...

    def feed(self, text: str, final: bool) -> tuple[str, str]: ...
