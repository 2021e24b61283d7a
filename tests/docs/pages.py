"""Read the documentation as the tests run it: fenced blocks, their directives, and the
check of a shown output against a printed one.

A page is README.md or any docs/**/*.md. A ```bash block is a command block: the test runs
it with bash, the page's blocks in order in one scratch folder, so a run trained by one
block is resumed by the next. The HTML comment on the line above a fence steers it:

    <!-- doc-test: skip="needs a CUDA GPU" -->      not run here, with the reason
    <!-- doc-test: args="--train.steps 2" -->      appended to each ptdp command of the block
    <!-- doc-test: exit=2 timeout=300 -->          expected exit status; seconds allowed
    <!-- doc-test: output -->                      on a ```text block: shown output of the
                                                   command block above it
    <!-- doc-test: output exact -->                the same, and its numbers must be the
                                                   printed ones (deterministic commands)

A shown output matches when each of its lines matches a printed line, in order; `...` on a
line of its own stands for any lines and inside a line for any text, runs of spaces match
any spacing, and numbers match any number unless the block says `exact`.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND_LANGS = {"bash", "sh", "shell", "console"}
DIRECTIVE = re.compile(r"^\s*<!--\s*doc-test:(.*?)-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)(.*)$")
NUMBER = re.compile(r"[-+]?\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?")
KEYS = {"skip", "args", "exit", "timeout", "output", "exact"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{_name(self.page)}:{self.line}"

    @property
    def is_command(self) -> bool:
        return self.lang in COMMAND_LANGS

    @property
    def is_output(self) -> bool:
        return "output" in self.options


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def parse_directive(text: str, where: str) -> dict[str, str]:
    options = {}
    for item in shlex.split(text):
        key, _, value = item.partition("=")
        if key not in KEYS:
            raise ValueError(f"{where}: unknown doc-test key {key!r}; known: {sorted(KEYS)}")
        options[key] = value
    if "skip" in options and not options["skip"].strip():
        raise ValueError(f'{where}: doc-test skip needs its reason: skip="needs a GPU"')
    return options


def blocks(page: Path) -> list[Block]:
    """The fenced blocks of a page with the directive written above each."""
    lines = page.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang, start = m.group(2), m.group(3).lower(), i
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            j += 1
        where = f"{_name(page)}:{start + 1}"
        d = DIRECTIVE.match(lines[start - 1]) if start else None
        options = parse_directive(d.group(1), where) if d else {}
        found.append(Block(page, start + 1, lang, "\n".join(lines[start + 1 : j]), options))
        i = j + 1
    return found


def _strip_comment(line: str) -> str:
    """The line without a trailing shell comment (a # after a space, outside quotes)."""
    quote = None
    for k, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (k == 0 or line[k - 1].isspace()):
            return line[:k].rstrip()
    return line


def is_ptdp_command(line: str) -> bool:
    words = line.split()
    return bool(words) and (
        words[0] == "ptdp"
        or ("-m" in words and "ptdp" in words[words.index("-m") + 1 : words.index("-m") + 2])
    )


def script(block: Block) -> str:
    """The block as bash runs it: continuation lines joined, each ptdp command given the
    directive's args, comments dropped."""
    joined, pending = [], ""
    for raw in block.text.splitlines():
        line = _strip_comment(raw) if not raw.lstrip().startswith("#") else ""
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.strip() and block.options.get("args") and is_ptdp_command(line.strip()):
            line = f"{line} {block.options['args']}"
        if line.strip():
            joined.append(line)
    return "\n".join(joined) + "\n"


def _line_pattern(shown: str, exact: bool) -> re.Pattern[str]:
    parts, pos = [], 0
    text = shown.strip()
    tokens = re.finditer(r"\.\.\.|\s+|" + NUMBER.pattern, text)
    for m in tokens:
        parts.append(re.escape(text[pos : m.start()]))
        tok = m.group(0)
        if tok == "...":
            parts.append(".*?")
        elif tok.isspace():
            parts.append(r"\s+")
        elif exact:
            parts.append(re.escape(tok))
        else:
            parts.append(NUMBER.pattern)
        pos = m.end()
    parts.append(re.escape(text[pos:]))
    return re.compile(r"\s*" + "".join(parts) + r"\s*$")


def output_mismatch(shown: str, printed: str, exact: bool = False) -> str | None:
    """None when every shown line matches a printed line in order, else what is missing."""
    printed_lines = printed.splitlines()
    k = 0
    for shown_line in shown.splitlines():
        if not shown_line.strip() or shown_line.strip() == "...":
            continue
        pattern = _line_pattern(shown_line, exact)
        while k < len(printed_lines) and not pattern.match(printed_lines[k].strip()):
            k += 1
        if k == len(printed_lines):
            return f"the shown line\n    {shown_line.strip()}\nis not printed (in this order)"
        k += 1
    return None


def page_env(warm_bin: Path | None = None) -> dict[str, str]:
    """The pages' environment: the venv's `ptdp` first on PATH, or the warm client before it."""
    env = dict(os.environ)
    path = [str(warm_bin)] * (warm_bin is not None) + [str(Path(sys.executable).parent)]
    env["PATH"] = os.pathsep.join([*path, env.get("PATH", "")])
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}".rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env
