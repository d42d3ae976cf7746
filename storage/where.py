"""``--where`` filters: one SQL condition over a table's scalar columns, run by deltalake's QueryBuilder.

DataFusion parses and evaluates the condition (``and``, ``or``, ``not``, parentheses, comparisons,
``is [not] null``, ``[not] in (...)``). Before it sees the text, ``check_where`` scans it with a short
allow-list, because the text is spliced into SQL: every word must be one of the table's scalar columns or
``and or not is null in true false``, and nothing but literals, comparison operators, parentheses and commas
may appear. So no second statement (``;``), comment, subquery, ``union``, function call or cast can get in.
The scan also refuses a literal of the wrong kind beside a column (``node == 3``), which DataFusion would
coerce, failing only when it reads a row it cannot convert.

Example:
    >>> rows = select_where(store.open("samples/solver"), "reward > 0 and node == 'solver'", SAMPLE_SCHEMA)
"""

from __future__ import annotations

import difflib
import re
from datetime import datetime

import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder
from deltalake.exceptions import DeltaError

KEYWORDS = {"and", "or", "not", "is", "null", "in", "true", "false"}
# Tokens as DataFusion's generic dialect reads them (pinned in select_where): text escapes a quote as ''.
_TOKEN = re.compile(
    r"""\s*(?:
        (?P<number>[-+]?(?:\d+\.\d*|\.\d+|\d+)(?:[eE][-+]?\d+)?)
      | (?P<text>'(?:[^']|'')*')
      | (?P<op><=|>=|==|!=|<>|<|>|=)
      | (?P<punct>[(),])
      | (?P<word>[A-Za-z_][A-Za-z0-9_]*)
    )""",
    re.VERBOSE | re.ASCII,  # ASCII digits and spaces only, as DataFusion's tokenizer reads them
)
_EXAMPLE = {"text": "{c} == 'solver'", "number": "{c} > 0", "bool": "{c} == true",
            "timestamp": "{c} > '2026-01-31T12:00:00+00:00'"}
_PARSER_ERROR = re.compile(r'(?:Parser|Tokenizer)Error\("(.*?)(?: at Line: (\d+), Column: (\d+))?"\)')


class FilterError(ValueError):
    """A ``--where`` text that is not one condition over the table's scalar columns."""


def filter_columns(schema: pa.Schema) -> list[str]:
    """The columns a filter may name: numbers, text, booleans and timestamps (not lists or maps)."""
    return [f.name for f in schema if _kind(f.type) is not None]


def select_where(dt: DeltaTable, where: str | None, schema: pa.Schema, *, also: str | None = None) -> pa.Table:
    """The rows of ``dt`` (a table of ``schema``) that match ``where``, and ``also``: trusted SQL of ours.

    Raises:
        FilterError: ``where`` fails ``check_where``, or DataFusion cannot parse or plan it.
    """
    source = "t" if also is None else f"(SELECT * FROM t WHERE {also}) AS t"
    sql = f"SELECT * FROM {source}"
    if where is not None:
        check_where(where, schema)
        sql += f" WHERE\n{where}"  # last and on a line of its own, so DataFusion's positions are the text's
    qb = QueryBuilder({"datafusion.sql_parser.dialect": "generic"}).register("t", dt)
    try:
        reader = qb.execute(sql)
    except DeltaError as exc:
        raise _datafusion_error(where or "", str(exc)) from None
    return pa.table(reader.read_all()).cast(schema)  # DataFusion reads text as string_view


def check_where(text: str, schema: pa.Schema) -> None:
    """Refuse ``text`` unless it is made only of ``schema``'s scalar columns, keywords, literals, comparison
    operators, parentheses and commas, with literals of the kind of the column they are compared with.

    Raises:
        FilterError: the problem, its position (with a caret) and, for a bad column, the valid columns.
    """
    if not text.strip():
        raise FilterError("the filter is empty; give a condition such as \"reward > 0\"")
    tokens, pos = [], 0
    while text[pos:].strip():
        m = _TOKEN.match(text, pos)
        if m is None:
            at = len(text) - len(text[pos:].lstrip())
            hint = {'"': " (text goes in single quotes: node == 'solver')",
                    "'": " (text is not closed; a quote inside text is written twice: 'it''s')"}.get(text[at], "")
            raise _error(text, at, f"unexpected character {text[at]!r}{hint}")
        tokens.append((m.lastgroup, m.group(m.lastgroup), m.start(m.lastgroup)))
        pos = m.end()
    columns = filter_columns(schema)
    kinds = {c: _kind(schema.field(c).type) for c in columns}

    def operand(i: int) -> str | None:  # the kind of token i when it is a column or a literal
        if not 0 <= i < len(tokens):
            return None
        kind, value, _ = tokens[i]
        if kind == "word":
            return kinds.get(value) or ("bool" if value.lower() in ("true", "false") else None)
        return kind if kind in ("number", "text") else None

    def same_kind(i: int, j: int) -> None:  # DataFusion would coerce one side to the other's type
        ka, kb = operand(i), operand(j)
        if ka is None or kb is None or ka == kb:
            return
        a, b = tokens[i], tokens[j]
        if a[1] not in kinds:  # put the column first; two values are DataFusion's to judge
            if b[1] not in kinds:
                return
            (a, ka), (b, kb) = (b, kb), (a, ka)
        if ka == "timestamp" and kb == "text" and b[1] not in kinds:
            try:
                datetime.fromisoformat(b[1][1:-1].replace("''", "'"))
                return
            except ValueError:
                raise _error(text, b[2], f"{a[1]!r} is a timestamp: give an ISO 8601 time such as "
                                         "'2026-01-31T12:00:00+00:00'") from None
        other = f"{b[1]!r} holds {kb} values" if b[1] in kinds else f"{b[1]} is {kb}"
        raise _error(text, b[2], f"{a[1]!r} holds {ka} values but {other}; e.g. {_EXAMPLE[ka].format(c=a[1])}")

    for i, (kind, value, at) in enumerate(tokens):
        word = value.lower()
        if kind == "word" and value not in kinds and word not in KEYWORDS:
            valid = f"valid columns: {', '.join(columns)}"
            if value in schema.names:
                raise _error(text, at, f"column {value!r} holds lists, which a filter cannot compare", valid)
            close = difflib.get_close_matches(value, columns, n=1)
            raise _error(text, at, f"unknown column {value!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
                         valid)
        if kind == "op":
            if operand(i - 1) is None:
                raise _error(text, at, f"expected a column or a value before {value!r}")
            if operand(i + 1) is None:
                c, nxt = tokens[i - 1][1], tokens[i + 1] if i + 1 < len(tokens) else None
                found = ", found the end" if nxt is None else f", found {nxt[1]!r}"
                if nxt and nxt[0] == "word" and nxt[1].lower() not in KEYWORDS:  # text without its quotes
                    found = f" (quote text: {c} == '{nxt[1]}')"
                elif nxt and nxt[1].lower() == "null":
                    found += f" (use: {c} is null)"
                raise _error(text, nxt[2] if nxt else len(text), f"expected a value to compare {c!r} with{found}")
            same_kind(i - 1, i + 1)
        if word == "in":  # DataFusion checks the list's shape; this, its values' kinds
            c = i - 2 if i >= 2 and tokens[i - 1][1].lower() == "not" else i - 1
            for j in range(i + 1, len(tokens)):
                if tokens[j][1] == ")":
                    break
                same_kind(c, j)


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


def _datafusion_error(text: str, message: str) -> FilterError:
    """DataFusion's refusal as ours: a syntax error with its position, or the planner's last line."""
    m = _PARSER_ERROR.search(message)
    if m is None:
        detail = message.strip().splitlines()[-1].removeprefix("Error during planning: ")
        return FilterError(f"the filter is not a condition over the table: {detail}; "
                           "give one such as \"reward > 0\"")
    problem = m.group(1).replace("Expected: ", "expected ")
    problem = problem.replace("end of statement", "'and', 'or' or the end of the filter")
    problem = re.sub(r", found: (.*)$", lambda f: ", found " + ("the end" if f[1] == "EOF" else repr(f[1])), problem)
    pos = len(text)
    if m.group(2):  # the text starts on line 2 of the SQL
        line, col = int(m.group(2)) - 2, int(m.group(3)) - 1
        pos = sum(len(s) + 1 for s in text.split("\n")[:line]) + col
    return _error(text, min(pos, len(text)), problem)


def _error(text: str, pos: int, message: str, hint: str = "") -> FilterError:
    caret = f"\n  {text.translate({9: 32, 10: 32, 13: 32})}\n  {' ' * pos}^"  # one line, so the caret lines up
    return FilterError(f"{message} at position {pos + 1} of the filter:{caret}" + (f"\n{hint}" if hint else ""))
