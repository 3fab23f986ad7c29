"""Stop strings and stop token ids on a whole block, checked against a token-by-token
reference that decodes after every token as a streaming server does."""

from __future__ import annotations

import random

import pytest

from gateway.stops import StopSpec, apply_stops


def reference(ids, decode, spec):
    """Generate token by token; stop at a stop id (excluded) or once a stop string shows."""
    out = []
    for token in ids:
        if token in spec.token_ids:
            return tuple(out), decode(out), token
        out.append(token)
        text = decode(out)
        hits = [(text.find(s), s) for s in spec.strings if s in text]
        if hits:
            pos, s = min(hits)
            kept = text[: pos + len(s)] if spec.include_stop_str_in_output else text[:pos]
            return tuple(out), kept, s
    return tuple(out), decode(out), None


VOCAB = ["a", "b", "c", "ab", "bc", " ", "xyz", "é"]


def decode(ids):
    return "".join(VOCAB[i] for i in ids)


@pytest.mark.parametrize("seed", range(200))
def test_the_block_cut_equals_token_by_token_generation(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(len(VOCAB)) for _ in range(rng.randint(0, 40))]
    spec = StopSpec(
        strings=tuple(rng.choice(["ab", "c a", "bcb", "zz", "xy", "é b", " "]) for _ in range(2)),
        token_ids=tuple(rng.sample(range(len(VOCAB)), rng.randint(0, 1))),
        include_stop_str_in_output=rng.random() < 0.5,
    )
    cut = apply_stops(ids, decode, spec)
    assert (cut.token_ids, cut.text, cut.stop_reason) == reference(ids, decode, spec)


def test_no_stop_leaves_the_answer_whole():
    cut = apply_stops([0, 1, 2], decode, StopSpec())
    assert (cut.token_ids, cut.text, cut.stop_reason) == ((0, 1, 2), "abc", None)


def test_stop_string_across_tokens():
    # "ab" + "c" -> "abc"; stop "bc" completes on the second token, both tokens kept
    cut = apply_stops([3, 2, 0], decode, StopSpec(strings=("bc",)))
    assert cut == type(cut)((3, 2), "a", "bc")
    cut = apply_stops([3, 2, 0], decode, StopSpec(strings=("bc",), include_stop_str_in_output=True))
    assert cut.text == "abc"
