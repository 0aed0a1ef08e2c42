"""``lang.select`` on SmolLM2 in float32 against transformers: for 20 multiple-choice
questions, each choice's score (the sum of its tokens' logprobs after the prompt) and the
pick, from jaxserve's engine and from the Hugging Face model on PyTorch CPU.

    .venv/bin/python scripts/vllm_compare.py convert /tmp/smollm2-hf    # once: SmolLM2 as HF
    .venv/bin/python scripts/check_select.py /tmp/smollm2-hf

Not a test (it needs the real model); prints each question's largest score difference and
whether the picks agree, then the worst difference.
"""

from __future__ import annotations

import sys

QUESTIONS = [
    ("What is the capital of France?", ["Paris", "Lyon", "Berlin", "Madrid"]),
    ("What colour is a clear daytime sky?", ["Blue", "Green", "Red"]),
    ("How many legs does a spider have?", ["Eight", "Six", "Four", "Ten"]),
    ("Which planet is known as the red planet?", ["Mars", "Venus", "Jupiter"]),
    ("What is 2 + 2?", ["4", "5", "22", "3"]),
    ("Which animal barks?", ["A dog", "A cat", "A fish"]),
    ("What do bees make?", ["Honey", "Milk", "Silk"]),
    ("Which is the largest ocean?", ["The Pacific", "The Atlantic", "The Indian"]),
    ("What is frozen water called?", ["Ice", "Steam", "Sand"]),
    ("Which language is spoken in Brazil?", ["Portuguese", "Spanish", "French"]),
    ("How many days are in a week?", ["Seven", "Five", "Ten"]),
    ("What gas do plants take in?", ["Carbon dioxide", "Oxygen", "Helium"]),
    ("Which metal is liquid at room temperature?", ["Mercury", "Iron", "Gold"]),
    ("Who wrote Romeo and Juliet?", ["Shakespeare", "Dickens", "Tolstoy"]),
    ("What is the boiling point of water in Celsius?", ["100 degrees", "50 degrees", "0 degrees"]),
    ("Which continent is Egypt in?", ["Africa", "Asia", "Europe"]),
    ("What is the opposite of hot?", ["Cold", "Warm", "Loud"]),
    ("Which shape has three sides?", ["A triangle", "A square", "A circle"]),
    ("What do you call a baby cat?", ["A kitten", "A puppy", "A calf"]),
    ("Which organ pumps blood?", ["The heart", "The lungs", "The liver"]),
]


def main(model_dir: str) -> int:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from jaxserve import LLM, lang

    @lang.function
    def quiz(s, question, choices):
        s += lang.user(question)
        s += lang.assistant(lang.select("answer", choices))

    llm = LLM(model_dir, dtype="float32", weight_dtype="float32", kv_cache_dtype="float32", progress=False)
    with lang.LLMBackend(llm) as backend:
        states = quiz.run_batch(backend, [{"question": q, "choices": c} for q, c in QUESTIONS])
        encode = backend.encode
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    worst, agree = 0.0, 0
    for state, (question, choices) in zip(states, QUESTIONS, strict=True):
        prefix = state.token_ids[: state.calls[0].prompt_tokens - len(encode(choices[0]))]
        ref = []
        for c in choices:
            full = prefix + encode(c)
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([full])).logits[0].double(), -1).numpy()
            ref.append(sum(lp[j - 1, full[j]] for j in range(len(prefix), len(full))))
        diff = float(np.max(np.abs(np.array(state.scores["answer"]) - np.array(ref))))
        same = state["answer"] == choices[int(np.argmax(ref))]
        worst, agree = max(worst, diff), agree + same
        print(f"{question[:48]:48s} pick {state['answer']!r:18s} max |score - transformers| {diff:.2e} agree {same}")
    print(f"{agree} of {len(QUESTIONS)} picks agree; worst score difference {worst:.2e}")
    print("command: python " + " ".join(sys.argv))
    return 0 if agree == len(QUESTIONS) and worst < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
