"""The code of the Markdown docs, for the tests that keep README.md and docs/*.md true (test_readme, test_docs):
fenced blocks, the shell commands in them and the ``stratum`` command lines among those."""

from __future__ import annotations

import re
import shlex

FENCE = re.compile(r"^[ \t]*```([\w-]*)\n(.*?)^[ \t]*```", flags=re.M | re.S)


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, body) of every fenced block, in order; an unlabelled block's language is ""."""
    return FENCE.findall(text)


def command_lines(body: str) -> list[str]:
    """A shell block's commands, one a line: lines ending in a backslash joined to the next, comments (``  #``
    and whole-line ``#``) and blank lines left out."""
    out = []
    for line in re.sub(r"\s*\\\n\s*", " ", body).splitlines():
        command = line.split("  #")[0].strip()
        if command and not command.startswith("#"):
            out.append(command)
    return out


def bash_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks."""
    return [c for lang, body in fenced_blocks(text) if lang == "bash" for c in command_lines(body)]


def stratum_argv(command: str) -> list[str] | None:
    """The arguments after ``stratum`` of a command that runs it (``stratum …``, ``$ stratum …``, ``ENV=x stratum
    …``, ``torchrun … -m stratum …``), else None. Optional parts written ``[--flag value]`` count as given, and an
    elided ``…`` is left out."""
    command = re.sub(r"\[(--[^\[\]]*)\]", r"\1", command.removeprefix("$ "))
    try:
        words = [w for w in shlex.split(command) if w not in ("…", "...")]
    except ValueError:
        return None
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        words.pop(0)
    if words[:1] == ["stratum"]:
        return words[1:]
    if words[:1] == ["torchrun"] and "-m" in words and words[words.index("-m") + 1:][:1] == ["stratum"]:
        return words[words.index("-m") + 2:]
    return None
