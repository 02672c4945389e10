"""Token fidelity of prompts across a session's turns, with the tiny model's tokenizer and chat
template: an echoed assistant message keeps the ids the model generated."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rollout.exceptions import InvalidRequestError
from rollout.gateway.prompts import Prompt, SessionStore, echoed_turn, render_chat

HYPOTHESIS = settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def tokenize(tok):
    return lambda text: tok.encode(text, add_special_tokens=False)


def chars(tok, text: str) -> list[int]:
    """One token per (ASCII) character, as a model emitting unmerged tokens produces."""
    ids = [tok.encode(c, add_special_tokens=False) for c in text]
    assert all(len(i) == 1 for i in ids)
    return [i[0] for i in ids]


def generated(tok, text: str) -> tuple[str, list[int]]:
    """A model output of ``text`` byte by byte, then eos: (its text with specials, its ids)."""
    ids = [*chars(tok, text), tok.eos_token_id]
    return tok.decode(ids, skip_special_tokens=False), ids


def render(tok, messages, **kwargs) -> str:
    return render_chat(tok, messages, **kwargs)


def test_echoed_assistant_message_keeps_the_generated_ids(tok):
    store = SessionStore()
    turn1 = [{"role": "user", "content": "Say it."}]
    prompt1 = store.build("s", render(tok, turn1), tokenize(tok))
    assert prompt1.reused == 0
    # The model emitted "the" as three single-byte tokens; "the" re-tokenizes to one merged token.
    out_text, out_ids = generated(tok, "the")
    merged = tok.encode("the", add_special_tokens=False)
    assert merged == [tok.convert_tokens_to_ids("the")] and len(out_ids) == 4
    store.record("s", prompt1, out_text, out_ids)

    turn2 = [*turn1, {"role": "assistant", "content": "the"}, {"role": "user", "content": "More."}]
    text2 = render(tok, turn2)
    prompt2 = store.build("s", text2, tokenize(tok))

    assert prompt2.ids[: len(prompt1.ids) + len(out_ids)] == prompt1.ids + out_ids
    assert prompt2.reused == len(prompt1.ids) + len(out_ids)
    assert prompt2.ids != tokenize(tok)(text2)  # plain re-tokenization would merge "the"
    assert tok.decode(prompt2.ids, skip_special_tokens=False) == text2


def test_without_a_stored_turn_the_whole_text_is_tokenized(tok):
    store = SessionStore()
    text = render(tok, [{"role": "user", "content": "the then there"}])
    prompt = store.build("fresh", text, tokenize(tok))
    assert prompt == Prompt(ids=tokenize(tok)(text), text=text, reused=0)


def test_sessions_do_not_share_turns(tok):
    store = SessionStore()
    turn1 = [{"role": "user", "content": "Say it."}]
    prompt1 = store.build("a", render(tok, turn1), tokenize(tok))
    store.record("a", prompt1, *generated(tok, "the"))
    text2 = render(tok, [*turn1, {"role": "assistant", "content": "the"}])
    assert store.build("b", text2, tokenize(tok)).reused == 0
    assert store.build("a", text2, tokenize(tok)).reused > 0


def test_an_edited_echo_still_reuses_the_prompt(tok):
    """When the agent changes the assistant text (a stop string cut it, or it edits), the
    earlier prompt still matches; only the new text is tokenized."""
    store = SessionStore()
    turn1 = [{"role": "user", "content": "Say it."}]
    prompt1 = store.build("s", render(tok, turn1), tokenize(tok))
    store.record("s", prompt1, *generated(tok, "the end"))
    text2 = render(tok, [*turn1, {"role": "assistant", "content": "the"}])
    prompt2 = store.build("s", text2, tokenize(tok))
    assert prompt2.reused == len(prompt1.ids)
    assert prompt2.ids == prompt1.ids + tokenize(tok)(text2[len(prompt1.text) :])


def test_longest_turn_wins_and_each_sibling_keeps_its_own_ids(tok):
    """n=2: two outputs of one prompt; whichever the agent continues with is reused."""
    store = SessionStore()
    turn1 = [{"role": "user", "content": "Pick."}]
    prompt1 = store.build("s", render(tok, turn1), tokenize(tok))
    for answer in ("the", "these"):
        store.record("s", prompt1, *generated(tok, answer))
    for answer in ("the", "these"):
        text = render(tok, [*turn1, {"role": "assistant", "content": answer}])
        prompt = store.build("s", text, tokenize(tok))
        assert prompt.ids[: prompt.reused] == prompt1.ids + generated(tok, answer)[1]


def test_three_turns_chain(tok):
    store = SessionStore()
    messages = [{"role": "system", "content": "Be brief."}]
    expected_prefix: list[int] = []
    for i, answer in enumerate(["the", "then", "there"]):
        messages.append({"role": "user", "content": f"question {i}"})
        prompt = store.build("s", render(tok, messages), tokenize(tok))
        assert prompt.ids[: len(expected_prefix)] == expected_prefix
        assert prompt.reused == len(expected_prefix)
        out_text, out_ids = generated(tok, answer)
        store.record("s", prompt, out_text, out_ids)
        expected_prefix = prompt.ids + out_ids
        messages.append({"role": "assistant", "content": answer})


def test_prompts_sent_as_ids_are_not_stored(tok):
    store = SessionStore()
    store.record("s", Prompt(ids=[1, 2, 3]), "abc", [4])
    assert len(store) == 0 and store.tokens == 0


def test_output_ids_without_text_are_not_a_boundary(tok):
    store = SessionStore()
    text = render(tok, [{"role": "user", "content": "x"}])
    prompt = store.build("s", text, tokenize(tok))
    store.record("s", prompt, "", [5])
    assert store.tokens == len(prompt.ids)
    assert store.build("s", text + "y", tokenize(tok)).reused == len(prompt.ids)


def test_recording_the_same_turn_twice_stores_it_once(tok):
    store = SessionStore()
    prompt = store.build("s", render(tok, [{"role": "user", "content": "x"}]), tokenize(tok))
    out = generated(tok, "the")
    store.record("s", prompt, *out)
    stored = store.tokens
    store.record("s", prompt, *out)
    assert store.tokens == stored == len(prompt.ids) + len(out[1])


def test_least_recently_used_sessions_are_evicted(tok):
    store = SessionStore(max_sessions=2)
    prompts = {}
    for session in ("a", "b"):
        text = render(tok, [{"role": "user", "content": session}])
        prompts[session] = store.build(session, text, tokenize(tok))
        store.record(session, prompts[session], *generated(tok, "the"))
    store.build("a", prompts["a"].text, tokenize(tok))  # "a" is now the most recent
    text = render(tok, [{"role": "user", "content": "c"}])
    store.record("c", store.build("c", text, tokenize(tok)), *generated(tok, "the"))
    assert len(store) == 2
    assert store.build("b", prompts["b"].text, tokenize(tok)).reused == 0
    assert store.build("a", prompts["a"].text, tokenize(tok)).reused == len(prompts["a"].ids)


def test_token_budget_evicts_old_sessions_and_drops_one_too_large(tok):
    text = render(tok, [{"role": "user", "content": "hello"}])
    size = len(tokenize(tok)(text)) + 4
    store = SessionStore(max_tokens=2 * size)
    for session in ("a", "b", "c"):
        store.record(session, store.build(session, text, tokenize(tok)), *generated(tok, "the"))
    assert len(store) == 2 and store.tokens == 2 * size
    tiny = SessionStore(max_tokens=size - 1)
    tiny.record("a", tiny.build("a", text, tokenize(tok)), *generated(tok, "the"))
    assert len(tiny) == 0 and tiny.tokens == 0


def test_template_errors_are_invalid_requests(tok):
    with pytest.raises(InvalidRequestError, match="chat template") as err:
        render(tok, [{"role": "assistant", "tool_calls": [5]}])
    assert err.value.param == "messages"


def test_tools_are_rendered_by_the_template(tok):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    text = render(tok, [{"role": "user", "content": "1+1"}], tools=tools)
    assert '"name": "add"' in text and text.endswith("<|im_start|>assistant\n")


words = st.text(alphabet="the nrwo.?", min_size=1, max_size=12)


@HYPOTHESIS
@given(turns=st.lists(st.tuples(words, words), min_size=1, max_size=4), session=st.uuids())
def test_every_turn_reuses_the_whole_previous_turn(tok, turns, session):
    """Whatever the texts, each prompt starts with the previous prompt and output ids exactly,
    and the ids always spell the rendered text."""
    store = SessionStore()
    messages: list[dict] = []
    previous: list[int] = []
    for user, answer in turns:
        messages.append({"role": "user", "content": user})
        text = render(tok, messages)
        prompt = store.build(session.hex, text, tokenize(tok))
        assert prompt.ids[: len(previous)] == previous
        assert tok.decode(prompt.ids, skip_special_tokens=False) == text
        out_text, out_ids = generated(tok, answer)
        store.record(session.hex, prompt, out_text, out_ids)
        previous = prompt.ids + out_ids
        messages.append({"role": "assistant", "content": answer})


# -- the turn a chat client echoes ----------------------------------------------------------


def echo(tok, messages, reply: dict, output_ids: list[int]) -> tuple[str, list[int]] | None:
    """The stored turn for ``reply`` (the message the client was given) after ``messages``."""
    prompt_text = render(tok, messages)
    rendered = render(tok, [*messages, reply], generation_prompt=False)
    return echoed_turn(prompt_text, rendered, output_ids, {"<|im_end|>": tok.eos_token_id})


ASK = [{"role": "user", "content": "Say it."}]


def test_the_echoed_turn_is_the_text_the_client_was_given(tok):
    special = tok.convert_tokens_to_ids("<|endoftext|>")
    # "the", <|endoftext|>, " end" and a stop string "!!" the client never saw, cut by length
    output = [*chars(tok, "the"), special, *chars(tok, " end!!")]
    text, ids = echo(tok, ASK, {"role": "assistant", "content": "the end"}, output)
    assert (text, ids) == ("the end<|im_end|>", [*output, tok.eos_token_id])
    # ended by eos: the marker is the output's own
    text, ids = echo(tok, ASK, {"role": "assistant", "content": "the"}, [*output, tok.eos_token_id])
    assert (text, ids) == ("the<|im_end|>", [*output, tok.eos_token_id])


def test_an_echoed_tool_call_reads_as_the_template_writes_it(tok):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"x":1}'},
    }
    reply = {"role": "assistant", "content": None, "tool_calls": [call]}
    text, ids = echo(tok, ASK, reply, [5, 6, tok.eos_token_id])
    assert text == '<tool_call>{"name": "f", "arguments": {"x":1}}</tool_call><|im_end|>'
    assert ids == [5, 6, tok.eos_token_id]


def test_an_echo_that_does_not_extend_the_prompt_is_not_a_turn(tok):
    prompt_text = render(tok, ASK)
    reply = render(tok, [*ASK, {"role": "assistant", "content": "x"}], generation_prompt=False)
    assert echoed_turn("other " + prompt_text, reply, [5], {"<|im_end|>": 2}) is None
    assert echoed_turn(prompt_text, reply, [5], {"<|eot|>": 9}) is None  # no end marker
