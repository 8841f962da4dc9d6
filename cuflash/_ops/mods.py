"""User score and mask modifications: short CUDA C expressions, FlexAttention's ``score_mod`` and ``mask_mod``.

``score_mod`` is an expression over ``score`` (the scaled score ``softmax_scale * q . k`` after softcap, ALiBi
and the bias), ``b`` (the batch entry, or the packed sequence), ``h`` (the query head), ``q_idx`` and ``kv_idx``
(the query's and the key's positions within the sequence); its value replaces the score. ``mask_mod`` is an
expression over ``b``, ``h``, ``q_idx`` and ``kv_idx``: query ``q_idx`` sees key ``kv_idx`` where it is non-zero.
Both may index up to four user arrays (``mod_arrays``: 1-D int32 or float32) and call a few CUDA math functions.
The grammar, the units and the gradients are in ``docs/variants.md`` ("User score and mask modifications").

One parse serves three consumers, so that they cannot disagree:

- the NumPy reference (and the front door's block map) evaluates the typed syntax tree with NumPy (or CuPy)
  over broadcast index arrays, with C's int / float semantics (:meth:`UserMods.score`, :meth:`UserMods.mask`):
  ``score_mod`` returns its value and its derivative with respect to ``score`` by forward-mode dual numbers;
- the CUDA kernels compile a struct generated from the same tree (:func:`cpp_struct`, :attr:`UserMods.source`);
  nothing of the user's text reaches the compiler but what the tree prints back, fully parenthesized, with
  explicit conversions;
- :func:`block_map` classifies the tiles of the score matrix by ``mask_mod`` (skipped, masked element by
  element, or wholly visible), FlexAttention's block mask, with the compacted per-tile lists the kernels read.

Nothing is ever passed to Python's ``eval``: the parser below accepts only the grammar it implements.
"""

from __future__ import annotations

import hashlib
import math
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "MAX_LENGTH",
    "MAX_ARRAYS",
    "INDEX_NAMES",
    "FUNCTIONS",
    "Node",
    "ModExpr",
    "UserMods",
    "parse",
    "evaluate",
    "user_mods",
    "cpp_struct",
    "BlockMap",
    "block_map",
    "compact_block_map",
]

MAX_LENGTH = 1000        # characters of one expression
MAX_DEPTH = 100          # nesting of the syntax tree (keeps the evaluator's and printer's recursion shallow)
MAX_ARRAYS = 4           # ModArrays::ptr has four slots
INDEX_NAMES = ("b", "h", "q_idx", "kv_idx")
SCORE_NAME = "score"
CONSTANTS = ("INFINITY",)
ARRAY_DTYPES = ("int32", "float32")

# The CUDA math functions an expression may call: name -> number of arguments. min, max and abs follow their
# arguments' types (int, or float as fminf, fmaxf, fabsf); the others take and return float.
FUNCTIONS = {
    "tanhf": 1, "expf": 1, "exp2f": 1, "logf": 1, "log2f": 1, "sqrtf": 1, "fabsf": 1, "floorf": 1, "ceilf": 1,
    "sinf": 1, "cosf": 1, "fminf": 2, "fmaxf": 2, "min": 2, "max": 2, "abs": 1,
}
# Names a mod_arrays key may not take: the variables, the functions, the constant, and C / C++ keywords and
# names the generated struct uses.
RESERVED = frozenset((SCORE_NAME, *INDEX_NAMES, *CONSTANTS, *FUNCTIONS, "arrays", "F", "modmath", "cuflash", "Dual",
                      "ModArrays", "NoMod", "auto", "bool", "break", "case", "char", "const", "continue", "default",
                      "do", "double", "else", "enum", "extern", "float", "for", "goto", "if", "inline", "int", "long",
                      "register", "return", "short", "signed", "sizeof", "static", "struct", "switch", "typedef",
                      "union", "unsigned", "void", "volatile", "while", "class", "namespace", "template", "this",
                      "true", "false", "new", "delete", "operator", "private", "protected", "public", "virtual",
                      "friend", "typename", "using", "constexpr", "nullptr", "static_cast", "alignas", "alignof",
                      "decltype", "noexcept", "static_assert", "thread_local", "asm", "catch", "throw", "try",
                      "explicit", "mutable", "export", "and", "or", "not", "xor", "bitand", "bitor", "compl"))

# Static types of the nodes: C int, C float, and "score": a float that depends on the score (the template
# type F of the generated code: float, or Dual for the derivative).
INT, FLOAT, SCORE = "int", "float", "score"
_RANK = {INT: 0, FLOAT: 1, SCORE: 2}
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _promote(*types: str) -> str:
    return max(types, key=_RANK.__getitem__)


def _is_float(t: str) -> bool:
    return t != INT


# ---------------------------------------------------------------------------------------------------
# Syntax tree
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Node:
    """A typed node. ``op``: ``int``, ``float`` (literals, ``value``), ``inf``, ``var`` (``value``: the name),
    ``index`` (``value``: the array, ``args``: the index), ``call`` (``value``: the function), ``neg``, ``not``,
    a binary operator (``* / % + - < <= > >= == != && ||``) or ``cond`` (``c ? x : y``). ``pos`` is where it
    starts in the text (for messages; not part of equality)."""

    op: str
    args: tuple = ()
    type: str = INT
    value: Any = None
    pos: int = field(default=0, compare=False, hash=False)

    def names(self) -> frozenset:
        """The variables and arrays it reads."""
        own = {self.value} if self.op in ("var", "index") else set()
        return frozenset(own).union(*(a.names() for a in self.args))


_TOKEN_RE = re.compile(
    r"\s*(?:(?P<num>(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[A-Za-z_]*)|(?P<name>[A-Za-z_]\w*)"
    r"|(?P<op>&&|\|\||<=|>=|==|!=|[-+*/%<>!?:()\[\],]))"
)
_BINARY = {"||": 1, "&&": 2, "==": 3, "!=": 3, "<": 4, "<=": 4, ">": 4, ">=": 4, "+": 5, "-": 5, "*": 6, "/": 6,
           "%": 6}
_UNARY_POWER = 7


class _Token(NamedTuple):
    kind: str   # num, name, op, end
    text: str
    pos: int


class _Parser:
    """Recursive descent with precedence climbing over C's operators (no assignment, comma, bitwise or cast)."""

    def __init__(self, text: str, arg: str, arrays: dict):
        self.text, self.arg, self.arrays = text, arg, arrays
        self.tokens = self._tokenize()
        self.i = 0
        self.nesting = 0  # recursion of expression() and unary(): parentheses, calls, indices, unary operators

    def error(self, message: str, pos: int):
        caret = " " * pos + "^"
        raise ValueError(f"{self.arg}: {message} at position {pos} of {self.text!r}\n    {self.text}\n    {caret}")

    def _tokenize(self) -> list:
        tokens, pos, text = [], 0, self.text
        while True:
            m = _TOKEN_RE.match(text, pos)
            if m is None:
                rest = pos + len(text[pos:]) - len(text[pos:].lstrip())
                if rest == len(text):
                    break
                self.error(f"unexpected character {text[rest]!r}", rest)
            start = m.start(m.lastgroup)
            tokens.append(_Token(m.lastgroup, m.group(m.lastgroup), start))
            pos = m.end()
        tokens.append(_Token("end", "", len(text)))
        return tokens

    def peek(self) -> _Token:
        return self.tokens[self.i]

    def take(self) -> _Token:
        tok = self.tokens[self.i]
        self.i += 1
        return tok

    def expect(self, text: str, what: str) -> _Token:
        tok = self.peek()
        if tok.text != text or tok.kind != "op":
            found = "the end of the expression" if tok.kind == "end" else repr(tok.text)
            self.error(f"expected {text!r} {what}; found {found}", tok.pos)
        return self.take()

    def parse(self) -> Node:
        if not self.text.strip():
            self.error("empty expression", 0)
        node = self.expression()
        tok = self.peek()
        if tok.kind != "end":
            hint = " (unbalanced parentheses)" if tok.text in (")", "]") else ""
            self.error(f"unexpected {tok.text!r}{hint}", tok.pos)
        return node

    def enter(self):
        self.nesting += 1
        if self.nesting > MAX_DEPTH:
            self.error(f"expression nested too deeply (more than {MAX_DEPTH} levels)", self.peek().pos)

    def expression(self) -> Node:
        """conditional: binary ('?' expression ':' conditional)?  (right-associative, as in C)"""
        self.enter()
        cond = self.binary(0)
        if self.peek().text == "?" and self.peek().kind == "op":
            self.take()
            x = self.expression()
            self.expect(":", "in a conditional expression c ? x : y")
            y = self.expression()
            cond = Node("cond", (cond, x, y), _promote(x.type, y.type), pos=cond.pos)
        self.nesting -= 1
        return cond

    def binary(self, min_power: int) -> Node:
        """Precedence climbing: operators binding tighter than ``min_power``, left-associative."""
        left = self.unary()
        while True:
            tok = self.peek()
            power = _BINARY.get(tok.text) if tok.kind == "op" else None
            if power is None or power <= min_power:
                return left
            self.take()
            right = self.binary(power)
            left = self.make_binary(tok, left, right)

    def make_binary(self, tok: _Token, a: Node, b: Node) -> Node:
        op = tok.text
        if op == "%":
            if a.type != INT or b.type != INT:
                self.error("'%' needs int operands (as in C)", tok.pos)
            return Node(op, (a, b), INT, pos=a.pos)
        if op in ("*", "/", "+", "-"):
            return Node(op, (a, b), _promote(a.type, b.type), pos=a.pos)
        return Node(op, (a, b), INT, pos=a.pos)  # comparisons and logic give int 0 / 1, as in C

    def unary(self) -> Node:
        tok = self.peek()
        if tok.kind == "op" and tok.text in ("-", "+", "!"):
            self.take()
            self.enter()
            x = self.unary()
            self.nesting -= 1
            if tok.text == "+":
                return x
            if tok.text == "-":
                return Node("neg", (x,), x.type, pos=tok.pos)
            return Node("not", (x,), INT, pos=tok.pos)
        return self.primary()

    def primary(self) -> Node:
        tok = self.take()
        if tok.kind == "num":
            return self.number(tok)
        if tok.kind == "name":
            return self.name(tok)
        if tok.kind == "op" and tok.text == "(":
            node = self.expression()
            self.expect(")", "(unbalanced parentheses)")
            return node
        if tok.kind == "end":
            self.error("unexpected end of the expression", tok.pos)
        self.error(f"unexpected {tok.text!r}", tok.pos)

    def number(self, tok: _Token) -> Node:
        text = tok.text
        m = re.fullmatch(r"(?P<mant>\d+\.\d*|\.\d+|\d+)(?P<exp>[eE][+-]?\d+)?(?P<suffix>[A-Za-z_]*)", text)
        if m is None:  # an exponent with no digits, say: the token regex stopped early
            self.error(f"invalid number {text!r}", tok.pos)
        mant, exp, suffix = m.group("mant"), m.group("exp"), m.group("suffix")
        is_float = "." in mant or exp is not None
        if suffix not in ("", "f", "F") or (suffix and not is_float):
            why = f"; write {mant}.0f for a float" if suffix in ("f", "F") else ""
            self.error(f"invalid number {text!r} (decimal int and float literals only{why})", tok.pos)
        if not is_float:
            if len(mant) > 1 and mant.startswith("0"):
                self.error(f"invalid number {text!r} (octal literals are not supported)", tok.pos)
            value = int(mant)
            if value > _INT32_MAX:
                self.error(f"integer literal {text!r} does not fit a 32-bit int", tok.pos)
            return Node("int", value=value, type=INT, pos=tok.pos)
        value = float(mant + (exp or ""))
        with np.errstate(over="ignore"):
            single = float(np.float32(value))
        if not math.isfinite(single):
            self.error(f"float literal {text!r} overflows float32", tok.pos)
        return Node("float", value=single, type=FLOAT, pos=tok.pos)

    def name(self, tok: _Token) -> Node:
        name, nxt = tok.text, self.peek()
        if nxt.kind == "op" and nxt.text == "(":
            if name not in FUNCTIONS:
                if name in self.arrays:
                    self.error(f"{name!r} is an array: index it with [ ], not ( )", nxt.pos)
                self.error(f"unknown function {name!r} (allowed: {', '.join(FUNCTIONS)})", tok.pos)
            return self.call(tok)
        if nxt.kind == "op" and nxt.text == "[":
            if name not in self.arrays:
                self.error(f"{name!r} is not an array of mod_arrays{self.known_arrays()}", tok.pos)
            self.take()
            index = self.expression()
            self.expect("]", f"after the index of {name}[...]")
            if index.type != INT:
                self.error(f"the index of {name}[...] must be an int expression; got a float", index.pos)
            return Node("index", (index,), INT if self.arrays[name] == "int32" else FLOAT, value=name, pos=tok.pos)
        if name in FUNCTIONS:
            self.error(f"function {name!r} must be called with ( )", tok.pos)
        if name in self.arrays:
            self.error(f"array {name!r} must be indexed, {name}[...]", tok.pos)
        if name == SCORE_NAME:
            if self.arg != "score_mod":
                self.error("'score' is not available in mask_mod (it gets b, h, q_idx, kv_idx; the score belongs "
                           "in score_mod)", tok.pos)
            return Node("var", value=name, type=SCORE, pos=tok.pos)
        if name in INDEX_NAMES:
            return Node("var", value=name, type=INT, pos=tok.pos)
        if name == "INFINITY":
            return Node("inf", type=FLOAT, pos=tok.pos)
        variables = ", ".join(((SCORE_NAME,) if self.arg == "score_mod" else ()) + INDEX_NAMES + CONSTANTS)
        self.error(f"unknown identifier {name!r} ({self.arg} may use {variables}{self.known_arrays(' and')})",
                   tok.pos)

    def known_arrays(self, joiner: str = ";") -> str:
        if not self.arrays:
            return f"{joiner} no mod_arrays given" if joiner == ";" else ""
        return f"{joiner} the arrays {', '.join(self.arrays)} of mod_arrays"

    def call(self, tok: _Token) -> Node:
        name = tok.text
        self.take()  # (
        args = []
        if not (self.peek().kind == "op" and self.peek().text == ")"):
            while True:
                args.append(self.expression())
                if self.peek().kind == "op" and self.peek().text == ",":
                    self.take()
                    continue
                break
        self.expect(")", f"to close the call of {name}")
        if len(args) != FUNCTIONS[name]:
            want = FUNCTIONS[name]
            self.error(f"{name} takes {want} argument{'s' if want > 1 else ''}; got {len(args)}", tok.pos)
        if name in ("min", "max") and all(a.type == INT for a in args):
            kind = INT
        elif name == "abs" and args[0].type == INT:
            kind = INT
        else:
            kind = _promote(FLOAT, *(a.type for a in args))
            name = {"min": "fminf", "max": "fmaxf", "abs": "fabsf"}.get(name, name)  # CUDA's float overloads
        return Node("call", tuple(args), kind, value=name, pos=tok.pos)


def _depth(node: Node) -> int:
    return 1 + max((_depth(a) for a in node.args), default=0)


@dataclass(frozen=True)
class ModExpr:
    """One parsed expression: ``arg`` (``"score_mod"`` or ``"mask_mod"``), the user's ``text`` and its typed
    tree. Equal (and hashed) by tree, so that spacing and redundant parentheses do not matter."""

    arg: str
    text: str = field(compare=False, hash=False)
    node: Node

    @cached_property
    def names(self) -> frozenset:  # (read at every launch: computed once)
        return self.node.names()


def parse(text, arg: str, arrays: dict | None = None) -> ModExpr:
    """Parse ``text`` as ``arg`` (``"score_mod"`` or ``"mask_mod"``); ``arrays`` maps the names of the user's
    arrays to their dtype names (``"int32"``, ``"float32"``). Raises ValueError naming ``arg``, the text and the
    position of the problem."""
    assert arg in ("score_mod", "mask_mod"), arg
    if not isinstance(text, str):
        raise TypeError(f"{arg} must be a string (a CUDA C expression) or None; got {type(text).__name__}")
    if len(text) > MAX_LENGTH:
        raise ValueError(f"{arg} must be at most {MAX_LENGTH} characters; got {len(text)}")
    parser = _Parser(text, arg, dict(arrays or {}))
    node = parser.parse()
    if _depth(node) > MAX_DEPTH:
        parser.error(f"expression nested too deeply (more than {MAX_DEPTH} levels)", 0)
    return ModExpr(arg, text, node)


# ---------------------------------------------------------------------------------------------------
# Evaluation with NumPy (or CuPy): values and forward-mode derivatives
# ---------------------------------------------------------------------------------------------------


def _module(*arrays):
    for a in arrays:
        if type(a).__module__.split(".")[0] == "cupy":
            import cupy

            return cupy
    return np


class _Evaluator:
    """Evaluates a tree over broadcast arrays: ints as int64 (checked against C's 32-bit range), floats in
    ``fdtype``; each node gives ``(value, derivative)`` with the derivative None where it is 0 (everything
    that does not depend on the score). ``live`` (bool, broadcastable, or None for everywhere) marks the
    positions that C would evaluate: the right of ``&&`` / ``||`` and a branch of ``?:`` only where chosen, so
    that an array index or an integer division is checked only where C would perform it."""

    def __init__(self, expr: ModExpr, xp, fdtype, env: dict, arrays: dict):
        self.expr, self.xp, self.f, self.env, self.arrays = expr, xp, np.dtype(fdtype), env, arrays

    def fail(self, message: str, node: Node):
        raise ValueError(f"{self.expr.arg}: {message} at position {node.pos} of {self.expr.text!r}")

    def to_float(self, x):
        return self.xp.asarray(x, dtype=self.f)

    def convert(self, vd, from_type: str, to_type: str):
        value, deriv = vd
        if from_type == INT and to_type != INT:
            return self.to_float(value), None
        return value, deriv

    def any_live(self, bad, live) -> bool:
        if live is not None:
            bad = bad & live
        return bool(self.xp.any(bad))

    def check_int(self, value, live, node: Node):
        if self.any_live((value < _INT32_MIN) | (value > _INT32_MAX), live):
            self.fail("integer overflow (C's int is 32 bits)", node)
        return value

    def run(self, node: Node, live=None):
        method = getattr(self, "op_" + {"*": "mul", "/": "div", "%": "mod", "+": "add", "-": "sub", "&&": "and",
                                        "||": "or"}.get(node.op, node.op), None)
        if method is None:  # comparisons
            return self.op_compare(node, live)
        return method(node, live)

    def operands(self, node: Node, live, kind: str):
        return [self.convert(self.run(a, live), a.type, kind) for a in node.args]

    # leaves
    def op_int(self, node, live):
        return np.int64(node.value), None

    def op_float(self, node, live):
        return self.f.type(node.value), None

    def op_inf(self, node, live):
        return self.f.type(np.inf), None

    def op_var(self, node, live):
        if node.value == SCORE_NAME:
            return self.env[SCORE_NAME], self.f.type(1)
        return self.env[node.value], None

    def op_index(self, node, live):
        index, _ = self.run(node.args[0], live)
        array = self.arrays[node.value]
        n = int(array.shape[0])
        bad = (index < 0) | (index >= n)
        if self.any_live(bad, live):
            where = self.xp.asarray(bad if live is None else bad & live)
            first = int(self.xp.broadcast_to(self.xp.asarray(index), where.shape)[where].ravel()[0])
            self.fail(f"index {first} out of range for mod_arrays[{node.value!r}] of length {n}", node)
        value = array[self.xp.clip(index, 0, max(n - 1, 0))]
        return (value.astype(np.int64) if node.type == INT else self.to_float(value)), None

    # unary
    def op_neg(self, node, live):
        value, deriv = self.run(node.args[0], live)
        if node.type == INT:
            return self.check_int(-value, live, node), None
        return -value, (None if deriv is None else -deriv)

    def op_not(self, node, live):
        value, _ = self.run(node.args[0], live)
        return (value == 0).astype(np.int64), None

    # arithmetic
    def op_add(self, node, live):
        (a, da), (b, db) = self.operands(node, live, node.type)
        if node.type == INT:
            return self.check_int(a + b, live, node), None
        return a + b, _add(da, db)

    def op_sub(self, node, live):
        (a, da), (b, db) = self.operands(node, live, node.type)
        if node.type == INT:
            return self.check_int(a - b, live, node), None
        return a - b, _add(da, None if db is None else -db)

    def op_mul(self, node, live):
        (a, da), (b, db) = self.operands(node, live, node.type)
        if node.type == INT:
            return self.check_int(a * b, live, node), None
        return a * b, _add(None if da is None else da * b, None if db is None else a * db)

    def int_divide(self, node, live):
        (a, _), (b, _) = self.operands(node, live, INT)
        if self.any_live(b == 0, live):
            self.fail(f"integer {'division' if node.op == '/' else 'remainder'} by zero", node)
        b = self.xp.where(b == 0, 1, b)
        r = self.xp.fmod(a, b)  # C: the remainder takes the dividend's sign, the quotient truncates toward 0
        return a, b, r

    def op_div(self, node, live):
        if node.type == INT:
            a, b, r = self.int_divide(node, live)
            return self.check_int((a - r) // b, live, node), None
        (a, da), (b, db) = self.operands(node, live, node.type)
        value = a / b
        if db is None:
            return value, (None if da is None else da / b)
        num = -a * db if da is None else da * b - a * db
        return value, num / (b * b)

    def op_mod(self, node, live):
        _, _, r = self.int_divide(node, live)
        return r, None

    # comparisons and logic: int 0 / 1, derivative 0
    def op_compare(self, node, live):
        kind = _promote(*(a.type for a in node.args))
        (a, _), (b, _) = self.operands(node, live, kind)
        return self.xp.asarray(_COMPARE[node.op](a, b)).astype(np.int64), None

    def logic(self, node, live, is_and: bool):
        a, _ = self.run(node.args[0], live)
        first = a != 0
        chosen = first if is_and else ~first  # where C evaluates the right operand
        b, _ = self.run(node.args[1], chosen if live is None else live & chosen)
        second = b != 0
        return ((first & second) if is_and else (first | second)).astype(np.int64), None

    def op_and(self, node, live):
        return self.logic(node, live, True)

    def op_or(self, node, live):
        return self.logic(node, live, False)

    def op_cond(self, node, live):
        c, x, y = node.args
        chosen = self.run(c, live)[0] != 0
        xv, dx = self.convert(self.run(x, chosen if live is None else live & chosen), x.type, node.type)
        yv, dy = self.convert(self.run(y, ~chosen if live is None else live & ~chosen), y.type, node.type)
        value = self.xp.where(chosen, xv, yv)
        if node.type == INT:
            return value.astype(np.int64), None
        value = value.astype(self.f, copy=False)
        if dx is None and dy is None:
            return value, None
        zero = self.f.type(0)
        return value, self.xp.where(chosen, zero if dx is None else dx, zero if dy is None else dy)

    # functions
    def op_call(self, node, live):
        name = node.value
        if node.type == INT:  # min, max, abs of ints
            args = [v for v, _ in self.operands(node, live, INT)]
            if name == "abs":
                return self.check_int(self.xp.abs(args[0]), live, node), None
            fn = self.xp.minimum if name == "min" else self.xp.maximum
            return fn(*args), None
        args = self.operands(node, live, SCORE)
        xp, ln2 = self.xp, self.f.type(math.log(2.0))
        if name in ("fminf", "fmaxf"):
            (a, da), (b, db) = args
            if name == "fminf":
                value, pick_b = xp.fmin(a, b), b < a
            else:
                value, pick_b = xp.fmax(a, b), b > a
            if da is None and db is None:
                return value, None
            zero = self.f.type(0)
            return value, xp.where(pick_b, zero if db is None else db, zero if da is None else da)
        (x, dx), = args
        if name == "tanhf":
            value = xp.tanh(x)
            grad = lambda: 1 - value * value  # noqa: E731
        elif name == "expf":
            value = xp.exp(x)
            grad = lambda: value  # noqa: E731
        elif name == "exp2f":
            value = xp.exp2(x)
            grad = lambda: value * ln2  # noqa: E731
        elif name == "logf":
            value = xp.log(x)
            grad = lambda: 1 / x  # noqa: E731
        elif name == "log2f":
            value = xp.log2(x)
            grad = lambda: 1 / (x * ln2)  # noqa: E731
        elif name == "sqrtf":
            value = xp.sqrt(x)
            grad = lambda: 1 / (2 * value)  # noqa: E731
        elif name == "fabsf":
            value = xp.abs(x)
            grad = lambda: xp.where(x < 0, self.f.type(-1), self.f.type(1))  # noqa: E731
        elif name == "floorf":
            return xp.floor(x), None
        elif name == "ceilf":
            return xp.ceil(x), None
        elif name == "sinf":
            value = xp.sin(x)
            grad = lambda: xp.cos(x)  # noqa: E731
        elif name == "cosf":
            value = xp.cos(x)
            grad = lambda: -xp.sin(x)  # noqa: E731
        else:  # pragma: no cover - the parser admits only FUNCTIONS
            raise AssertionError(name)
        return value, (None if dx is None else dx * grad())


_COMPARE = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge, "==": operator.eq,
            "!=": operator.ne}


def _add(a, b):
    if a is None:
        return b
    if b is None:
        return a
    return a + b


# ---------------------------------------------------------------------------------------------------
# The user's modifications as one hashable object
# ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class UserMods:
    """``score_mod`` and ``mask_mod`` (each a :class:`ModExpr` or None) and the arrays they read, as
    ``(name, dtype name)`` pairs in slot order (``ModArrays::ptr[k]`` is the array of ``arrays[k]``). Hashable:
    equal objects generate the same C++ struct."""

    score_mod: ModExpr | None
    mask_mod: ModExpr | None
    arrays: tuple = ()

    @property
    def array_names(self) -> tuple:
        return tuple(name for name, _ in self.arrays)

    @property
    def has_score_mod(self) -> bool:
        return self.score_mod is not None

    @property
    def has_mask_mod(self) -> bool:
        return self.mask_mod is not None

    def uses(self, name: str, which: str = "both") -> bool:
        """Whether ``score_mod`` / ``mask_mod`` (``which``: ``"score_mod"``, ``"mask_mod"`` or ``"both"``) reads
        the variable or array ``name``."""
        exprs = [e for e in (self.score_mod, self.mask_mod) if e is not None and which in ("both", e.arg)]
        return any(name in e.names for e in exprs)

    @property
    def mask_uses_b(self) -> bool:
        return self.uses("b", "mask_mod")

    @property
    def mask_uses_h(self) -> bool:
        return self.uses("h", "mask_mod")

    @cached_property
    def _generated(self) -> tuple:
        return _generate(self)

    @property
    def type_name(self) -> str:
        """The generated struct's name, ``UserMod_<hash>`` (namespace cuflash)."""
        return self._generated[0]

    @property
    def source(self) -> str:
        """C++ defining ``cuflash::<type_name>`` (include after user_mods.cuh)."""
        return self._generated[1]

    def score(self, score, b, h, q_idx, kv_idx, arrays: dict | None = None, *, live=None):
        """``(value, derivative)`` of ``score_mod`` at broadcast ``score`` (floating; its dtype is the
        evaluation's) and int index arrays; the derivative is with respect to ``score``. Both broadcast to
        the shape of all inputs. Without a ``score_mod``: ``(score, 1)``."""
        xp = _module(score, b, h, q_idx, kv_idx)
        fdtype = np.result_type(score) if np.issubdtype(np.result_type(score), np.floating) else np.float32
        score = xp.asarray(score, dtype=fdtype)
        shape = np.broadcast_shapes(*(np.shape(x) for x in (score, b, h, q_idx, kv_idx)))
        if self.score_mod is None:
            return xp.broadcast_to(score, shape), xp.ones(shape, fdtype)
        env = {SCORE_NAME: score, **_index_env(xp, b, h, q_idx, kv_idx)}
        ev = _Evaluator(self.score_mod, xp, fdtype, env, _arrays(xp, arrays))
        with np.errstate(all="ignore"):
            value, deriv = ev.convert(ev.run(self.score_mod.node, live), self.score_mod.node.type, SCORE)
        value = xp.broadcast_to(xp.asarray(value, dtype=fdtype), shape)
        deriv = xp.zeros(shape, fdtype) if deriv is None else xp.broadcast_to(xp.asarray(deriv, dtype=fdtype), shape)
        return value, deriv

    def mask(self, b, h, q_idx, kv_idx, arrays: dict | None = None, *, live=None):
        """Boolean ``mask_mod`` at broadcast int index arrays (floats evaluated in float32, as the kernels do):
        True where query ``q_idx`` sees key ``kv_idx``. Without a ``mask_mod``: all True."""
        xp = _module(b, h, q_idx, kv_idx)
        shape = np.broadcast_shapes(*(np.shape(x) for x in (b, h, q_idx, kv_idx)))
        if self.mask_mod is None:
            return xp.ones(shape, bool)
        ev = _Evaluator(self.mask_mod, xp, np.float32, _index_env(xp, b, h, q_idx, kv_idx), _arrays(xp, arrays))
        with np.errstate(all="ignore"):
            value, _ = ev.run(self.mask_mod.node, live)
        return xp.broadcast_to(xp.asarray(value != 0), shape)


def _index_env(xp, b, h, q_idx, kv_idx) -> dict:
    return {name: xp.asarray(x).astype(np.int64, copy=False) for name, x in zip(INDEX_NAMES, (b, h, q_idx, kv_idx))}


def _arrays(xp, arrays) -> dict:
    return {name: xp.asarray(a) for name, a in (arrays or {}).items()}


def evaluate(text: str, arg: str = "score_mod", *, score=0.0, b=0, h=0, q_idx=0, kv_idx=0, arrays: dict | None = None,
             fdtype=np.float64):
    """``(value, derivative, type)`` of one expression at broadcast inputs, as C computes it: ``type`` is
    ``"int"`` (an int64 value), ``"float"`` or ``"score"`` (a ``fdtype`` value; ``"score"``: it depends on the
    score), the derivative with respect to ``score`` (0 where it does not depend on it). For tests and
    exploration; the backends use :class:`UserMods`."""
    dtypes = {name: np.dtype(a.dtype).name for name, a in (arrays or {}).items()}
    expr = parse(text, arg, dtypes)
    xp = _module(score, b, h, q_idx, kv_idx)
    env = {SCORE_NAME: xp.asarray(score, dtype=fdtype), **_index_env(xp, b, h, q_idx, kv_idx)}
    ev = _Evaluator(expr, xp, fdtype, env, _arrays(xp, arrays))
    with np.errstate(all="ignore"):
        value, deriv = ev.run(expr.node)
    return value, (np.zeros((), fdtype) if deriv is None else deriv), expr.node.type


def user_mods(score_mod=None, mask_mod=None, arrays: dict | None = None) -> UserMods | None:
    """Parse both expressions against ``arrays`` (name -> dtype name, or -> an array: its dtype is read).
    Returns None when neither is given. The :class:`UserMods` keeps only the arrays the expressions read,
    sorted by name (their slots)."""
    if score_mod is None and mask_mod is None:
        return None
    dtypes = {name: (a if isinstance(a, str) else np.dtype(a.dtype).name) for name, a in (arrays or {}).items()}
    score = None if score_mod is None else parse(score_mod, "score_mod", dtypes)
    mask = None if mask_mod is None else parse(mask_mod, "mask_mod", dtypes)
    used = set().union(*(e.names for e in (score, mask) if e is not None))
    return UserMods(score, mask, tuple((name, dtypes[name]) for name in sorted(dtypes) if name in used))


# ---------------------------------------------------------------------------------------------------
# C++ generation
# ---------------------------------------------------------------------------------------------------


def _c_float(value: float) -> str:
    """A C float literal that parses back to exactly this float32 value."""
    single = np.float32(value)
    if value == 0 or 1e-4 <= abs(value) < 1e7:
        return np.format_float_positional(single, unique=True, trim="0") + "f"
    return np.format_float_scientific(single, unique=True, trim="0") + "f"


class _Emitter:
    """Prints a tree as C++, fully parenthesized, with every int -> float conversion explicit. ``F`` is the
    score's type in the generated template (float or cuflash::Dual)."""

    def __init__(self, slots: dict):
        self.slots = slots  # array name -> slot k

    def to(self, node: Node, kind: str) -> str:
        """``node`` as a value of ``kind`` (int, float, or score = F)."""
        text = self.emit(node)
        if node.type == INT and kind != INT:
            return f"static_cast<float>({text})"
        return text

    def to_f(self, node: Node) -> str:
        """``node`` as an F (a ternary branch, or the returned score)."""
        return self.emit(node) if node.type == SCORE else f"F({self.to(node, FLOAT)})"

    def cond(self, node: Node) -> str:
        """``node != 0`` as a C++ bool (a comparison or logic node is one already)."""
        if node.op in _COMPARE:
            kind = _promote(*(a.type for a in node.args))
            a, b = (self.to(x, kind) for x in node.args)
            return f"({a} {node.op} {b})"
        if node.op in ("&&", "||"):
            a, b = (self.cond(x) for x in node.args)
            return f"({a} {node.op} {b})"
        if node.op == "not":
            return f"(!{self.cond(node.args[0])})"
        zero = "0" if node.type == INT else "0.0f"
        return f"({self.emit(node)} != {zero})"

    def emit(self, node: Node) -> str:
        op = node.op
        if op == "int":
            return str(node.value)
        if op == "float":
            return _c_float(node.value)
        if op == "inf":
            return "__int_as_float(0x7f800000)"
        if op == "var":
            return node.value
        if op == "index":
            k = self.slots[node.value]
            return f"modmath::load({node.value}, arrays.len[{k}], {self.emit(node.args[0])})"
        if op == "neg":
            return f"(-{self.emit(node.args[0])})"
        if op == "not" or op in _COMPARE or op in ("&&", "||"):  # C gives int 0 / 1
            return f"static_cast<int>({self.cond(node)})"
        if op in ("*", "/", "%", "+", "-"):
            a, b = (self.to(x, node.type) for x in node.args)
            if op == "/" and node.type != INT:  # (see modmath::fdiv in user_mods.cuh)
                divisor = node.args[1]
                if divisor.op in ("float", "int") and float(divisor.value) != 0:  # a constant: its reciprocal
                    return f"modmath::fdiv<kFast>({a}, {b}, {_c_float(1 / np.float32(divisor.value))})"
                return f"modmath::fdiv<kFast>({a}, {b})"
            return f"({a} {op} {b})"
        if op == "cond":
            c, x, y = node.args
            if node.type == SCORE:
                return f"({self.cond(c)} ? {self.to_f(x)} : {self.to_f(y)})"
            return f"({self.cond(c)} ? {self.to(x, node.type)} : {self.to(y, node.type)})"
        if op == "call":
            args = ", ".join(self.to(a, node.type if node.type == INT else FLOAT) for a in node.args)
            fast = "<kFast>" if node.value == "tanhf" else ""  # (see modmath::tanhf in user_mods.cuh)
            return f"modmath::{node.value}{fast}({args})"
        raise AssertionError(op)  # pragma: no cover


def _array_locals(mods: UserMods, expr: ModExpr | None, indent: str) -> str:
    lines = []
    for k, (name, dtype) in enumerate(mods.arrays):
        if expr is not None and name in expr.names:
            ctype = "int" if dtype == "int32" else "float"
            lines.append(f"{indent}const {ctype}* {name} = static_cast<const {ctype}*>(arrays.ptr[{k}]);\n")
    return "".join(lines)


def _generate(mods: UserMods) -> tuple:
    emitter = _Emitter({name: k for k, (name, _) in enumerate(mods.arrays)})
    score_body = "score" if mods.score_mod is None else emitter.to_f(mods.score_mod.node)
    mask_body = "true" if mods.mask_mod is None else emitter.cond(mods.mask_mod.node)
    key = f"score:{score_body}\nmask:{mask_body}\narrays:{mods.arrays!r}"
    type_name = "UserMod_" + hashlib.sha256(key.encode()).hexdigest()[:16]
    ind = "        "

    def comment(expr):  # the user's text on one line (a newline would end the // comment)
        return " ".join(expr.text.split()) if expr is not None else "(none)"

    lines = [
        "namespace cuflash {\n",
        "\n",
        f"// score_mod: {comment(mods.score_mod)}\n",
        f"// mask_mod:  {comment(mods.mask_mod)}\n",
        f"// arrays:    {', '.join(f'{n} ({d})' for n, d in mods.arrays) or '(none)'}\n",
        f"struct {type_name} {{\n",
        f"    static constexpr bool Has_score_mod = {'true' if mods.has_score_mod else 'false'};\n",
        f"    static constexpr bool Has_mask_mod = {'true' if mods.has_mask_mod else 'false'};\n",
        "\n",
        "    template <class F, bool kFast = false>\n",
        "    __device__ __forceinline__ static F score(F score, int b, int h, int q_idx, int kv_idx,\n",
        "                                              const ModArrays& arrays) {\n",
        _array_locals(mods, mods.score_mod, ind),
        f"{ind}return {score_body};\n",
        "    }\n",
        "\n",
        "    __device__ __forceinline__ static bool mask(int b, int h, int q_idx, int kv_idx, const ModArrays& arrays) {\n",
        "        [[maybe_unused]] constexpr bool kFast = false;\n",
        _array_locals(mods, mods.mask_mod, ind),
        f"{ind}return {mask_body};\n",
        "    }\n",
        "};\n",
        "\n",
        "}  // namespace cuflash\n",
    ]
    return type_name, "".join(lines)


def cpp_struct(score_mod=None, mask_mod=None, arrays: dict | None = None) -> tuple:
    """``(type_name, source)``: the C++ struct of these expressions (see :func:`user_mods` for ``arrays``).
    ``source`` defines ``cuflash::<type_name>`` with::

        static constexpr bool Has_score_mod, Has_mask_mod;
        template <class F, bool kFast = false> __device__ __forceinline__ static F score(F score, int b, int h,
                                                                     int q_idx, int kv_idx, const ModArrays& arrays);
        __device__ __forceinline__ static bool mask(int b, int h, int q_idx, int kv_idx, const ModArrays& arrays);

    and needs ``cuflash_kernels/user_mods.cuh`` before it."""
    mods = user_mods(score_mod, mask_mod, arrays)
    if mods is None:
        return "NoMod", ""
    return mods.type_name, mods.source


class BlockMask:
    """A ``mask_mod`` whose block sparsity is computed once and reused (FlexAttention's ``create_block_mask``).

    ``cuflash.attention(q, k, v, mask_mod=cuflash.BlockMask(expression, mod_arrays))`` masks as
    ``mask_mod=expression, mod_arrays=mod_arrays`` would. The difference is on the GPU: the block lists of the
    mask (which key tiles each query tile visits, per kernel tiling) are built at the first call of each shape
    and tiling and kept in this object, where a plain ``mask_mod`` that reads arrays rebuilds them at every
    call (its arrays may have changed in place). Build one per batch (one per set of document ids, say), pass
    it to every layer's forward and backward, and let it go with the batch.

    The contract: while the object is in use, its arrays, and the sequence lengths of the calls it is passed
    to (``cu_seqlens_*``, ``seqused_k``), hold the same values; after changing them, call :meth:`clear` (or
    make a new one). Use it on one CUDA stream (the lists are written on the stream of the first call).
    ``score_mod`` may read the same arrays by name (pass others in ``mod_arrays``).

    Parameters
    ----------
    mask_mod : str
        The mask expression (``docs/variants.md``, "User score and mask modifications").
    mod_arrays : dict, optional
        The named arrays it reads (1-D int32 / float32, the library of the calls' q).
    """

    def __init__(self, mask_mod: str, mod_arrays: dict | None = None):
        if not isinstance(mask_mod, str):
            raise TypeError(f"BlockMask's mask_mod must be a string (a CUDA C expression); got {type(mask_mod).__name__}")
        if mod_arrays is not None and not isinstance(mod_arrays, Mapping):
            raise TypeError(f"BlockMask's mod_arrays must be a dict of names to 1-D arrays; got {type(mod_arrays).__name__}")
        self.mask_mod = mask_mod
        self.mod_arrays = dict(mod_arrays or {})
        # (cuflash._cuda.attention.block_lists: one entry per device, shape, band and tiling)
        self.lists: dict = {}

    def clear(self) -> None:
        """Forget the block lists built so far (after the arrays or the sequence lengths changed)."""
        self.lists.clear()

    def __repr__(self) -> str:
        arrays = ", ".join(self.mod_arrays)
        return f"BlockMask({self.mask_mod!r}, arrays=[{arrays}], {len(self.lists)} block lists built)"


# ---------------------------------------------------------------------------------------------------
# Block sparsity from mask_mod
# ---------------------------------------------------------------------------------------------------

SKIP, PARTIAL, FULL = 0, 1, 2


class BlockMap(NamedTuple):
    """Which tiles of ``block_m`` queries x ``block_n`` keys hold a visible score, by ``mask_mod``.

    ``tiles``: int8 ``(Bm, Hm, ceil(seqlen_q / block_m), ceil(seqlen_k / block_n))``, ``Bm`` = batch or 1 and
    ``Hm`` = heads_q or 1 (1 when mask_mod does not read ``b`` / ``h`` and the sequences have equal lengths:
    broadcast over that axis); 0 = no visible score (the tile is skipped), 1 = partial (mask element by
    element), 2 = every score of the sequence in the tile is visible (no mask_mod work; the other masks still
    apply). Compacted for the kernels (FlexAttention's ``kv_num_blocks`` / ``kv_indices`` and ``q_num_blocks`` /
    ``q_indices``), all int32:

    - ``kv_num_blocks`` ``(Bm, Hm, n_q_tiles)``: how many key tiles of each query tile are not 0;
    - ``kv_indices`` ``(Bm, Hm, n_q_tiles, n_k_tiles)``: those key tiles first, ascending, then the skipped
      ones (ascending), so that every entry is a valid tile index;
    - ``q_num_blocks`` ``(Bm, Hm, n_k_tiles)`` and ``q_indices`` ``(Bm, Hm, n_k_tiles, n_q_tiles)``: the same
      per key tile, for the dK/dV pass.
    """

    tiles: Any
    block_m: int
    block_n: int
    kv_num_blocks: Any
    kv_indices: Any
    q_num_blocks: Any
    q_indices: Any


def compact_block_map(tiles, block_m: int, block_n: int) -> BlockMap:
    """The compacted lists of a ``tiles`` array (see :class:`BlockMap`)."""
    xp = _module(tiles)
    live = tiles != SKIP

    def lists(live):
        count = live.sum(axis=-1).astype(np.int32)
        order = xp.argsort(~live, axis=-1, kind="stable").astype(np.int32)
        return count, order

    kv_num, kv_idx = lists(live)
    q_num, q_idx = lists(live.swapaxes(-1, -2))
    return BlockMap(tiles, int(block_m), int(block_n), kv_num, kv_idx, q_num, xp.ascontiguousarray(q_idx))


def block_map(mods: UserMods | None, batch: int, heads: int, seqlen_q: int, seqlen_k: int, block_m: int,
              block_n: int, *, arrays: dict | None = None, lengths_q=None, lengths_k=None, batch_index=None,
              xp=None, chunk_elems: int = 1 << 22) -> BlockMap | None:
    """The :class:`BlockMap` of ``mods.mask_mod`` (None without one) over ``batch`` sequences of at most
    ``seqlen_q`` queries and ``seqlen_k`` keys, ``heads`` query heads.

    ``lengths_q``, ``lengths_k`` (``(batch,)`` ints, optional): the sequences' own lengths (packed batches,
    ``seqused_k``); positions past them are no scores at all (a tile holding none is 0). ``batch_index``: the
    ``b`` of each batch entry (default ``0..batch-1``). Evaluated tile-aligned chunks of about ``chunk_elems``
    scores at a time, with NumPy or ``xp`` (CuPy for CuPy arrays)."""
    if mods is None or mods.mask_mod is None:
        return None
    xp = xp or _module(*(arrays or {}).values())
    per_batch = mods.mask_uses_b or lengths_q is not None or lengths_k is not None
    nb = batch if per_batch else 1
    nh = heads if mods.mask_uses_h else 1
    n_qt, n_kt = -(-seqlen_q // block_m), -(-seqlen_k // block_n)
    tiles = xp.zeros((nb, nh, n_qt, n_kt), np.int8)
    if 0 in (nb, nh, n_qt, n_kt):
        return compact_block_map(tiles, block_m, block_n)
    bidx = xp.arange(batch) if batch_index is None else xp.asarray(batch_index)
    b = bidx[:nb].reshape(nb, 1, 1, 1).astype(np.int64)
    h = xp.arange(nh).reshape(1, nh, 1, 1)
    len_q = seqlen_q if lengths_q is None else xp.asarray(lengths_q)[:nb].reshape(nb, 1, 1, 1)
    len_k = seqlen_k if lengths_k is None else xp.asarray(lengths_k)[:nb].reshape(nb, 1, 1, 1)
    cols_tiles = max(1, min(n_kt, 4096 // block_n))
    rows_tiles = max(1, min(n_qt, chunk_elems // (nb * nh * block_m * cols_tiles * block_n)))
    for t0 in range(0, n_qt, rows_tiles):
        t1 = min(t0 + rows_tiles, n_qt)
        q = xp.arange(t0 * block_m, t1 * block_m).reshape(1, 1, -1, 1)
        for u0 in range(0, n_kt, cols_tiles):
            u1 = min(u0 + cols_tiles, n_kt)
            kv = xp.arange(u0 * block_n, u1 * block_n).reshape(1, 1, 1, -1)
            present = xp.broadcast_to((q < len_q) & (kv < len_k), (nb, nh, q.shape[2], kv.shape[3]))
            visible = mods.mask(b, h, q, kv, arrays, live=present) & present
            shape = (nb, nh, t1 - t0, block_m, u1 - u0, block_n)
            seen = visible.reshape(shape).any(axis=(3, 5))
            full = (visible | ~present).reshape(shape).all(axis=(3, 5))
            tiles[:, :, t0:t1, u0:u1] = xp.where(seen, xp.where(full, FULL, PARTIAL), SKIP).astype(np.int8)
    return compact_block_map(tiles, block_m, block_n)
