"""Frontend programs, SGLang-style: ``@function`` programs of ``gen`` / role blocks / ``fork``
against the offline engine or a running server, traced ahead of time so that the prefix
every run shares is computed once (see ``program.py``)::

    from jaxserve import LLM, lang

    @lang.function
    def qa(s, question):
        s += lang.system("You answer in one word.")
        s += lang.user(question)
        s += lang.assistant(lang.gen("answer", max_tokens=8))

    with lang.LLMBackend(LLM()) as backend:
        print(qa.run(backend, question="Capital of France?")["answer"])
"""

from jaxserve.lang.backends import Backend, Endpoint, LLMBackend, Outcome, ProgramError
from jaxserve.lang.program import (
    CallSite,
    Gen,
    Placeholder,
    Program,
    ProgramState,
    Role,
    Select,
    Seq,
    Trace,
    assistant,
    function,
    gen,
    select,
    system,
    user,
)

__all__ = [
    "Backend",
    "CallSite",
    "Endpoint",
    "Gen",
    "LLMBackend",
    "Outcome",
    "Placeholder",
    "Program",
    "ProgramError",
    "ProgramState",
    "Role",
    "Select",
    "Seq",
    "Trace",
    "assistant",
    "function",
    "gen",
    "select",
    "system",
    "user",
]
