"""code_sha256: a hash of what a C++/CUDA source compiles to, blind to comments and layout.

The text is cut into preprocessing tokens the way a C++ compiler reads it: lines joined at a
backslash-newline, `//` and `/* */` comments dropped (never inside a string or character literal,
nor a digit separator such as 1'000), whitespace between tokens dropped. Only the end of a
preprocessor directive's line is kept, since it ends the directive. Two sources with the same
tokens get the same hash, so a comment, an indentation or a line break does not change it;
a changed token does. `gen-programs diff` reports programs whose code_sha256 changed.
"""
from __future__ import annotations

import functools
import hashlib
import re

_ENCODING_PREFIX = r"(?:u8|u|U|L)?"
# Longest punctuators first, so that `>>=` is one token and not `>>` `=`.
_PUNCTUATORS = sorted((
    "%:%:", "...", "<=>", "<<=", ">>=", "->*",
    "::", "->", "++", "--", "<<", ">>", "<=", ">=", "==", "!=", "&&", "||", "+=", "-=", "*=", "/=", "%=",
    "&=", "|=", "^=", "##", ".*", "<:", ":>", "<%", "%>", "%:",
), key=len, reverse=True)
_TOKEN_RE = re.compile("|".join((
    r"(?P<line_comment>//[^\n]*)",
    r"(?P<block_comment>/\*.*?\*/)",
    r"(?P<unterminated_comment>/\*)",
    rf"(?P<raw_string>{_ENCODING_PREFIX}R\"(?P<delimiter>[^()\\\s]{{0,16}})\(.*?\)(?P=delimiter)\")",
    rf"(?P<string>{_ENCODING_PREFIX}\"(?:\\.|[^\"\\\n])*\")",
    rf"(?P<char>{_ENCODING_PREFIX}'(?:\\.|[^'\\\n])*')",
    r"(?P<number>\.?[0-9](?:[eEpP][+-]|'[0-9A-Za-z_]|[0-9A-Za-z_.])*)",
    r"(?P<identifier>[A-Za-z_$][A-Za-z0-9_$]*)",
    r"(?P<newline>\n)",
    r"(?P<space>[ \t\r\f\v]+)",
    "(?P<punctuator>" + "|".join(re.escape(p) for p in _PUNCTUATORS) + ")",
    r"(?P<other>.)",
)), re.DOTALL)


def code_tokens(text: str) -> list[str]:
    """The preprocessing tokens of a C++ source, comments and whitespace dropped; "\\n" marks the
    end of each preprocessor directive."""
    text = text.replace("\r\n", "\n").replace("\\\n", "")
    tokens: list[str] = []
    in_directive = False
    line_start = True  # no token yet on this line
    for match in _TOKEN_RE.finditer(text):
        kind = match.lastgroup if match.lastgroup != "delimiter" else "raw_string"
        if kind == "unterminated_comment":
            raise ValueError("text: a /* comment is not closed")
        if kind in ("line_comment", "block_comment", "space"):
            continue
        if kind == "newline":
            if in_directive:
                tokens.append("\n")
            in_directive, line_start = False, True
            continue
        token = match.group()
        if line_start and token in ("#", "%:"):
            in_directive = True
        line_start = False
        tokens.append(token)
    if in_directive:
        tokens.append("\n")
    return tokens


@functools.lru_cache(maxsize=64)  # the body headers are hashed again with every program
def _code_bytes(text: str) -> bytes:
    return " ".join(code_tokens(text)).encode("utf-8")


def code_sha256(*texts: str) -> str:
    """sha256 of the tokens of each text in turn (a text boundary is part of what is hashed)."""
    digest = hashlib.sha256()
    for text in texts:
        code = _code_bytes(text)
        digest.update(f"{len(code)}\0".encode())
        digest.update(code)
    return digest.hexdigest()
