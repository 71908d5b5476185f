"""The ```python blocks of the README and the guide, as the tests that run or type-check them read them."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = (ROOT / "README.md", ROOT / "docs" / "GUIDE.md")


def python_blocks(text: str) -> list[str]:
    """Every ```python block of the Markdown `text`, in order, without its fences."""
    return re.findall(r"^```python\n(.*?)^```$", text, re.S | re.M)


def block_under(path: Path, heading: str) -> str:
    """The first ```python block after the line `heading` in the Markdown file `path`."""
    text = path.read_text(encoding="utf-8")
    return python_blocks(text[text.index(f"\n{heading}\n") :])[0]
