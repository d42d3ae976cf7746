"""``--where`` filters: a small grammar over a table's scalar columns, parsed into a pyarrow expression.

The text is tokenised and parsed by hand (recursive descent), never evaluated, so a filter can only name
columns, compare them with literals and combine the comparisons::

    expr       := or
    or         := and ("or" and)*
    and        := not ("and" not)*
    not        := "not" not | "(" expr ")" | comparison
    comparison := COLUMN OP literal | COLUMN "is" ["not"] "null"
                | COLUMN ["not"] "in" "(" literal ("," literal)* ")"
    OP         := "==" | "=" | "!=" | "<>" | "<" | "<=" | ">" | ">="
    literal    := number | 'text' | "text" | true | false

Keywords are case-insensitive; a text literal is compared with text columns, a number with numeric ones
(and a timestamp column takes an ISO 8601 text such as ``'2026-01-31T12:00:00+00:00'``).

Example:
    >>> expr = parse_where("reward > 0 and (node == 'solver' or policy_version >= 2)", SAMPLE_SCHEMA)
    >>> store.read("samples/solver", filter=expr)
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from datetime import datetime

import pyarrow as pa
import pyarrow.compute as pc

OPERATORS = {"==": "eq", "=": "eq", "!=": "ne", "<>": "ne", "<": "lt", "<=": "le", ">": "gt", ">=": "ge"}
KEYWORDS = {"and", "or", "not", "is", "null", "in", "true", "false"}
_TOKEN = re.compile(
    r"""\s*(?:
        (?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)
      | (?P<text>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")
      | (?P<op><=|>=|==|!=|<>|<|>|=)
      | (?P<punct>[(),])
      | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.VERBOSE,
)


class PredicateError(ValueError):
    """A ``--where`` text that does not parse or names a column that cannot be compared."""


@dataclass(frozen=True)
class Token:
    kind: str  # number, text, op, punct, word, end
    value: str
    pos: int  # offset in the text, for the error's caret


def tokenize(text: str) -> list[Token]:
    tokens, pos = [], 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise _error(text, pos, f"unexpected character {text[pos:].lstrip()[:1]!r}")
        kind = m.lastgroup or "end"
        tokens.append(Token(kind, m.group(kind), m.start(kind)))
        pos = m.end()
    tokens.append(Token("end", "", len(text)))
    return tokens


def parse_where(text: str, schema: pa.Schema) -> pc.Expression:
    """Parse ``text`` into a pyarrow expression over ``schema``'s scalar columns.

    Raises:
        PredicateError: a syntax error (with its position), an unknown or list-valued column (naming the
            valid columns), or a literal of the wrong type for its column.
    """
    if not text.strip():
        raise PredicateError("the filter is empty; give a condition such as \"reward > 0\"")
    return _Parser(text, schema).parse()


def scalar_columns(schema: pa.Schema) -> list[str]:
    """The columns a filter may compare: numbers, text, booleans and timestamps (not lists or maps)."""
    return [f.name for f in schema if _kind(f.type) is not None]


def _kind(t: pa.DataType) -> str | None:
    if pa.types.is_integer(t) or pa.types.is_floating(t):
        return "number"
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "text"
    if pa.types.is_boolean(t):
        return "bool"
    if pa.types.is_timestamp(t):
        return "timestamp"
    return None


def _error(text: str, pos: int, message: str, hint: str = "") -> PredicateError:
    caret = f"\n  {text}\n  {' ' * pos}^"
    return PredicateError(f"{message} at position {pos + 1} of the filter:{caret}" + (f"\n{hint}" if hint else ""))


class _Parser:
    def __init__(self, text: str, schema: pa.Schema) -> None:
        self.text = text
        self.schema = schema
        self.tokens = tokenize(text)
        self.i = 0

    # -------------------------------------------------------------- token helpers

    @property
    def tok(self) -> Token:
        return self.tokens[self.i]

    def _is_word(self, *words: str) -> bool:
        return self.tok.kind == "word" and self.tok.value.lower() in words

    def _take(self) -> Token:
        tok = self.tok
        self.i += 1
        return tok

    def _expect(self, kind: str, value: str, what: str) -> None:
        if self.tok.kind != kind or self.tok.value != value:
            raise self._fail(f"expected {what}")
        self._take()

    def _fail(self, message: str) -> PredicateError:
        found = "the end" if self.tok.kind == "end" else repr(self.tok.value)
        return _error(self.text, self.tok.pos, f"{message}, found {found}")

    # -------------------------------------------------------------- grammar

    def parse(self) -> pc.Expression:
        expr = self._or()
        if self.tok.kind != "end":
            raise self._fail("expected 'and', 'or' or the end of the filter")
        return expr

    def _or(self) -> pc.Expression:
        expr = self._and()
        while self._is_word("or"):
            self._take()
            expr = expr | self._and()
        return expr

    def _and(self) -> pc.Expression:
        expr = self._not()
        while self._is_word("and"):
            self._take()
            expr = expr & self._not()
        return expr

    def _not(self) -> pc.Expression:
        if self._is_word("not"):
            self._take()
            return ~self._not()
        if self.tok.kind == "punct" and self.tok.value == "(":
            self._take()
            expr = self._or()
            self._expect("punct", ")", "')'")
            return expr
        return self._comparison()

    def _comparison(self) -> pc.Expression:
        column, kind = self._column()
        field = pc.field(column)
        if self._is_word("is"):
            self._take()
            negate = self._is_word("not")
            if negate:
                self._take()
            if not self._is_word("null"):
                raise self._fail("expected 'null' after 'is'")
            self._take()
            return field.is_valid() if negate else field.is_null()
        negate = self._is_word("not")
        if negate:
            self._take()
            if not self._is_word("in"):
                raise self._fail("expected 'in' after 'not'")
        if self._is_word("in"):
            self._take()
            self._expect("punct", "(", "'(' after 'in'")
            values = [self._literal(column, kind)]
            while self.tok.kind == "punct" and self.tok.value == ",":
                self._take()
                values.append(self._literal(column, kind))
            self._expect("punct", ")", "',' or ')'")
            expr = field.isin(values)
            return ~expr if negate else expr
        if self.tok.kind != "op":
            raise self._fail(f"expected a comparison after {column!r} (==, !=, <, <=, >, >=, is null, in (...))")
        op = OPERATORS[self._take().value]
        return getattr(field, f"__{op}__")(self._literal(column, kind))

    def _column(self) -> tuple[str, str]:
        tok = self.tok
        if tok.kind != "word" or tok.value.lower() in KEYWORDS:
            raise self._fail("expected a column name")
        valid = scalar_columns(self.schema)
        if tok.value not in self.schema.names:
            close = difflib.get_close_matches(tok.value, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise _error(self.text, tok.pos, f"unknown column {tok.value!r}{hint}",
                         f"valid columns: {', '.join(valid)}")
        kind = _kind(self.schema.field(tok.value).type)
        if kind is None:
            raise _error(self.text, tok.pos, f"column {tok.value!r} holds lists, which a filter cannot compare",
                         f"valid columns: {', '.join(valid)}")
        self._take()
        return tok.value, kind

    def _literal(self, column: str, kind: str) -> object:
        tok = self.tok
        if tok.kind == "number":
            value: object = float(tok.value) if re.search(r"[.eE]", tok.value) else int(tok.value)
            found = "number"
        elif tok.kind == "text":
            value = re.sub(r"\\(.)", r"\1", tok.value[1:-1])
            found = "text"
        elif self._is_word("true", "false"):
            value, found = tok.value.lower() == "true", "bool"
        elif tok.kind == "word":  # a bare word: most likely text without its quotes
            raise self._fail(f"expected a value to compare {column!r} with (quote text: {column} == '{tok.value}')")
        else:
            raise self._fail(f"expected a value to compare {column!r} with")
        if kind == "timestamp" and found == "text":
            try:
                value = datetime.fromisoformat(str(value))
            except ValueError:
                raise _error(self.text, tok.pos, f"{column!r} is a timestamp: give an ISO 8601 time such as "
                                                 "'2026-01-31T12:00:00+00:00'") from None
        elif kind != found:
            example = {"text": f"{column} == 'solver'", "number": f"{column} > 0", "bool": f"{column} == true",
                       "timestamp": f"{column} > '2026-01-31T12:00:00+00:00'"}[kind]
            raise _error(self.text, tok.pos, f"{column!r} holds {kind} values but {tok.value} is {found}; "
                                             f"e.g. {example}")
        self._take()
        return value
