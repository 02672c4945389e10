"""Incremental detokenization: whole characters only, stop strings held back and cut, special
tokens left out; against the tiny model's byte-level BPE tokenizer."""

from itertools import pairwise

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.gateway.detok import REPLACEMENT, Detokenizer, partial_suffix_len
from tests.support import byte_tokens

HYPOTHESIS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def run(tok, ids, stop=()) -> tuple[list[str], bool, int]:
    """Feed ``ids`` one by one: (deltas, stopped, tokens fed)."""
    detok = Detokenizer(tok, stop)
    deltas = []
    for fed, token_id in enumerate(ids, start=1):
        delta = detok.feed([token_id])
        deltas.append(delta.text)
        if delta.stopped:
            return deltas, True, fed
    deltas.append(detok.finish())
    return deltas, False, len(ids)


def test_multibyte_characters_are_never_split(tok):
    text = "héllo 日本 ok"
    ids = byte_tokens(tok, text)
    assert len(ids) > len(text)  # é and the CJK characters take several tokens each
    deltas, stopped, _ = run(tok, ids)
    assert not stopped
    assert "".join(deltas) == text
    assert all(REPLACEMENT not in d for d in deltas)
    # the first byte of "日" alone shows nothing; the character appears with its last byte
    first_cjk = len(byte_tokens(tok, "héllo "))
    assert deltas[first_cjk : first_cjk + 2] == ["", ""]
    assert deltas[first_cjk + 2] == "日"


def test_special_tokens_are_not_returned(tok):
    ids = tok.encode("the answer<|im_end|>", add_special_tokens=False)
    assert ids[-1] == tok.eos_token_id
    deltas, _, _ = run(tok, ids)
    assert "".join(deltas) == "the answer"
    assert deltas[-2] == ""  # the eos token itself adds nothing


def test_stop_string_is_held_back_then_cut(tok):
    ids = byte_tokens(tok, "hello world and more")
    deltas, stopped, fed = run(tok, ids, stop=["world"])
    assert stopped
    assert "".join(deltas) == "hello "
    assert fed == len("hello world")  # the token that completed the stop string
    # "wor" was never shown while it could still become "world"
    assert deltas[len("hello w") - 1] == ""


def test_text_that_only_looked_like_a_stop_string_is_released(tok):
    deltas, stopped, _ = run(tok, byte_tokens(tok, "hello word"), stop=["world"])
    assert not stopped
    assert "".join(deltas) == "hello word"
    assert deltas[len("hello wor") - 1] == ""  # "wor" held ...
    assert deltas[len("hello word") - 1] == "word"  # ... and released when "d" ruled it out


def test_stop_string_inside_a_merged_token(tok):
    ids = tok.encode("say the answer", add_special_tokens=False)
    assert tok.convert_tokens_to_ids("Ġthe") in ids  # " the" is one merged token
    deltas, stopped, fed = run(tok, ids, stop=["he"])
    assert stopped
    assert "".join(deltas) == "say t"
    assert tok.decode(ids[:fed]).endswith(" the")


def test_first_stop_string_to_appear_wins(tok):
    deltas, stopped, _ = run(tok, byte_tokens(tok, "a b c"), stop=["c", "b"])
    assert stopped
    assert "".join(deltas) == "a "


def test_context_gives_no_text_of_its_own(tok):
    context = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    detok = Detokenizer(tok, context=context)
    ids = tok.encode("the end", add_special_tokens=False)
    assert "".join(detok.feed([t]).text for t in ids) == "the end"


def test_empty_stop_string_is_refused(tok):
    with pytest.raises(ValueError, match="empty"):
        Detokenizer(tok, stop=[""])


def test_feeding_after_a_stop_is_refused(tok):
    detok = Detokenizer(tok, stop=["a"])
    assert detok.feed([tok.convert_tokens_to_ids("a")]).stopped
    with pytest.raises(ValueError, match="already matched"):
        detok.feed([tok.convert_tokens_to_ids("b")])


@pytest.mark.parametrize(
    ("text", "patterns", "held"),
    [("abc", ["cd"], 1), ("abc", ["bcd", "cd"], 2), ("abc", ["abc"], 0), ("", ["a"], 0)],
)
def test_partial_suffix_len(text, patterns, held):
    assert partial_suffix_len(text, patterns) == held


@HYPOTHESIS
@given(ids=st.lists(st.integers(0, 511), max_size=40))
def test_deltas_add_up_to_the_decoded_text(tok, ids):
    deltas, stopped, _ = run(tok, ids)
    assert not stopped
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=True)


@HYPOTHESIS
@given(
    text=st.text(alphabet="ab é日", max_size=30),
    stop=st.lists(st.text(alphabet="ab é日", min_size=1, max_size=3), min_size=1, max_size=3),
    merged=st.booleans(),
)
def test_stop_strings_cut_at_their_first_appearance(tok, text, stop, merged):
    ids = tok.encode(text, add_special_tokens=False) if merged else byte_tokens(tok, text)
    deltas, stopped, fed = run(tok, ids, stop)
    returned = "".join(deltas)
    assert text.startswith(returned)
    assert not any(s in returned for s in stop)
    assert all(REPLACEMENT not in d for d in deltas)
    if stopped:
        assert text[len(returned) :].startswith(tuple(stop))
        # the token fed last completed a stop string; without it there was none
        assert any(s in tok.decode(ids[:fed]) for s in stop)
        assert not any(s in tok.decode(ids[: fed - 1]) for s in stop)
    else:
        assert returned == text
        assert not any(s in text for s in stop)


def chunked(ids: list[int], cuts: list[int]) -> list[list[int]]:
    """``ids`` in chunks ending at ``cuts`` (positions, any order, out of range ignored)."""
    ends = sorted({c for c in cuts if 0 < c < len(ids)} | {len(ids)})
    return [ids[start:end] for start, end in pairwise([0, *ends]) if end > start]  # none if empty


@HYPOTHESIS
@given(
    text=st.text(alphabet="ab é日", max_size=30),
    stop=st.lists(st.text(alphabet="ab é日", min_size=1, max_size=3), max_size=2),
    merged=st.booleans(),
    cuts=st.lists(st.integers(0, 60), max_size=8),
)
def test_a_chunk_fed_whole_gives_what_its_tokens_give_one_at_a_time(tok, text, stop, merged, cuts):
    """What the gateway feeds: a worker's chunk of several tokens. The text, where it stops and
    the tokens taken are those of feeding the same tokens one by one; no delta splits a
    character."""
    ids = tok.encode(text, add_special_tokens=False) if merged else byte_tokens(tok, text)
    one_by_one, stopped, fed = run(tok, ids, stop)
    detok = Detokenizer(tok, stop)
    deltas, taken = [], 0
    for chunk in chunked(ids, cuts):
        delta = detok.feed(chunk)
        deltas.append(delta.text)
        taken += delta.taken
        if delta.stopped:
            assert delta.taken <= len(chunk)
            break
        assert delta.taken == len(chunk)
    else:
        deltas.append(detok.finish())
    assert "".join(deltas) == "".join(one_by_one)
    assert (detok.stopped, taken) == (stopped, fed)
    assert all(REPLACEMENT not in d for d in deltas)


def test_a_chunk_ending_inside_a_character_is_held_until_it_is_complete(tok):
    ids = byte_tokens(tok, "ab日")
    detok = Detokenizer(tok)
    assert detok.feed(ids[:-1]).text == ""  # "ab" and two of 日's three bytes
    assert detok.feed(ids[-1:]).text == "ab日"
