"""The `filter` parameter of Compute Engine list methods.

Supported, as the real API documents it:
- comparisons `FIELD = VALUE`, `!=`, `<`, `>`, `<=`, `>=`, and `:` ("has"; `FIELD:*` tests
  presence). VALUE is a bare word or a double-quoted string; `*` is a wildcard in `=`/`!=`.
- terms joined by `AND`, `OR`, or juxtaposition (`(a = 1) (b = 2)`), `NOT`/`-` prefixes, and
  parentheses;
- the legacy single-term form `FIELD eq REGEX` / `FIELD ne REGEX` (full-match RE2 regex).
FIELD is a dotted path into the resource (`labels.env`, `scheduling.preemptible`); a list on
the way matches if any element does.
"""

from __future__ import annotations

import fnmatch
import re
from typing import Callable

from .errors import invalid

Predicate = Callable[[dict], bool]

_TOKEN = re.compile(
    r'\s*(?:(?P<str>"(?:[^"\\]|\\.)*")|(?P<op><=|>=|!=|=|<|>|:)|(?P<paren>[()])|(?P<word>[^\s()=!<>:"]+))'
)


def parse_filter(text: str | None) -> Predicate:
    if not text or not text.strip():
        return lambda resource: True
    legacy = re.fullmatch(r"\s*([\w.]+)\s+(eq|ne)\s+(.+?)\s*", text)
    if legacy:
        field, op, pattern = legacy.groups()
        pattern = pattern.strip('"').strip("'")
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise invalid(f"Invalid list filter expression '{text}': {exc}") from None

        def match(resource: dict) -> bool:
            hit = any(regex.fullmatch(_text(v)) for v in _values(resource, field))
            return hit if op == "eq" else not hit

        return match
    return _Parser(text).parse()


def _values(resource: object, path: str) -> list:
    values = [resource]
    for part in path.split("."):
        found = []
        for value in values:
            items = value if isinstance(value, list) else [value]
            for item in items:
                if isinstance(item, dict) and part in item:
                    found.append(item[part])
        values = found
    flat = []
    for value in values:
        flat.extend(value if isinstance(value, list) else [value])
    return flat


def _text(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _compare(value: object, op: str, literal: str) -> bool:
    text = _text(value)
    if op == "=":
        return fnmatch.fnmatchcase(text, literal) if "*" in literal else text == literal
    if op == "!=":
        return not _compare(value, "=", literal)
    if op == ":":
        return literal == "*" or fnmatch.fnmatchcase(text, f"*{literal}*")
    left: object = text
    right: object = literal
    try:
        left, right = float(text), float(literal)
    except ValueError:
        pass
    return {"<": left < right, ">": left > right, "<=": left <= right, ">=": left >= right}[op]  # type: ignore[operator]


class _Parser:
    def __init__(self, text: str) -> None:
        self.text = text
        self.tokens: list[tuple[str, str]] = []
        pos = 0
        while pos < len(text):
            m = _TOKEN.match(text, pos)
            if not m or m.end() == pos:
                if text[pos:].strip() == "":
                    break
                self._fail()
            pos = m.end()
            kind = m.lastgroup
            if kind:
                self.tokens.append((kind, m.group(kind)))
        self.i = 0

    def _fail(self) -> None:
        raise invalid(f"Invalid list filter expression '{self.text}'.")

    def _peek(self) -> tuple[str, str] | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _next(self) -> tuple[str, str]:
        token = self._peek()
        if token is None:
            self._fail()
        self.i += 1
        return token  # type: ignore[return-value]

    def parse(self) -> Predicate:
        predicate = self._or()
        if self._peek() is not None:
            self._fail()
        return predicate

    def _or(self) -> Predicate:
        left = self._and()
        while self._peek() == ("word", "OR"):
            self.i += 1
            right = self._and()
            left = (lambda a, b: lambda r: a(r) or b(r))(left, right)
        return left

    def _and(self) -> Predicate:
        left = self._unary()
        while True:
            token = self._peek()
            if token is None or token == ("paren", ")") or token == ("word", "OR"):
                return left
            if token == ("word", "AND"):
                self.i += 1
            right = self._unary()
            left = (lambda a, b: lambda r: a(r) and b(r))(left, right)

    def _unary(self) -> Predicate:
        token = self._peek()
        if token == ("word", "NOT"):
            self.i += 1
            inner = self._unary()
            return lambda r: not inner(r)
        if token and token[0] == "word" and token[1].startswith("-") and len(token[1]) > 1:
            # `-labels.env:*` negates a term.
            self.tokens[self.i] = ("word", token[1][1:])
            inner = self._unary()
            return lambda r: not inner(r)
        if token == ("paren", "("):
            self.i += 1
            inner = self._or()
            if self._next() != ("paren", ")"):
                self._fail()
            return inner
        return self._comparison()

    def _comparison(self) -> Predicate:
        kind, field = self._next()
        if kind != "word":
            self._fail()
        kind, op = self._next()
        if kind != "op":
            self._fail()
        kind, literal = self._next()
        if kind == "str":
            literal = re.sub(r"\\(.)", r"\1", literal[1:-1])
        elif kind != "word":
            self._fail()
        if op == "!=":
            # A missing field is "not equal" to anything.
            return lambda r: not any(_compare(v, "=", literal) for v in _values(r, field))
        return lambda r: any(_compare(v, op, literal) for v in _values(r, field))
