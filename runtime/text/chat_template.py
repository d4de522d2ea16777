"""Chat templates as untrusted code: jinja2's immutable sandbox, with limits on time and size.

A chat template comes from the engine directory, which is untrusted input (engines travel), and
it runs on every prompt. jinja2's ImmutableSandboxedEnvironment stops attribute escapes
(`''.__class__.__mro__`) and changes to lists and dicts, but nothing bounds what a render costs:
`{{ 'x' * 300000000 }}` builds 300 MB, nested `range` loops run for minutes. Each render here
has a budget, and a template over it raises TemplateLimitError at once:

- time: RENDER_SECONDS, checked at every loop iteration, call, filter, operator and output;
- one value: no string or list the template builds exceeds MAX_VALUE characters (items), checked
  *before* the operations that multiply sizes (`*`, `**`, `+`, `%`, str.format, the str methods
  and filters that pad, replace, join or indent) and after every call and filter;
- all values: the characters the template builds and outputs, macros and {% set %} blocks
  included, add up to at most MAX_BUILT (+ MAX_BUILT_PER_INPUT_CHAR per character of input);
- ranges: all `range()`s of one render hold at most MAX_RANGE_ITEMS items together.

Loops and outputs have no sandbox hook, so `compile_template` rewrites the parsed template before
compiling it: every `for` iterates through `_loop_items`, every output and `~` goes through
`_output`/`_concat` (filters named `__es_*`: a template that names them itself only spends its own
budget). The budget lives in a context variable, so concurrent renders (threads) are independent.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import string
import time
from typing import Any, Iterator

from jinja2 import nodes, pass_context
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range
from jinja2.visitor import NodeTransformer

RENDER_SECONDS = 1.0
MAX_VALUE = 1 << 24               # characters of one string / items (and their text) of one list
MAX_BUILT = 1 << 26               # characters built and output by one render ...
MAX_BUILT_PER_INPUT_CHAR = 16     # ... plus this many per character of the messages
MAX_RANGE_ITEMS = 1 << 20         # items of all range() calls of one render together
MAX_INT_BITS = 1 << 16            # bits of an integer built by `*` or `**`
MAX_ARGUMENT = 1 << 20            # an integer argument of a filter or str method (a width, a count)
MAX_JSON_INDENT = 64


class TemplateLimitError(Exception):
    """A chat template went over a limit of its render budget (time, size, ranges)."""


class TemplateRaised(Exception):
    """The template called raise_exception(message): it refuses these messages."""


# ----------------------------------------------------------------------------- the budget

class _Budget:
    """What one render may still spend: time, characters built, range items."""

    def __init__(self, input_chars: int) -> None:
        self.deadline = time.monotonic() + RENDER_SECONDS
        self.built_left = MAX_BUILT + MAX_BUILT_PER_INPUT_CHAR * input_chars
        self.range_left = MAX_RANGE_ITEMS

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"it ran longer than {RENDER_SECONDS:g} s")

    def charge(self, chars: int) -> None:
        self.built_left -= chars
        if self.built_left < 0:
            raise TemplateLimitError(f"it built more text than a prompt needs (over {MAX_BUILT} characters "
                                     f"plus {MAX_BUILT_PER_INPUT_CHAR} per input character)")

    def take_range(self, items: int) -> None:
        self.range_left -= items
        if self.range_left < 0:
            raise TemplateLimitError(f"its range() calls hold more than {MAX_RANGE_ITEMS} items in all")


class _Unlimited(_Budget):
    """Outside `render` (e.g. jinja folding a constant at compile time): only per-value checks."""

    def __init__(self) -> None:
        super().__init__(0)

    def tick(self) -> None:
        pass

    def charge(self, chars: int) -> None:
        pass

    def take_range(self, items: int) -> None:
        pass


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("chat_template_budget", default=None)
_UNLIMITED = _Unlimited()


def _budget() -> _Budget:
    return _BUDGET.get() or _UNLIMITED


# ----------------------------------------------------------------------------- sizes

_TEXT = (str, bytes, bytearray)
_CONTAINERS = (list, tuple, dict, set, frozenset)


def _size(value: Any, limit: int = MAX_VALUE) -> int:
    """Characters of a string; items plus the characters of their strings (4 levels deep) of a
    container; 1 for anything else. Counting stops once past `limit`, so its cost stays bounded."""
    if isinstance(value, _TEXT):
        return len(value)
    if not isinstance(value, _CONTAINERS):
        return 1
    total, stack = 0, [(value, 0)]
    while stack and total <= limit:
        item, depth = stack.pop()
        if isinstance(item, _TEXT):
            total += len(item)
        elif isinstance(item, _CONTAINERS) and depth < 4:
            total += len(item)
            children = [part for pair in item.items() for part in pair] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)
        else:
            total += 1
    return total


def _join_size(separator: int, items: Any) -> int:
    """Characters of `separator`-long-joined `items` (a list, tuple or string)."""
    return _size(items) + separator * max(len(items) - 1, 0)


def _check_size(size: int, what: str) -> None:
    if size > MAX_VALUE:
        raise TemplateLimitError(f"{what} would hold {size} characters or items (at most {MAX_VALUE})")


def _built(value: Any, what: str = "a value it built") -> Any:
    """Check and charge a value the template has just built; return it."""
    if isinstance(value, _TEXT + _CONTAINERS):
        size = _size(value)
        _check_size(size, what)
        if isinstance(value, _TEXT):
            _budget().charge(size)
    return value


def _check_argument(value: Any, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_ARGUMENT:
        raise TemplateLimitError(f"{what} got the number {value} (at most {MAX_ARGUMENT})")


# ----------------------------------------------------------------------------- format strings

_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_percent_format(fmt: str) -> None:
    """`fmt % args`: a width or precision is what can make the result huge."""
    for width, precision in _PERCENT_SPEC.findall(fmt):
        for number in (width, precision):
            if number == "*":
                raise TemplateLimitError("a '%' format takes its width from an argument ('*'), which is not allowed")
            if number and int(number) > MAX_ARGUMENT:
                raise TemplateLimitError(f"a '%' format asks for a width of {number} (at most {MAX_ARGUMENT})")


def _check_brace_format(fmt: str, args: tuple, kwargs: dict) -> None:
    """`fmt.format(...)`: widths in the format, or nested `{}` widths taken from the arguments."""
    nested = False
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec:
            nested |= "{" in spec
            for number in re.findall(r"\d+", spec):
                if int(number) > MAX_ARGUMENT:
                    raise TemplateLimitError(f"a format asks for a width of {number} (at most {MAX_ARGUMENT})")
    if nested:
        for value in (*args, *kwargs.values()):
            _check_argument(value, "a format's nested width")


# ----------------------------------------------------------------------------- str methods

_STR_WIDTH_METHODS = {"center", "ljust", "rjust", "zfill"}


def _check_str_method(method: Any, args: tuple, kwargs: dict) -> tuple:
    """Before calling a str/bytes method: refuse a call whose result would be too big. Returns the
    arguments to call it with (join's iterable made a list, so that its size is known first)."""
    owner, name = getattr(method, "__self__", None), getattr(method, "__name__", "")
    if not isinstance(owner, _TEXT):
        return args
    for value in (*args, *kwargs.values()):
        _check_argument(value, f"str.{name}()")
    if name == "expandtabs":
        tab = args[0] if args and isinstance(args[0], int) else kwargs.get("tabsize", 8)
        size = len(owner) + owner.count("\t" if isinstance(owner, str) else b"\t") * max(tab, 0)
    elif name in _STR_WIDTH_METHODS:
        size = args[0] if args and isinstance(args[0], int) else len(owner)
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], type(owner)) and isinstance(args[1], type(owner)):
        old, new = args[0], args[1]
        count = owner.count(old) if old else len(owner) + 1
        if len(args) > 2 and isinstance(args[2], int) and args[2] >= 0:
            count = min(count, args[2])
        size = len(owner) + count * (len(new) - len(old))
    elif name == "join" and args:
        items = args[0] if isinstance(args[0], (list, tuple, str)) else list(_loop_items(None, args[0]))
        args = (items, *args[1:])
        size = _join_size(len(owner), items)
    elif name == "translate" and args and isinstance(args[0], dict):
        longest = max((len(v) for v in args[0].values() if isinstance(v, _TEXT)), default=1)
        size = len(owner) * longest
    else:
        return args
    _check_size(size, f"the result of str.{name}()")
    return args


# ----------------------------------------------------------------------------- filters

def _check_filter(name: str, values: list, kwargs: dict) -> list:
    """Before a filter (`values`: its value and positional arguments): integer arguments (widths,
    counts) and the filters that multiply sizes. Returns the values to call it with (join's
    iterable made a list, so that its size is known first)."""
    for value in (*values[1:], *kwargs.values()):
        _check_argument(value, f"the {name!r} filter")
    subject = values[0] if values else None
    if name == "indent" and isinstance(subject, str):
        width = values[1] if len(values) > 1 else kwargs.get("width", 4)
        pad = len(width) if isinstance(width, str) else width if isinstance(width, int) else 4
        _check_size(len(subject) + (subject.count("\n") + 1) * pad, "the result of the 'indent' filter")
    elif name == "wordwrap" and isinstance(subject, str):
        wrap = values[3] if len(values) > 3 else kwargs.get("wrapstring")
        if isinstance(wrap, str):
            _check_size(len(subject) * (len(wrap) + 1), "the result of the 'wordwrap' filter")
    elif name == "replace" and isinstance(subject, str) and len(values) >= 3:
        count = values[3] if len(values) > 3 else kwargs.get("count")
        _check_str_method(subject.replace, (str(values[1]), str(values[2]), *([count] if count else [])), {})
    elif name == "join" and subject is not None:
        items = subject if isinstance(subject, (list, tuple, str)) else list(_loop_items(None, subject))
        separator = values[1] if len(values) > 1 else kwargs.get("d", "")
        _check_size(_join_size(len(str(separator)), items), "the result of the 'join' filter")
        values = [items, *values[1:]]
    elif name == "format" and isinstance(subject, str):
        _check_percent_format(subject)
    elif name == "tojson":
        indent = values[2] if len(values) > 2 else kwargs.get("indent")
        if isinstance(indent, str) and len(indent) > MAX_JSON_INDENT or \
                isinstance(indent, int) and not isinstance(indent, bool) and indent > MAX_JSON_INDENT:
            raise TemplateLimitError(f"the 'tojson' filter got an indent over {MAX_JSON_INDENT}")
    return values


def _bounded_filter(name: str, function):
    injected = 1 if getattr(function, "jinja_pass_arg", None) else 0  # a context/environment comes first

    @functools.wraps(function)  # keeps jinja's pass_context / pass_environment mark
    def bounded(*args, **kwargs):
        _budget().tick()
        values = _check_filter(name, list(args[injected:]), kwargs)
        return _built(function(*args[:injected], *values, **kwargs), f"the result of the {name!r} filter")
    return bounded


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson filter (its arguments and defaults)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise TemplateRaised(str(message))


# ----------------------------------------------------------------------------- the hooks the rewrite inserts

@pass_context
def _loop_items(context, iterable) -> Iterator:
    budget = _budget()
    for item in iterable:
        budget.tick()
        yield item


def _as_text(value: Any, what: str) -> str:
    """str(value), as jinja outputs it, with a container's size checked before it is spelled out."""
    if isinstance(value, str):
        return value
    _check_size(_size(value), what)
    text = str(value)
    _check_size(len(text), what)
    return text


@pass_context
def _output(context, value) -> str:
    """`{{ value }}` (at the top, in a macro or a {% set %} block): checked and charged."""
    budget = _budget()
    budget.tick()
    text = _as_text(value, "a value it outputs")
    budget.charge(len(text))
    return text


@pass_context
def _concat(context, parts: list) -> str:
    """`a ~ b ~ c`, with the total checked before the text is joined."""
    budget = _budget()
    budget.tick()
    texts = [_as_text(p, "a '~' concatenation") for p in parts]
    size = sum(len(t) for t in texts)
    _check_size(size, "a '~' concatenation")
    budget.charge(size)
    return "".join(texts)


_HOOKS = {"__es_loop_items": _loop_items, "__es_output": _output, "__es_concat": _concat}


class _InsertHooks(NodeTransformer):
    """Route every loop, output and `~` of a parsed template through the budget hooks."""

    def __init__(self, environment) -> None:
        self.environment = environment

    def _filter(self, name: str, node: nodes.Node, lineno: int) -> nodes.Filter:
        wrapped = nodes.Filter(node, name, [], [], None, None, lineno=lineno)
        return wrapped.set_environment(self.environment)

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._filter("__es_loop_items", node.iter, node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        parts = nodes.List(node.nodes, lineno=node.lineno).set_environment(self.environment)
        return self._filter("__es_concat", parts, node.lineno)

    def visit_Output(self, node: nodes.Output) -> nodes.Node:
        self.generic_visit(node)
        node.nodes = [self._filter("__es_output", child, node.lineno) for child in node.nodes]
        return node


# ----------------------------------------------------------------------------- the environment

class BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment (immutable sandbox, trim/lstrip blocks, loop
    controls, tojson, raise_exception), with every operator, call and filter on the render budget."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
        self.filters.update(_HOOKS)
        self.globals["raise_exception"] = _raise_exception
        self.globals["range"] = self._range

    @staticmethod
    def _range(*args) -> range:
        items = safe_range(*args)  # jinja's own bound on one range
        _budget().take_range(len(items))
        return items

    def _parse(self, source, name, filename):
        return _InsertHooks(self).visit(super()._parse(source, name, filename))

    def call_binop(self, context, operator, left, right):
        _budget().tick()
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, bytes, list, tuple)) and isinstance(times, int):
                    _check_size(_size(seq) * max(times, 0), "a '*' repetition")
            if isinstance(left, int) and isinstance(right, int) and \
                    left.bit_length() + right.bit_length() > MAX_INT_BITS:
                raise TemplateLimitError(f"a '*' would build an integer of over {MAX_INT_BITS} bits")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0 and \
                max(left.bit_length(), 1) * right > MAX_INT_BITS:
            raise TemplateLimitError(f"a '**' would build an integer of over {MAX_INT_BITS} bits")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and type(left) is type(right):
            _check_size(_size(left) + _size(right), "a '+' concatenation")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left)
        return _built(super().call_binop(context, operator, left, right))

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  (jinja's own signature)
        _budget().tick()
        args = _check_str_method(__obj, args, kwargs)
        return _built(super().call(__context, __obj, *args, **kwargs), "the result of a call")

    def wrap_str_format(self, value):
        formatter = super().wrap_str_format(value)
        if formatter is None:
            return None
        fmt, is_map = value.__self__, value.__name__ == "format_map"

        @functools.wraps(formatter)
        def bounded(*args, **kwargs):
            _check_brace_format(fmt, (), args[0] if is_map and args and isinstance(args[0], dict) else kwargs)
            if not is_map:
                _check_brace_format(fmt, args, kwargs)
            return _built(formatter(*args, **kwargs), "the result of str.format()")
        return bounded


_ENVIRONMENT = BoundedSandbox()


@functools.lru_cache(maxsize=32)
def compile_template(source: str):
    """The compiled template; raises jinja2.TemplateSyntaxError (or another Exception for a
    template jinja cannot compile)."""
    return _ENVIRONMENT.from_string(source)


def render(template, input_chars: int = 0, **variables) -> str:
    """Render under a fresh budget. Raises TemplateLimitError over a limit, TemplateRaised when
    the template calls raise_exception, jinja2 errors (SecurityError, UndefinedError, ...) and
    whatever a template's own bug raises."""
    budget = _Budget(input_chars)
    token = _BUDGET.set(budget)
    try:
        parts, size = [], 0
        for chunk in template.generate(**variables):  # checked between chunks too
            size += len(chunk)
            _check_size(size, "its output")
            budget.tick()
            parts.append(chunk)
        return "".join(parts)
    finally:
        _BUDGET.reset(token)
