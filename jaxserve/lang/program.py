"""Programs over a prompt state, SGLang-style: ``s += text``, role blocks, ``gen``, ``fork``.

A program is a Python function of a state ``s`` and its arguments::

    @function
    def agent(s, task):
        s += system(SYSTEM_PROMPT)
        s += user(f"Task: {task}")
        s += assistant(gen("analysis", max_tokens=200))

Running it appends to ``s`` segment by segment; a ``gen`` sends the prompt so far (the
segments' token ids one after another) to the backend and appends what comes back. Calls
do not block the program until something needs their result (the next ``gen`` on the
same state, ``s[name]``, ``s.text``), so the branches of ``s.fork(n)`` run at once.

**Tracing** (``Program.trace``) runs the function once with placeholder arguments and no
model call, to find the prompt prefix every run shares: the segments before the first one
that depends on an argument or on a ``gen``'s output. Placeholders turn into text only
through f-strings / ``format`` and ``+``; anything else done with one (a comparison, a
truth test, ``len``, a method) would let the program take a different path per run, so
the trace stops there and shares only what came before: no prefix is declared shared
unless every run appends it. ``run_batch`` computes that prefix once and pins it in the
prefix cache (a prefill-only request with a lease) before sending the runs, and unpins it
after.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import queue
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from jaxserve.lang.backends import Backend, ProgramError
from jaxserve.sampling_params import SamplingParams

_SENTINEL = "\x00\x01jaxserve-argument\x01\x00"  # what a placeholder formats as


# -- what a program appends --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Gen:
    """``gen(name, ...)``: a completion of the prompt so far, stored as ``s[name]``."""

    name: str
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class Seq:
    """Parts appended one after another: ``"Answer: " + gen("a")``."""

    parts: tuple

    def __add__(self, other):
        return Seq((*self.parts, other)) if isinstance(other, str | Gen | Seq) else NotImplemented

    def __radd__(self, other):
        return Seq((other, *self.parts)) if isinstance(other, str) else NotImplemented


def _concat(self, other):
    return Seq((self, other)) if isinstance(other, str | Gen | Seq) else NotImplemented


def _rconcat(self, other):
    return Seq((other, self)) if isinstance(other, str) else NotImplemented


Gen.__add__, Gen.__radd__ = _concat, _rconcat


def gen(name: str, max_tokens: int = 128, **sampling: Any) -> Gen:
    """A completion stored as ``s[name]``; ``sampling``: any ``SamplingParams`` field
    (``stop``, ``temperature``, ``top_p``, ``seed``, ``ignore_eos``, ..., and structured
    output: ``regex``, ``choice``, ``json_schema``, ``json_object``, ``grammar``)."""
    if not isinstance(name, str) or not name:
        raise ProgramError(f"gen name = {name!r}: must be a non-empty string")
    try:
        params = SamplingParams(max_tokens=max_tokens, **sampling)
    except TypeError as e:
        raise ProgramError(f"gen({name!r}): {e}") from None
    if params.n != 1:
        raise ProgramError(f"gen({name!r}, n={params.n}): one completion per gen; fork the state for several")
    return Gen(name, params)


@dataclasses.dataclass(frozen=True)
class Select:
    """``select(name, choices)``: the choice the model finds likeliest after the prompt."""

    name: str
    choices: tuple[str, ...]
    normalize: bool = False


def select(name: str, choices: Sequence[str], normalize: bool = False) -> Select:
    """Appends the choice with the highest sum of its tokens' logprobs after the prompt so
    far (``normalize``: the mean per token), stored as ``s[name]``. The prompt is computed
    once (a cache hit for all choices but the first) and the choices are scored in one batch."""
    if not isinstance(name, str) or not name:
        raise ProgramError(f"select name = {name!r}: must be a non-empty string")
    choices = tuple(choices) if not isinstance(choices, str) else ()
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ProgramError(f"select({name!r}) choices: must be a non-empty list of non-empty strings")
    return Select(name, choices, bool(normalize))


@dataclasses.dataclass(frozen=True)
class Role:
    """A chat message: the template's text around ``parts`` (strings and gens)."""

    role: str
    parts: tuple


def _role(role: str) -> Callable[..., Role]:
    def block(*parts) -> Role:
        return Role(role, parts)

    block.__name__ = role
    block.__doc__ = f"A {role} message: its parts (text, gen) inside the chat template's {role} turn."
    return block


system, user, assistant = _role("system"), _role("user"), _role("assistant")


# -- running -----------------------------------------------------------------------------
class ProgramState:
    """A run's prompt (token ids and text) and its variables."""

    def __init__(self, backend: Backend, token_ids=(), text="", variables=None, on_text=None, family=None):
        self.backend = backend
        self._family: list[ProgramState] = family if family is not None else []  # the run's states (forks)
        self._family.append(self)
        self.token_ids: list[int] = list(token_ids)
        self._text = text
        self.variables: dict[str, str] = dict(variables or {})
        self.calls: list[Any] = []  # outcomes of this state's calls, in order (usage, leases)
        self.scores: dict[str, list[float]] = {}  # select name -> each choice's score
        self._pending: tuple[Gen, Any] | None = None  # a call sent, not yet appended
        self._after: list[str] = []  # text appended behind the pending call
        self._on_text = on_text  # streaming: called with each piece of text as it is appended

    def __iadd__(self, item) -> ProgramState:
        self._append(item)
        return self

    def _append(self, item) -> None:
        for piece in _flat(self.backend, item):
            if isinstance(piece, str):
                if self._pending is not None:
                    self._after.append(piece)
                else:
                    self._add_text(piece)
            elif isinstance(piece, Gen):
                self._resolve()
                self._pending = (piece, self.backend.submit(self.token_ids, piece.params, on_text=self._on_text))
            elif isinstance(piece, Select):
                self._select(piece)
            else:
                raise ProgramError(f"s += {type(piece).__name__}: append a string, gen(...) or a role block")

    def _select(self, item: Select) -> None:
        self._resolve()
        prefix = list(self.token_ids)
        if not prefix:
            raise ProgramError(f"select({item.name!r}): needs a prompt before it to score the choices after")
        params = SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_start=len(prefix))
        ids = [self.backend.encode(c) for c in item.choices]
        handles, outcomes = [], []
        try:
            for c in ids:
                handles.append(self.backend.submit(prefix + c, params))
            for handle in handles:
                outcomes.append(self.backend.result(handle))
        except BaseException:  # a choice refused (too long, the server's answer): the rest go
            for handle in handles[len(outcomes) :]:
                self.backend.cancel(handle)
            raise
        scores = []
        for c, outcome in zip(ids, outcomes, strict=True):
            self.calls.append(outcome)
            total = sum(outcome.prompt_logprobs[len(prefix) :])
            scores.append(total / len(c) if item.normalize else total)
        best = max(range(len(scores)), key=scores.__getitem__)  # the first of equals
        self.scores[item.name] = scores
        self.variables[item.name] = item.choices[best]
        self.token_ids += ids[best]
        self._text += item.choices[best]
        if self._on_text is not None:
            self._on_text(item.choices[best])

    def _add_text(self, text: str) -> None:
        self.token_ids += self.backend.encode(text, first=not self.token_ids)
        self._text += text
        if self._on_text is not None and text:
            self._on_text(text)

    def _resolve(self) -> None:
        if self._pending is None:
            return
        call, handle = self._pending
        self._pending = None
        outcome = self.backend.result(handle)
        self.calls.append(outcome)
        self.token_ids += outcome.token_ids
        self._text += outcome.text
        self.variables[call.name] = outcome.text
        after, self._after = self._after, []
        for text in after:
            self._add_text(text)

    def __getitem__(self, name: str) -> str:
        self._resolve()
        return _variable(self.variables, name)

    @property
    def text(self) -> str:
        self._resolve()
        return self._text

    def fork(self, n: int) -> list[ProgramState]:
        """``n`` states that share everything so far; their calls run at once."""
        _check_fork(n)
        self._resolve()
        return [
            ProgramState(self.backend, self.token_ids, self._text, self.variables, family=self._family)
            for _ in range(n)
        ]

    def finish(self) -> ProgramState:
        self._resolve()
        return self

    def abandon(self) -> None:
        """Aborts the calls the run's states (this one and its forks) have in flight: the
        program raised, so nothing will read them (they would run to their max_tokens)."""
        for state in self._family:
            if state._pending is not None:
                _, handle = state._pending
                state._pending = None
                state.backend.cancel(handle)


def _flat(backend: Backend, item) -> Iterator:
    """``item`` as the text pieces, gens, selects (and placeholders) it appends, in order:
    a role block inside its turn's template text, a Seq part by part."""
    if isinstance(item, Role):
        begin, end = _markers(backend, item.role)
        yield begin
        for part in item.parts:
            yield from _flat(backend, part)
        yield end
    elif isinstance(item, Seq):
        for part in item.parts:
            yield from _flat(backend, part)
    else:
        yield item


def _variable(variables: dict, name: str):
    if name not in variables:
        known = ", ".join(map(repr, variables)) or "none yet"
        raise ProgramError(f"s[{name!r}]: no gen or select of that name has run (set so far: {known})")
    return variables[name]


def _check_fork(n) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ProgramError(f"fork(n = {n!r}): n must be an integer >= 1")


def _markers(backend: Backend, role: str) -> tuple[str, str]:
    roles = backend.roles
    if role not in roles:
        raise ProgramError(
            f"{role}(...): the model's chat template has no {role} turn (roles: {', '.join(roles) or 'none'})"
        )
    return roles[role]


# -- tracing -----------------------------------------------------------------------------
class _Diverges(Exception):
    """A placeholder was used in a way that can change the program's path."""


class Placeholder:
    """An argument (or a gen's output) in a trace: text only through f-strings and ``+``."""

    def __init__(self, name: str):
        self._name = name

    def __format__(self, spec: str) -> str:
        return _SENTINEL

    def __add__(self, other):
        if isinstance(other, str | Placeholder):
            return _SENTINEL + (other if isinstance(other, str) else _SENTINEL)
        if isinstance(other, Gen | Seq):
            return Seq((_SENTINEL, other))
        return self._diverge("+")

    def __radd__(self, other):
        if isinstance(other, str):
            return other + _SENTINEL
        return self._diverge("+")

    def _diverge(self, what: str):
        raise _Diverges(f"{what} on {self._name}")

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._diverge(f".{name}")


for _op in ("__bool__", "__eq__", "__ne__", "__lt__", "__le__", "__gt__", "__ge__", "__len__", "__iter__",
            "__contains__", "__getitem__", "__hash__", "__str__", "__int__", "__float__", "__index__", "__call__"):  # fmt: skip
    setattr(Placeholder, _op, lambda self, *a, _op=_op: self._diverge(_op))


@dataclasses.dataclass
class CallSite:
    name: str
    shared_tokens: int  # of its prompt, the tokens every run has (the shared prefix or less)
    prompt_is_shared: bool  # the whole prompt is the same in every run


@dataclasses.dataclass
class Trace:
    """What tracing found: the shared prefix, the call sites, and where it stopped early."""

    shared_token_ids: list[int]
    shared_text: str
    calls: list[CallSite]
    stopped: str = ""  # why (and where) the trace ended before the program did


class _TraceState:
    def __init__(self, backend: Backend, result: Trace, shared: bool = True, variables=None):
        self.backend = backend
        self.result = result
        self.shared = shared  # no argument or gen output appended so far
        self.variables: dict[str, Placeholder] = dict(variables or {})

    def __iadd__(self, item) -> _TraceState:
        self._append(item)
        return self

    def _append(self, item) -> None:
        for piece in _flat(self.backend, item):
            if isinstance(piece, str):
                if _SENTINEL in piece:
                    self.shared = False
                elif self.shared:
                    self.result.shared_token_ids += self.backend.encode(piece, first=not self.result.shared_token_ids)
                    self.result.shared_text += piece
            elif isinstance(piece, Gen | Select):  # its output (which choice) differs per run
                self.result.calls.append(CallSite(piece.name, len(self.result.shared_token_ids), self.shared))
                self.shared = False
                what = "output of gen" if isinstance(piece, Gen) else "choice of select"
                self.variables[piece.name] = Placeholder(f"the {what}({piece.name!r})")
            elif isinstance(piece, Placeholder):  # an argument or a gen's output, appended as is
                self.shared = False
            else:
                raise ProgramError(f"s += {type(piece).__name__}: append a string, gen(...) or a role block")

    def __getitem__(self, name: str) -> Placeholder:
        return _variable(self.variables, name)

    @property
    def text(self) -> str:
        return _SENTINEL if not self.shared else self.result.shared_text

    def fork(self, n: int) -> list[_TraceState]:
        """Branches: what one appends is not the others', so the shared prefix ends here."""
        _check_fork(n)
        self.shared = False
        return [_TraceState(self.backend, self.result, False, self.variables) for _ in range(n)]


# -- programs ----------------------------------------------------------------------------
class Program:
    """A ``@function``: run it, run a batch of it, stream one run, or trace it."""

    def __init__(self, fn: Callable):
        self.fn = fn
        params = list(inspect.signature(fn).parameters)
        if not params:
            raise ProgramError(f"@function {fn.__name__}: the first parameter must be the state (s)")
        self.arg_names = params[1:]
        functools.update_wrapper(self, fn)

    def _bind(self, kwargs: dict) -> None:
        """Raises ProgramError unless the program takes these arguments."""
        if not isinstance(kwargs, Mapping):
            raise ProgramError(f"{self.fn.__name__}: its arguments must be a dict, not {type(kwargs).__name__}")
        try:
            inspect.signature(self.fn).bind(None, **kwargs)
        except TypeError as e:
            raise ProgramError(f"{self.fn.__name__}: {e}") from None

    def _call(self, state, kwargs: dict) -> None:
        self._bind(kwargs)
        self.fn(state, **kwargs)

    def run(self, backend: Backend, **kwargs) -> ProgramState:
        state = ProgramState(backend)
        try:
            self._call(state, kwargs)
            return state.finish()
        except BaseException:
            state.abandon()
            raise

    def stream(self, backend: Backend, **kwargs) -> Iterator[str]:
        """One run's text as it is appended (a gen's as it is generated). Closing the
        iterator early (``break``, ``close()``) ends the run at its next piece of text: the
        call generating it is aborted, nothing after it is sent."""
        pieces: queue.Queue = queue.Queue()
        done = object()
        closed = threading.Event()

        def emit(text: str) -> None:
            if closed.is_set():
                raise _StreamClosed  # out through the backend's result, which aborts the call
            pieces.put(text)

        def target():
            state = ProgramState(backend, on_text=emit)
            try:
                self._call(_Eager(state), kwargs)
                state.finish()
            except _StreamClosed:
                state.abandon()  # a fork's calls (the one read was aborted as it was read)
            except BaseException as e:  # noqa: BLE001 - re-raised on the reading side
                state.abandon()
                pieces.put(e)
            pieces.put(done)

        threading.Thread(target=target, name=f"jaxserve-lang-{self.fn.__name__}", daemon=True).start()
        try:
            while (piece := pieces.get()) is not done:
                if isinstance(piece, BaseException):
                    raise piece
                yield piece
        finally:
            closed.set()

    def trace(self, backend: Backend) -> Trace:
        """The shared prefix and call sites, from one run on placeholders (no model call)."""
        result = Trace([], "", [])
        state = _TraceState(backend, result)
        try:
            self.fn(state, **{name: Placeholder(f"argument {name!r}") for name in self.arg_names})
        except ProgramError:
            raise  # the program is wrong whatever its arguments (an unknown variable, a bad append)
        except Exception as e:  # noqa: BLE001 - what tracing can tell ends where it raised
            frame = traceback.extract_tb(e.__traceback__)[1:2]  # the program's line
            where = f" (line {frame[0].lineno}: {frame[0].line})" if frame else ""
            if isinstance(e, _Diverges):
                result.stopped = f"{e}{where}: the program may take another path per run, so sharing stops there"
            else:
                # A placeholder where only real text works (" ".join(...), json.dumps): the
                # text before it is still every run's, whatever the runs do with their values.
                result.stopped = f"{type(e).__name__}: {e}{where}: raised while tracing, so sharing stops there"
        return result

    def run_batch(
        self,
        backend: Backend,
        arguments: Sequence[dict],
        max_concurrency: int = 64,
        warm: bool = True,
        pin_s: float = 600.0,
        min_shared_tokens: int = 16,
    ) -> list[ProgramState]:
        """Runs the program once per argument dict, up to ``max_concurrency`` at a time.
        ``warm``: first trace it and compute the shared prefix (at least
        ``min_shared_tokens``) once, pinned in the prefix cache until the batch ends (or
        ``pin_s`` seconds pass, whichever is first), so the runs start from a cache hit
        instead of racing to compute it."""
        if not isinstance(max_concurrency, int) or isinstance(max_concurrency, bool) or max_concurrency < 1:
            raise ProgramError(f"run_batch(max_concurrency = {max_concurrency!r}): must be an integer >= 1")
        if not isinstance(arguments, Sequence) or isinstance(arguments, str):
            raise ProgramError(f"run_batch(arguments): a list of dicts (one per run), not {type(arguments).__name__}")
        for i, kwargs in enumerate(arguments):  # all of them before any run starts
            try:
                self._bind(kwargs)
            except ProgramError as e:
                raise ProgramError(f"run_batch(arguments[{i}]): {e}") from None
        lease = None
        if warm:
            trace = self.trace(backend)
            if len(trace.shared_token_ids) >= min_shared_tokens:
                outcome = backend.result(backend.submit(trace.shared_token_ids, SamplingParams(max_tokens=0), pin_s))
                lease = outcome.lease_id
        try:
            with concurrent.futures.ThreadPoolExecutor(max(1, min(max_concurrency, len(arguments)))) as pool:
                return list(pool.map(lambda kwargs: self.run(backend, **kwargs), arguments))
        finally:
            if lease is not None:
                backend.unpin(lease)


class _StreamClosed(Exception):
    """The reader of ``Program.stream`` stopped reading: the run ends here."""


class _Eager:
    """A state whose calls are waited for at once (streaming: text arrives in order)."""

    def __init__(self, state: ProgramState):
        self._state = state

    def __iadd__(self, item):
        self._state += item
        if isinstance(item, Gen | Role | Seq | Select):
            self._state._resolve()
        return self

    def __getattr__(self, name):
        return getattr(self._state, name)

    def __getitem__(self, name):
        return self._state[name]


def function(fn: Callable) -> Program:
    """Makes ``fn(s, ...)`` a program (see the module docstring)."""
    return Program(fn)
