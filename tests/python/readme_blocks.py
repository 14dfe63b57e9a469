"""The fenced code blocks of the README, for the tests that run them."""

import re
from dataclasses import dataclass
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"

NOT_RUN_MARK = "<!-- not-run -->"


@dataclass
class Block:
    tag: str
    line: int  # of the opening fence, 1-based
    code: str
    not_run: bool = False

    def __str__(self):
        return f"README.md:{self.line} ```{self.tag}"


def extract_blocks(text):
    """The fenced code blocks of a Markdown text, with their language tag and line."""
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        opening = re.match(r"^(`{3,}|~{3,})\s*([^\s`]*)", lines[i])
        if opening is None:
            i += 1
            continue
        fence, tag = opening.group(1), opening.group(2).lower()
        previous = next((line.strip() for line in reversed(lines[:i]) if line.strip()), "")
        closing = re.compile(rf"^{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        j = i + 1
        while j < len(lines) and not closing.match(lines[j]):
            j += 1
        if j == len(lines):
            raise ValueError(f"line {i + 1}: the code fence is never closed")
        blocks.append(Block(tag, i + 1, "\n".join(lines[i + 1:j]) + "\n", previous == NOT_RUN_MARK))
        i = j + 1
    return blocks


def readme_block(tag, containing):
    """The README's one fenced ```tag block that contains the text ``containing``."""
    found = [block.code for block in extract_blocks(README.read_text(encoding="utf-8"))
             if block.tag == tag and containing in block.code]
    assert len(found) == 1, (tag, containing, len(found))
    return found[0]
