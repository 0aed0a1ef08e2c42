"""Structured output (llguidance): a random-weight model's outputs obey the constraint
every time (and do not without it), the constraint composes with sampling options,
batching, overlap scheduling, n > 1 and the prefix cache, ends the request when the
grammar is complete, and bad constraints are errors naming the field."""

from __future__ import annotations

import dataclasses
import json
import logging
import re

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine import structured
from jaxserve.errors import RequestError

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "fox"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "score": {"type": "number"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "owner"],
    "additionalProperties": False,
}
PROMPTS = ["Machine learning", "The capital of France", "Deep learning is fun", "Paris"]


def _llm(tiny_model_dir, **options) -> LLM:
    path = str(tiny_model_dir("llama3")[0])
    return LLM(path, dtype="float32", page_size=16, num_pages=200, max_num_seqs=8, max_num_batched_tokens=64,
               progress=False, **options)  # fmt: skip


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return _llm(tiny_model_dir)


def _sampled(**kw) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=200, temperature=1.0, seed=i, **kw) for i in range(len(PROMPTS))]


def test_regex_and_choice_hold_every_time_and_not_without(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}( ok)?"
    outs = llm.generate(PROMPTS * 2, _sampled(regex=regex) * 2)
    assert all(re.fullmatch(regex, o.text) for o in outs), [o.text for o in outs]
    assert all(o.finish_reason == "stop" for o in outs)  # the request ends when the regex is complete
    free = llm.generate(PROMPTS * 2, _sampled() * 2)
    assert not any(re.fullmatch(regex, o.text) for o in free)  # the model alone does not
    choices = ("yes", "no", "maybe later")
    picked = llm.generate(PROMPTS, _sampled(choice=choices))
    assert all(o.text in choices for o in picked), [o.text for o in picked]


def test_json_schema_and_json_object_parse_and_validate(llm):
    outs = llm.generate(PROMPTS * 2, _sampled(json_schema=json.dumps(SCHEMA)) * 2)
    for o in outs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
    objects = llm.generate(PROMPTS, [SamplingParams(max_tokens=300, temperature=0.7, seed=3, json_object=True)] * 4)
    for o in objects:
        if o.finish_reason == "stop":  # an open-ended object may run to max_tokens; a finished one parses
            assert isinstance(json.loads(o.text), dict)
        else:
            assert o.text.startswith("{")
    assert any(o.finish_reason == "stop" for o in objects)
    free = llm.generate(PROMPTS, _sampled())
    assert not any(_parses(o.text) for o in free)


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def test_a_constrained_request_leaves_its_batch_alone_and_composes(llm):
    """Batched with plain requests: theirs are the same as alone (the mask is per row), and
    the constrained one is the same as alone too; with penalties, top-k / top-p, stop
    strings, n > 1 and a cached prefix."""
    regex = r"[a-e]{2,6}(, [a-e]{2,6}){0,3}"
    plain = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in range(3)]
    constrained = SamplingParams(
        max_tokens=60, temperature=0.9, seed=11, regex=regex, top_k=30, top_p=0.95, repetition_penalty=1.2
    )
    alone = [llm.generate([p], [sp])[0].text for p, sp in zip(PROMPTS, plain, strict=False)]
    alone_c = llm.generate([PROMPTS[3]], [constrained])[0].text
    together = llm.generate(PROMPTS, [*plain, constrained])
    assert [o.text for o in together[:3]] == alone
    assert together[3].text == alone_c and re.fullmatch(regex, alone_c)
    # A stop string still ends it early (before the grammar completes).
    stopped = llm.generate([PROMPTS[3]], [SamplingParams(**{**_fields(constrained), "stop": (",",)})])[0]
    assert stopped.text == alone_c.split(",")[0]
    # n samples, each with its own grammar state; a long shared prefix from the cache.
    prefix = "Deep learning is fun. " * 8
    first = llm.generate([prefix + "A"], [SamplingParams(max_tokens=1, temperature=0.0)])[0]
    many = llm.generate([prefix + "B"], [SamplingParams(max_tokens=40, temperature=1.0, seed=5, n=4, regex=regex)])[0]
    assert first.text is not None and len(many.samples) == 4
    assert all(re.fullmatch(regex, s.text) for s in many.samples)
    assert many.num_cached_tokens > 0


def _fields(params: SamplingParams) -> dict:
    import dataclasses

    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def test_overlapped_and_serial_loops_give_the_same_constrained_outputs(tiny_model_dir):
    outs = []
    for overlap in (True, False):
        llm = _llm(tiny_model_dir, warmup=False, overlap_scheduling=overlap)
        params = _sampled(json_schema=json.dumps(SCHEMA)) + [SamplingParams(max_tokens=20, temperature=0.0)] * 4
        outs.append([o.text for o in llm.generate(PROMPTS * 2, params)])
        llm.scheduler.check_integrity()
    assert outs[0] == outs[1]


BAD = [
    (dict(regex="(unclosed"), r"(?s)sampling_params.regex: .*unclosed"),
    (dict(json_schema="{not json"), r"sampling_params.json_schema: not a JSON schema"),
    (dict(json_schema='{"type": "bogus"}'), r"(?s)sampling_params.json_schema: .*bogus"),
    (dict(grammar="start: ( "), r"sampling_params.grammar: "),
    (dict(regex="a+", choice=("a",)), r"sampling_params.choice: only one structured-output constraint"),
    (dict(choice=("",)), r"sampling_params.choice = \('',\): must be None or 1 to 256 non-empty strings"),
    (dict(regex=""), r"sampling_params.regex = '': must be a non-empty string"),
    # Valid, but its first token mask exceeds llguidance's lexer limits (its failure state
    # would allow only the end of sequence: an empty "stop" that never met the regex).
    (
        dict(regex="(" * 8 + "[a-z ]{1,100}" + "){1,100}" * 8),
        r"sampling_params.regex: too complex to enforce over this",
    ),
    (dict(grammar='start: start "a"'), r"sampling_params.grammar: no output can satisfy it \(llguidance: NoExtension"),
]


@pytest.mark.parametrize("kwargs, message", BAD)
def test_a_bad_constraint_is_an_error_naming_the_field(llm, kwargs, message):
    with pytest.raises(RequestError, match=message):
        llm.generate(["hi"], SamplingParams(max_tokens=4, **kwargs))
    assert llm.stats()["kv_pages_held"] == 0


def test_a_grammar_that_fails_mid_way_ends_its_request_as_abort(llm, caplog):
    """A regex whose first masks compute but whose lexer exceeds llguidance's limits after
    ~15 'a's (forced by the bias): that mask allows only the end of sequence, so the
    request used to end as "stop" with text that does not match. It ends as "abort",
    the reason in the log; the request beside it is untouched."""
    regex = "((((a{1,100}){1,100}){1,100}){1,100})"
    a = llm.tokenizer.convert_tokens_to_ids("a")
    forced = SamplingParams(max_tokens=60, temperature=0.0, regex=regex, logit_bias={a: 100.0})
    beside = SamplingParams(max_tokens=8, temperature=0.0, regex="[a-z]{8}")
    with caplog.at_level(logging.WARNING, logger="jaxserve.engine.scheduler"):
        failed, ok = llm.generate(["Paris", "Machine learning"], [forced, beside])
    assert failed.finish_reason == "abort", (failed.finish_reason, failed.text)
    assert 0 < len(failed.text) < 60 and set(failed.text) == {"a"}, failed.text
    assert "structured-output constraint failed after" in caplog.text
    assert "too many expressions" in caplog.text
    assert ok.finish_reason == "stop" and re.fullmatch("[a-z]{8}", ok.text)
    llm.scheduler.check_integrity()
    assert llm.stats()["kv_pages_held"] == 0


def test_the_engine_thread_copies_each_grammar_it_never_compiles_one(tiny_model_dir, monkeypatch):
    """A matcher is compiled once per grammar, on the submitting thread (where the request
    is checked); the engine thread copies it for each request. It compiled one per request
    itself: ~80 ms for a 1500-property schema over SmolLM2's vocabulary, during which no
    stream got a token."""
    import threading

    import llguidance

    from jaxserve.engine.async_engine import EngineThread

    real = llguidance.LLMatcher
    compiled_on = []

    class Counting:
        def __new__(cls, *args, **kwargs):
            compiled_on.append(threading.current_thread().name)
            return real(*args, **kwargs)

    for name in ("validate_grammar", "grammar_from_json_schema", "grammar_from_regex", "grammar_from_lark"):
        setattr(Counting, name, staticmethod(getattr(real, name)))
    monkeypatch.setattr(llguidance, "LLMatcher", Counting)
    llm = _llm(tiny_model_dir, warmup=False)
    served = EngineThread(llm.engine)  # LLM.generate now submits to it, as a server's clients do
    served.start()
    try:
        params = [dataclasses.replace(p, n=2) for p in _sampled(json_schema=json.dumps(SCHEMA))]
        outs = llm.generate(PROMPTS, params)
    finally:
        served.stop()
    for o in outs:
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert compiled_on == ["MainThread"]  # one grammar, 8 requests; none on "jaxserve-engine"


def test_the_remembered_grammars_are_bounded_in_number_and_characters(llm, monkeypatch):
    monkeypatch.setattr(structured, "MAX_CHECKED_CHARS", 300_000)
    compiler = llm.engine.grammars
    for i in range(12):  # 12 x ~95k characters: past the character bound, not the count
        compiler.check(SamplingParams(regex=f"x{i}" + "(ab|cd)" * 13_500))
    assert compiler._checked_chars <= structured.MAX_CHECKED_CHARS
    assert compiler._checked_chars == sum(map(len, compiler._checked))
    assert 0 < len(compiler._checked) < 12
    assert len(compiler._ready) <= structured.MAX_READY_MATCHERS
