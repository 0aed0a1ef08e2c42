"""Frontend programs (jaxserve.lang) on a tiny model: tracing, run_batch's warm-up, forks,
streaming, errors, and the same outputs offline and over gRPC."""

from __future__ import annotations

import subprocess
import sys

import pytest

from jaxserve import LLM, lang
from jaxserve.errors import RequestError
from tests.conftest import engine_held, tiny_server, wait_until

SYSTEM = "The capital of France is Paris. Machine learning and deep learning are fun. " * 6
TASKS = ["Paris", "Machine", "deep", "France", "fun", "capital", "learning", "The"]  # distinct first tokens
GREEDY = dict(temperature=0.0, ignore_eos=True)


@lang.function
def agent(s, task):
    s += lang.system(SYSTEM)
    s += lang.user("Task: ", task)  # two parts: "Task: " is shared, the task is not
    s += lang.assistant("Analysis: " + lang.gen("analysis", max_tokens=6, **GREEDY))
    s += lang.user("Action?")
    s += lang.assistant(lang.gen("action", max_tokens=4, **GREEDY))


@lang.function
def branchy(s, task):
    s += lang.system(SYSTEM)
    if task.startswith("P"):  # the path depends on the argument: sharing must stop here
        s += "Short answer. "
    else:
        s += "Long answer. "
    s += lang.gen("answer", max_tokens=3, **GREEDY)


@pytest.fixture(scope="module")
def tiny_path(tiny_model_dir):
    return tiny_model_dir("llama3")[0]


def _llm(path) -> LLM:
    return LLM(str(path), dtype="float32", page_size=16, num_pages=300, max_num_seqs=8,
               max_num_batched_tokens=64, progress=False, warmup=False)  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_path):
    return _llm(tiny_path)


def test_trace_shares_the_system_prompt_and_not_the_task(llm):
    backend = lang.LLMBackend(llm)
    try:
        trace = agent.trace(backend)
        sys_begin, sys_end = backend.roles["system"]
        user_begin, _ = backend.roles["user"]
        assert trace.shared_text == sys_begin + SYSTEM + sys_end + user_begin + "Task: "
        assert trace.shared_token_ids == sum(
            map(backend.encode, [sys_begin, SYSTEM, sys_end, user_begin, "Task: "]), []
        )
        assert [(c.name, c.shared_tokens, c.prompt_is_shared) for c in trace.calls] == [
            ("analysis", len(trace.shared_token_ids), False),
            ("action", len(trace.shared_token_ids), False),
        ]
        assert not trace.stopped
        # every real run's prompt starts with the shared ids
        state = agent.run(backend, task="Paris")
        assert state.token_ids[: len(trace.shared_token_ids)] == trace.shared_token_ids
    finally:
        backend.close()


def test_a_branch_on_an_argument_is_traced_without_a_false_share(llm):
    backend = lang.LLMBackend(llm)
    try:
        trace = branchy.trace(backend)
        sys_begin, sys_end = backend.roles["system"]
        assert trace.shared_text == sys_begin + SYSTEM + sys_end  # not "Short answer." nor "Long answer."
        assert "startswith" in trace.stopped and "task.startswith" in trace.stopped
        # the runs do differ right after it
        a, b = (branchy.run(backend, task=t).token_ids for t in ("Paris", "France"))
        n = len(trace.shared_token_ids)
        assert a[:n] == b[:n] and a[n] != b[n]
    finally:
        backend.close()


@lang.function
def joined(s, task):
    s += lang.system(SYSTEM)
    forks = s.fork(2)
    for i, f in enumerate(forks):
        f += lang.user(f"Idea {i} on {task}: ")
        f += lang.gen("idea", max_tokens=3, **GREEDY)
    s += lang.user("Ideas: " + "; ".join(f["idea"] for f in forks))  # str.join takes no placeholder
    s += lang.assistant(lang.gen("pick", max_tokens=3, **GREEDY))


def test_a_program_that_only_real_values_can_run_still_runs_batched(llm):
    """Tracing meets a placeholder where only real text works (str.join raises TypeError
    there): the shared prefix ends there, and run_batch runs the program as run does."""
    backend = lang.LLMBackend(llm)
    try:
        trace = joined.trace(backend)
        sys_begin, sys_end = backend.roles["system"]
        assert trace.shared_text == sys_begin + SYSTEM + sys_end
        assert trace.stopped.startswith("TypeError") and '"; ".join' in trace.stopped
        batched = joined.run_batch(backend, [{"task": t} for t in TASKS[:3]])
        assert [r.token_ids for r in batched] == [joined.run(backend, task=t).token_ids for t in TASKS[:3]]
    finally:
        backend.close()
    llm.scheduler.check_integrity()
    assert llm.stats()["kv_pages_held"] == 0


def test_run_batch_computes_the_shared_prefix_once(tiny_path):
    """Prefill tokens computed = the shared prefix once + each run's own remainder, exactly;
    against the same runs without the warm-up and without caching."""
    llm = _llm(tiny_path)  # an empty cache
    backend = lang.LLMBackend(llm)
    try:
        shared = len(agent.trace(backend).shared_token_ids)
        before = backend.stats()["prefill_tokens_computed"]
        runs = agent.run_batch(backend, [{"task": t} for t in TASKS], max_concurrency=8)
        computed = backend.stats()["prefill_tokens_computed"] - before
        assert backend.stats()["leases"] == 0 and backend.stats()["kv_pages_held"] == 0  # unpinned after
        remainder = 0
        for state in runs:
            (first, second) = state.calls
            remainder += first.prompt_tokens - shared
            # the second call's prompt starts with the first's prompt and output (all computed but the last)
            remainder += second.prompt_tokens - (first.prompt_tokens + 6 - 1)
            assert first.cached_tokens == shared and second.cached_tokens == first.prompt_tokens + 6 - 1
        assert computed == shared + remainder
        uncached = sum(c.prompt_tokens for s in runs for c in s.calls)
        assert computed < uncached - (len(TASKS) - 2) * shared
        for state, task in zip(runs, TASKS, strict=True):  # the batch's runs are the lone runs
            alone = agent.run(backend, task=task)
            assert (state["analysis"], state["action"]) == (alone["analysis"], alone["action"])
    finally:
        backend.close()
    llm.scheduler.check_integrity()


def test_forks_stream_and_errors(llm):
    @lang.function
    def fanout(s, question):
        s += lang.user(question)
        branches = s.fork(3)
        for i, b in enumerate(branches):
            b += lang.assistant(f"Option {i}: " + lang.gen(f"o{i}", max_tokens=3, **GREEDY))
        s += " | ".join(b[f"o{i}"] for i, b in enumerate(branches))

    with lang.LLMBackend(llm) as backend:
        state = fanout.run(backend, question="Paris?")
        assert state.text.count(" | ") >= 2 and "Option" not in state.text  # the branches' text is theirs
        single = agent.run(backend, task="deep")
        assert "".join(agent.stream(backend, task="deep")) == single.text

        @lang.function
        def unknown(s):
            s += s["nope"]

        with pytest.raises(lang.ProgramError, match=r"s\['nope'\]: no gen or select of that name"):
            unknown.run(backend)
        with pytest.raises(lang.ProgramError, match=r"s\['nope'\]"):
            unknown.trace(backend)

        @lang.function
        def bad_append(s):
            s += 5

        with pytest.raises(lang.ProgramError, match="s \\+= int: append a string, gen"):
            bad_append.run(backend)
        with pytest.raises(lang.ProgramError, match="agent: missing a required argument: 'task'"):
            agent.run(backend)
        with pytest.raises(lang.ProgramError, match="gen name = ''"):
            lang.gen("")
        with pytest.raises(lang.ProgramError, match="fork\\(n = 0\\)"):
            lang.ProgramState(backend).fork(0)
        with pytest.raises(lang.ProgramError, match="run_batch\\(max_concurrency = 0\\): must be an integer >= 1"):
            agent.run_batch(backend, [{"task": "deep"}], max_concurrency=0)
        # every run's arguments are checked before any run starts (a bad one failed in its
        # worker thread once the runs beside it had computed; one not a dict, a TypeError)
        with pytest.raises(lang.ProgramError, match=r"run_batch\(arguments\[1\]\): agent: missing a required argument"):
            agent.run_batch(backend, [{"task": "deep"}, {"job": "x"}])
        with pytest.raises(
            lang.ProgramError, match=r"run_batch\(arguments\[0\]\): agent: its arguments must be a dict"
        ):
            agent.run_batch(backend, ["deep"])
        with pytest.raises(
            lang.ProgramError, match=r"run_batch\(arguments\): a list of dicts \(one per run\), not str"
        ):
            agent.run_batch(backend, "deep")
        with pytest.raises(RequestError, match=r"the program's text: not valid Unicode text: a lone surrogate"):
            agent.run(backend, task="\ud800")
        with pytest.raises(RequestError, match=r"sampling_params.max_tokens = '5': must be an integer >= 0"):
            lang.gen("x", max_tokens="5")
        assert backend.stats()["kv_pages_held"] == 0


def test_a_gen_takes_a_structured_output_constraint(llm):
    import json
    import re

    @lang.function
    def card(s, name):
        s += lang.user(f"A card for {name}")
        s += lang.assistant(lang.gen("id", max_tokens=20, temperature=1.0, seed=2, regex=r"[A-Z]{2}-[0-9]{3}"))
        s += lang.gen("info", max_tokens=60, temperature=1.0, seed=3, json_schema=json.dumps(CARD))

    with lang.LLMBackend(llm) as backend:
        state = card.run(backend, name="Ada")
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", state["id"])
    assert json.loads(state["info"])["level"] in (1, 2, 3)


CARD = {
    "type": "object",
    "properties": {"level": {"enum": [1, 2, 3]}, "ok": {"type": "boolean"}},
    "required": ["level", "ok"],
    "additionalProperties": False,
}


@lang.function
def quiz(s, q):
    s += lang.user(q)
    s += lang.select("a", [" fun", " Paris"])


def test_the_same_program_gives_the_same_outputs_offline_and_over_grpc(tiny_path, llm):
    with lang.LLMBackend(llm) as offline:
        expected = [agent.run(offline, task=t) for t in TASKS[:3]]
    with tiny_server(tiny_path) as (_, server, addr):
        with lang.Endpoint(addr, model=str(tiny_path)) as remote:
            got = agent.run_batch(remote, [{"task": t} for t in TASKS[:3]])
            assert [s.text for s in got] == [s.text for s in expected]
            assert [s.token_ids for s in got] == [s.token_ids for s in expected]
            assert remote.stats().leases == 0
            streamed = "".join(agent.stream(remote, task=TASKS[0]))
            assert streamed == expected[0].text
            _check_a_closed_stream_ends_its_call(remote, server.engine_thread)
            _check_a_raising_program_aborts_its_calls(remote, server.engine_thread)
            remote_pick = quiz.run(remote, q="Paris is")
        with lang.LLMBackend(llm) as offline:
            local_pick = quiz.run(offline, q="Paris is")
        assert remote_pick["a"] == local_pick["a"]
        assert remote_pick.scores["a"] == pytest.approx(local_pick.scores["a"], abs=1e-5)
        server.engine_thread.call(lambda e: e.scheduler.check_integrity())


@lang.function
def story(s):
    s += "Tell me a story: " + lang.gen("a", max_tokens=900, ignore_eos=True)
    s += "And another: " + lang.gen("b", max_tokens=900, ignore_eos=True)


def _decoded(thread) -> int:
    return thread.call(lambda e: e.stats()["decode_tokens"])


def _check_a_closed_stream_ends_its_call(backend, thread) -> None:
    """A stream closed after its first piece (the text before the first gen): that gen is
    aborted at its next text, the second never sent. Before, the program went on for a
    reader long gone: the first gen's 900 tokens, then the second's."""
    before = _decoded(thread)
    pieces = story.stream(backend)
    assert next(pieces) == "Tell me a story: "
    pieces.close()
    # the gen may be sent after the reader left: wait for its first token, then its end
    ended = lambda: _decoded(thread) > before and not thread.call(lambda e: e.has_unfinished())  # noqa: E731
    wait_until(ended, "the closed stream's call to end")
    assert _decoded(thread) - before < 450  # a few tokens; to the end (899 decoded after its first) before


@lang.function
def broken(s, until_running):
    s += "Tell me a story: "
    for branch in s.fork(2):
        branch += lang.gen("b", max_tokens=900, ignore_eos=True)
    s += lang.gen("a", max_tokens=900, ignore_eos=True)
    until_running()
    raise ValueError("a bug of the program's own")


def _check_a_raising_program_aborts_its_calls(backend, thread) -> None:
    """Three calls in the engine (two forks' and its own) when the program raises: each is
    aborted, not left to generate 900 tokens for nobody. (Over gRPC the forks' calls were
    cancelled before, and too early, when the loop dropped their states and gRPC's futures
    went with them; a run now keeps its states, as offline where they ran to the end.)"""
    before, aborted = _decoded(thread), thread.aborted["cancelled"]
    running = lambda: thread.call(lambda e: len(e.requests)) == 3  # noqa: E731
    with pytest.raises(ValueError, match="a bug of the program's own"):
        broken.run(backend, until_running=lambda: wait_until(running, "the program's three calls to run"))
    wait_until(lambda: thread.aborted["cancelled"] == aborted + 3, "the three calls' aborts")
    wait_until(lambda: not thread.call(lambda e: e.has_unfinished()), "the engine to be idle")
    assert _decoded(thread) - before < 900


def test_a_closed_stream_or_a_raising_program_ends_its_calls_offline(llm):
    with lang.LLMBackend(llm) as backend:
        _check_a_closed_stream_ends_its_call(backend, backend._thread)
        _check_a_raising_program_aborts_its_calls(backend, backend._thread)

        @lang.function
        def pick(s):
            s += "Which? "
            s += lang.select("c", [" short", " long" * 2000])  # the second is past the context

        # the first choice's scoring call was left to run when the second was refused
        before = backend._thread.aborted["cancelled"]
        with engine_held(backend._thread), pytest.raises(lang.ProgramError, match="the program's prompt is"):
            pick.run(backend)  # (held: the first call's add and its abort queue up, in order)
        wait_until(lambda: not backend._thread.call(lambda e: e.has_unfinished()), "the engine to be idle")
        assert backend._thread.aborted["cancelled"] == before + 1


QUESTIONS = [
    (f"Question {i}: which word follows '{a}'? Answer:", [" Paris", " learning", " fun", " France"][: 2 + i % 3])
    for i, a in enumerate(
        [
            "The capital",
            "Machine",
            "deep",
            "are",
            "of France is",
            "and deep",
            "fun.",
            "capital of",
            "France",
            "is Paris.",
            "learning and",
            "The",
            "Paris. Machine",
            "deep learning",
            "are fun",
            "of",
            "and",
            "is",
            "Machine learning",
            "capital",
        ]  # fmt: skip
    )
]


def test_select_agrees_with_transformers_summed_logprobs(tiny_model_dir):
    """20 held-out multiple-choice prompts: each choice's score is the sum of its tokens'
    logprobs after the prompt (to 1e-4 against transformers in float32), the pick is the
    best, and the prompt is computed once for all its choices."""
    import numpy as np
    import torch

    path, hf = tiny_model_dir("llama3")
    llm = _llm(path)

    @lang.function
    def quiz(s, question, choices):
        s += lang.user(question)
        s += lang.assistant(lang.select("answer", choices))

    with lang.LLMBackend(llm) as backend:
        before = backend.stats()["prefill_tokens_computed"]
        state = quiz.run(backend, question=QUESTIONS[0][0], choices=QUESTIONS[0][1])
        ids = [backend.encode(c) for c in QUESTIONS[0][1]]
        prefix = state.calls[0].prompt_tokens - len(ids[0])  # the choices follow the user turn
        # the prompt once, then per further choice its tokens and the prompt's last one
        assert [o.cached_tokens for o in state.calls] == [0] + [prefix - 1] * (len(ids) - 1)
        assert backend.stats()["prefill_tokens_computed"] - before == prefix + len(ids[0]) + sum(
            1 + len(c) for c in ids[1:]
        )
        states = quiz.run_batch(backend, [{"question": q, "choices": c} for q, c in QUESTIONS])
        assert quiz.trace(backend).stopped  # the choices are an argument: select() iterates them
    for state, (_, choices) in zip(states, QUESTIONS, strict=True):
        prefix = state.token_ids[: state.calls[0].prompt_tokens - len(backend.encode(choices[0]))]
        ref = []
        for c in choices:
            full = prefix + backend.encode(c)
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([full])).logits[0].double(), -1).numpy()
            ref.append(sum(lp[j - 1, full[j]] for j in range(len(prefix), len(full))))
        np.testing.assert_allclose(state.scores["answer"], ref, atol=1e-4)
        assert state["answer"] == choices[int(np.argmax(ref))]
    llm.scheduler.check_integrity()


# A script that leaves a program's stream early and ends with its backend still open.
LEAVES_EARLY = """
import sys
from jaxserve import LLM, lang
from jaxserve.errors import RequestError
llm = LLM(sys.argv[1], dtype="float32", num_pages=64, max_num_seqs=4, max_num_batched_tokens=64, progress=False)

@lang.function
def story(s):
    s += lang.user("Tell me a long story.")
    s += lang.assistant(lang.gen("story", max_tokens=400, temperature=0.0, ignore_eos=True))

for i, piece in enumerate(story.stream(lang.LLMBackend(llm))):
    if i == 3:
        break
"""


def test_a_script_that_ends_with_its_backend_still_generating_exits_0(tiny_path):
    """The backend's engine thread is still stepping the abandoned run when the script
    ends: it is stopped at exit, between steps (the interpreter used to end it inside an
    XLA call, which aborted the process: "terminate called ...", exit 134)."""
    done = subprocess.run(
        [sys.executable, "-c", LEAVES_EARLY, str(tiny_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "terminate called" not in done.stderr


def test_an_endpoint_with_no_server_there_is_one_error():
    """It was grpc's _InactiveRpcError with its debug string, from the tokenizer's lookup."""
    with pytest.raises(lang.ProgramError, match=r"Endpoint\('127.0.0.1:1'\): the jaxserve gRPC API does not answer \("):
        lang.Endpoint("127.0.0.1:1")


def test_a_program_starts_with_the_tokenizers_bos_once():
    """A tokenizer that puts a BOS before a text (Llama's, Mistral's): a program's first text
    starts with it, as LLM.generate's prompt of text does, once even where a role block's
    template renders it too, and not again later; the trace's shared prefix is the runs'."""
    from tokenizers import processors

    from tests.conftest import TINY_CHAT_TEMPLATE, _tiny_tokenizer

    tok = _tiny_tokenizer()
    tok.add_special_tokens({"bos_token": "<s>"})
    bos = tok.bos_token_id
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.chat_template = "{{ bos_token }}" + TINY_CHAT_TEMPLATE
    assert tok.encode("The capital")[0] == bos

    class Recording(lang.Backend):
        def __init__(self):
            self.tokenizer, self.sent = tok, []

        def submit(self, token_ids, params, pin_s=None, on_text=None):
            self.sent.append(list(token_ids))

        def result(self, handle):
            return lang.backends.Outcome([], "", "length")

    @lang.function
    def plain(s, place):
        s += "The capital"
        s += " of "
        s += place
        s += lang.gen("a", max_tokens=1)

    @lang.function
    def system_first(s, q):
        s += lang.system("S")
        s += lang.user(q)
        s += lang.assistant(lang.gen("a", max_tokens=1))

    @lang.function
    def user_first(s, q):  # the template's BOS is in the system block's text only
        s += lang.user(q)
        s += lang.assistant(lang.gen("a", max_tokens=1))

    backend = Recording()
    plain.run(backend, place="France")
    plain_ids = [tok.encode(t, add_special_tokens=False) for t in ("The capital", " of ", "France")]
    assert backend.sent[-1] == [bos, *plain_ids[0], *plain_ids[1], *plain_ids[2]]
    assert plain.trace(backend).shared_token_ids == [bos, *plain_ids[0], *plain_ids[1]]
    for program in (system_first, user_first):
        program.run(backend, q="Hi")
        assert backend.sent[-1][0] == bos and backend.sent[-1].count(bos) == 1, program.__name__
