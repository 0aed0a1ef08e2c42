"""Structured output on the real SmolLM2-135M-Instruct (float32): 20 JSON schemas it has
never seen (nested objects, arrays, enums, bounded numbers), a regex and a choice. With
the constraint every output parses and validates; without it, some of the same prompts
give invalid JSON (so the check can fail)."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from jaxserve import LLM, SamplingParams


def _obj(props: dict, required=None) -> dict:
    return {"type": "object", "properties": props, "required": required or list(props), "additionalProperties": False}


S = {"type": "string", "maxLength": 24}
INT = {"type": "integer", "minimum": 0, "maximum": 1000}
SCHEMAS = [
    ("a person with a name and an age", _obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("a book with a title, an author and a year", _obj({"title": S, "author": S, "year": INT})),
    ("a city with its country and population in millions", _obj({"city": S, "country": S, "millions": INT})),
    ("a traffic light state", _obj({"color": {"enum": ["red", "yellow", "green"]}, "seconds": INT})),
    ("a shopping list", _obj({"items": {"type": "array", "items": S, "minItems": 1, "maxItems": 4}})),
    ("a point in 2D", _obj({"x": {"type": "integer", "minimum": -100, "maximum": 100}, "y": INT})),
    (
        "an order with a customer and its lines",
        _obj(
            {
                "customer": _obj({"name": S, "email": S}),
                "lines": {"type": "array", "items": _obj({"sku": S, "qty": INT}), "maxItems": 3},
            }
        ),
    ),
    ("the weather today", _obj({"sky": {"enum": ["sunny", "cloudy", "rainy"]}, "celsius": INT})),
    ("a movie rating", _obj({"movie": S, "stars": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("a recipe", _obj({"dish": S, "steps": {"type": "array", "items": S, "maxItems": 3}, "minutes": INT})),
    ("a pet", _obj({"kind": {"enum": ["cat", "dog", "bird"]}, "name": S, "vaccinated": {"type": "boolean"}})),
    ("a chess move", _obj({"piece": {"enum": ["king", "queen", "rook", "bishop", "knight", "pawn"]}, "to": S})),
    ("a computer", _obj({"cpu": S, "ram_gb": INT, "ports": {"type": "array", "items": S, "maxItems": 3}})),
    ("a planet", _obj({"name": S, "moons": INT, "rings": {"type": "boolean"}})),
    ("a student's grades", _obj({"student": S, "grades": {"type": "array", "items": INT, "maxItems": 4}})),
    (
        "a company with its address",
        _obj({"company": S, "address": _obj({"street": S, "city": S, "zip": S}), "employees": INT}),
    ),
    ("a song", _obj({"title": S, "artist": S, "genre": {"enum": ["pop", "rock", "jazz", "classical"]}})),
    ("a flight", _obj({"from": S, "to": S, "hours": {"type": "integer", "minimum": 1, "maximum": 20}})),
    ("a color in RGB", _obj({"r": INT, "g": INT, "b": INT})),
    (
        "a to-do item",
        _obj(
            {"task": S, "done": {"type": "boolean"}, "priority": {"enum": ["low", "medium", "high"]}}, ["task", "done"]
        ),
    ),
]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(
        str(smollm2_path), dtype="float32", max_num_batched_tokens=256, max_num_seqs=20, progress=False, warmup=False
    )


def _prompt(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe {what} as a JSON object."}]


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def test_json_schemas_regex_and_choice_hold_on_smollm2(llm):
    """Each unconstrained request runs in the same batch as its constrained twin (a
    request's greedy tokens do not depend on its batch: tests/test_batching.py). The
    first three schemas' prompts end on their own within 70 tokens unconstrained, so they
    add few steps."""
    prompts = [_prompt(what) for what, _ in SCHEMAS]
    constrained = [SamplingParams(max_tokens=200, temperature=0.0, json_schema=json.dumps(s)) for _, s in SCHEMAS]
    outs = llm.generate(prompts + prompts[:3], constrained + [SamplingParams(max_tokens=200, temperature=0.0)] * 3)
    outs, free = outs[: len(SCHEMAS)], outs[len(SCHEMAS) :]
    bad = [(what, o.text) for (what, s), o in zip(SCHEMAS, outs, strict=True) if not _valid(o.text, s)]
    assert not bad, bad
    assert all(o.finish_reason == "stop" for o in outs)
    assert sum(not _valid(o.text, s) for (_, s), o in zip(SCHEMAS[:3], free, strict=True)) > 0

    phone = r"\(?[0-9]{3}\)? ?[0-9]{3}-[0-9]{4}"
    questions = [[{"role": "user", "content": q}] for q in ("Give me a phone number.", "What is 2 + 2?")]
    both = [SamplingParams(max_tokens=40, temperature=0.0, regex=phone), SamplingParams(max_tokens=40, temperature=0.0)]
    outs = llm.generate(questions * 2, [p for p in both for _ in questions])
    regex, free = outs[: len(questions)], outs[len(questions) :]
    assert all(re.fullmatch(phone, o.text) for o in regex), [o.text for o in regex]
    assert not all(re.fullmatch(phone, o.text) for o in free)
    choices = ("Paris", "London", "Berlin", "Madrid")
    capital = [{"role": "user", "content": "What is the capital of Germany? Answer with the city only."}]
    picked = llm.generate([capital], SamplingParams(max_tokens=10, temperature=0.0, choice=choices))[0]
    assert picked.text in choices
