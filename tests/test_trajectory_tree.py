"""The trajectory tree (pure core): concrete agent shapes, then properties over random sessions
checked against a direct reference (labels by first writer, per distinct prefix)."""

import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from broker.messages import Admitted, CallRecorded, FinishReason, SessionEnded
from broker.subjects import NAME_PATTERN
from trajectory.tree import ENV, Leaf, SessionTree, build_session, sample_id


def call(
    call_id: str,
    prompt: list[int],
    output: list[int] = (),
    version: int | list[int] = 0,
    logprobs: list[float] | None = None,
    session_id: str = "s1",
) -> CallRecorded:
    output = list(output)
    versions = version if isinstance(version, list) else [version] * len(output)
    return CallRecorded(
        session_id=session_id,
        call_id=call_id,
        model="tiny",
        prompt_ids=prompt,
        output_ids=output,
        output_logprobs=logprobs if logprobs is not None else [-0.5] * len(output),
        output_versions=versions,
        finish_reason=FinishReason.STOP,
        started_at=1.0,
        finished_at=2.0,
    )


END = SessionEnded(session_id="s1", reward=1.0, task_id="t1", group_size=4)


def masked(sample) -> list[int]:
    return [t for t, m in zip(sample.token_ids, sample.loss_mask, strict=True) if m]


# -- concrete shapes ----------------------------------------------------------------------------


def test_multi_turn_append_is_one_sample_with_every_turn_trained():
    system, user1, user2 = [1, 2, 3], [4, 5], [6]
    calls = [
        call("c1", system + user1, [10, 11], logprobs=[-0.1, -0.2]),
        # The agent echoes the first answer, adds a user turn: the context extends.
        call("c2", [*system, *user1, 10, 11, *user2], [12], logprobs=[-0.3]),
    ]
    built = build_session(calls, END)
    (sample,) = built.samples
    assert sample.token_ids == [*system, *user1, 10, 11, *user2, 12]
    assert sample.loss_mask == [0, 0, 0, 0, 0, 1, 1, 0, 1]
    assert sample.logprobs == [0, 0, 0, 0, 0, -0.1, -0.2, 0, -0.3]
    assert sample.versions == [-1, -1, -1, -1, -1, 0, 0, -1, 0]
    assert built.stored_tokens == 9 and built.shared_tokens == 7
    assert (sample.group_id, sample.task_id, sample.group_size) == ("t1", "t1", 4)
    assert (sample.session_samples, sample.reward, sample.on_policy) == (1, 1.0, True)


def test_edit_forks_at_the_divergence_and_trains_the_shared_answer_once():
    calls = [
        call("c1", [1, 2, 3], [10, 11]),
        call("c2", [1, 2, 3, 10, 11, 4], [12]),
        # The agent edits its history after the first answer: a branch from there.
        call("c3", [1, 2, 3, 10, 11, 5, 6], [13, 14]),
    ]
    built = build_session(calls, END)
    first, second = built.samples
    assert first.token_ids == [1, 2, 3, 10, 11, 4, 12]
    assert second.token_ids == [1, 2, 3, 10, 11, 5, 6, 13, 14]
    assert masked(first) == [10, 11, 12]
    assert masked(second) == [13, 14]  # 10, 11 are context here: owned by the first leaf
    assert built.stored_tokens == 11
    assert [s.session_samples for s in built.samples] == [2, 2]
    assert first.sample_id != second.sample_id


def test_two_sub_agents_with_different_prompts_are_separate_paths():
    calls = [
        call("a1", [7, 7, 1], [20]),
        call("b1", [8, 8, 1], [21]),
        call("a2", [7, 7, 1, 20, 2], [22]),
        call("b2", [8, 8, 1, 21, 2], [23]),
    ]
    built = build_session(calls, END)
    assert [s.token_ids for s in built.samples] == [[7, 7, 1, 20, 2, 22], [8, 8, 1, 21, 2, 23]]
    assert [masked(s) for s in built.samples] == [[20, 22], [21, 23]]


def test_echoed_generated_tokens_keep_their_label_and_new_prompt_tokens_are_env():
    tree = SessionTree()
    tree.insert([1, 2], [30, 31, 32], [-1.0, -2.0, -3.0], [4, 4, 5])
    # The next prompt echoes the answer (same ids) and adds tool output.
    tree.insert([1, 2, 30, 31, 32, 40, 41], [33], [-4.0], [5])
    (leaf,) = tree.leaves()
    assert leaf.versions == (ENV, ENV, 4, 4, 5, ENV, ENV, 5)
    assert leaf.logprobs == (0.0, 0.0, -1.0, -2.0, -3.0, 0.0, 0.0, -4.0)
    assert leaf.loss_mask == (0, 0, 1, 1, 1, 0, 0, 1)


def test_generated_token_on_an_env_token_keeps_the_first_label_and_is_counted():
    tree = SessionTree()
    tree.insert([1, 2, 3])
    shared = tree.insert([1, 2], [3, 4], [-0.5, -0.6], [0, 0])
    assert (shared.new_tokens, shared.shared_tokens, shared.generated_shared) == (1, 3, 1)
    (leaf,) = tree.leaves()
    assert leaf.loss_mask == (0, 0, 0, 1)  # 3 stays environment: its first writer was a prompt


def test_on_policy_only_when_all_loss_tokens_share_a_version():
    calls = [
        call("c1", [1], [10, 11], version=[3, 3]),
        # Continued across a weight update: versions 3 then 4.
        call("c2", [2], [12, 13], version=[3, 4]),
    ]
    on, off = build_session(calls, END).samples
    assert on.on_policy and not off.on_policy
    assert off.versions == [-1, 3, 4]


def test_leaf_without_loss_tokens_is_skipped_and_not_counted_in_session_samples():
    calls = [
        call("c1", [1, 2], [10]),
        call("c2", [1, 2, 10, 11], [12]),
        call("c3", [1, 2, 10, 5]),  # no output: all context, and 10 belongs to the first leaf
    ]
    built = build_session(calls, END)
    assert built.skipped_samples == 1
    (sample,) = built.samples
    assert sample.token_ids == [1, 2, 10, 11, 12] and sample.session_samples == 1


def test_duplicate_call_ids_count_once_and_an_empty_session_has_no_samples():
    built = build_session([call("c1", [1], [2]), call("c1", [1], [3])], END)
    assert (built.calls, built.duplicate_calls, len(built.samples)) == (1, 1, 1)
    assert built.samples[0].token_ids == [1, 2]
    empty = build_session([], END)
    assert (empty.calls, empty.samples, empty.stored_tokens) == (0, (), 0)


def test_group_id_falls_back_to_task_then_session():
    calls = [call("c1", [1], [2])]
    given_group = END.model_copy(update={"group_id": "g"})
    no_task = SessionEnded(session_id="s1", reward=0.0)
    assert build_session(calls, given_group).samples[0].group_id == "g"
    assert build_session(calls, END).samples[0].group_id == "t1"
    assert build_session(calls, no_task).samples[0].group_id == "s1"


def test_samples_carry_their_tasks_admission_stamp():
    calls = [call("c1", [1], [2]), call("c2", [1], [3])]  # two leaves
    stamp = Admitted(ticket=7, version=3)
    stamped = END.model_copy(update={"admitted": stamp})
    assert [s.admitted for s in build_session(calls, stamped).samples] == [stamp, stamp]
    assert build_session(calls, END).samples[0].admitted is None


def test_sample_id_is_a_short_valid_id():
    ids = {sample_id("x" * 64, n) for n in range(1000)}
    assert len(ids) == 1000
    assert all(re.fullmatch(NAME_PATTERN, i) for i in ids)


def test_mismatched_output_labels_are_refused():
    with pytest.raises(ValueError, match="one output logprob"):
        SessionTree().insert([1], [2, 3], [-0.1], [0, 0])


# -- properties over random sessions -------------------------------------------------------------

TOKENS = st.integers(0, 3)  # a small vocabulary, so paths collide often


@st.composite
def sessions(draw) -> list[CallRecorded]:
    """Random agent sessions: new root prompts, extended contexts, forks from an earlier point,
    repeats of a call (new id) and re-sent call ids with other content."""
    calls: list[CallRecorded] = []
    for n in range(draw(st.integers(0, 12))):
        paths = [c.prompt_ids + c.output_ids for c in calls]
        kind = draw(st.sampled_from(["root", "extend", "fork", "repeat", "dup_id"]))
        if not calls:
            kind = "root"
        call_id = f"c{n}"
        if kind == "root":
            prompt = draw(st.lists(TOKENS, min_size=1, max_size=5))
        elif kind == "extend":
            prompt = draw(st.sampled_from(paths)) + draw(st.lists(TOKENS, max_size=3))
        elif kind == "fork":
            base = draw(st.sampled_from(paths))
            cut = draw(st.integers(1, len(base)))
            prompt = base[:cut] + draw(st.lists(TOKENS, max_size=3))
        else:
            previous = draw(st.sampled_from(calls))
            if kind == "repeat":
                calls.append(previous.model_copy(update={"call_id": call_id}))
                continue
            call_id, prompt = previous.call_id, draw(st.lists(TOKENS, min_size=1, max_size=5))
        size = draw(st.integers(0, 4))
        output = draw(st.lists(TOKENS, min_size=size, max_size=size))
        versions = draw(st.lists(st.integers(0, 2), min_size=size, max_size=size))
        logprobs = [-(n + j / 10) - 0.01 for j in range(size)]  # unique per token
        calls.append(call(call_id, prompt, output, versions, logprobs))
    return calls


def reference_labels(calls: list[CallRecorded]) -> dict[tuple[int, ...], tuple[float, int]]:
    """Every distinct prefix position -> (logprob, version) of the first call that wrote it."""
    labels: dict[tuple[int, ...], tuple[float, int]] = {}
    seen: set[str] = set()
    for c in calls:
        if c.call_id in seen:
            continue
        seen.add(c.call_id)
        path = c.prompt_ids + c.output_ids
        own = [(0.0, ENV)] * len(c.prompt_ids) + list(
            zip(c.output_logprobs, c.output_versions, strict=True)
        )
        for j in range(len(path)):
            labels.setdefault(tuple(path[: j + 1]), own[j])
    return labels


def leaf_prefixes(labels: dict[tuple[int, ...], tuple[float, int]]) -> set[tuple[int, ...]]:
    """The prefixes no other prefix extends: the root-to-leaf paths."""
    return {p for p in labels if not any((*p, t) in labels for t in range(4))}


def tree_of(calls: list[CallRecorded]) -> tuple[SessionTree, list[Leaf]]:
    tree, seen = SessionTree(), set()
    for c in calls:
        if c.call_id not in seen:
            seen.add(c.call_id)
            tree.insert(c.prompt_ids, c.output_ids, c.output_logprobs, c.output_versions)
    return tree, list(tree.leaves())


@settings(max_examples=200, deadline=None)
@given(sessions())
def test_tree_matches_the_reference(calls):
    labels = reference_labels(calls)
    tree, leaves = tree_of(calls)
    # Shared prefixes are stored once: one stored token per distinct prefix position.
    assert tree.stored_tokens == len(labels)
    # A radix trie: no node (but the root) has exactly one child.
    assert 1 not in tree.node_children()
    # Leaves are exactly the maximal prefixes, and each carries the reference labels.
    maximal = leaf_prefixes(labels)
    assert {leaf.token_ids for leaf in leaves} == maximal
    assert len(leaves) == len(maximal)
    # Every call's path (the first call of each id) is a prefix of some leaf.
    for c in {c.call_id: c for c in reversed(calls)}.values():
        path = tuple(c.prompt_ids + c.output_ids)
        assert any(leaf.token_ids[: len(path)] == path for leaf in leaves)


@settings(max_examples=200, deadline=None)
@given(sessions())
def test_every_generated_token_is_trained_exactly_once(calls):
    labels = reference_labels(calls)
    maximal = leaf_prefixes(labels)
    built = build_session(calls, END)
    trained: dict[tuple[int, ...], list[tuple[float, int]]] = {}
    for s in built.samples:
        assert tuple(s.token_ids) in maximal  # a root-to-leaf path
        assert any(s.loss_mask)  # samples without loss tokens are not emitted
        loss_versions = {v for v, m in zip(s.versions, s.loss_mask, strict=True) if m}
        assert s.on_policy == (len(loss_versions) == 1)
        for j, m in enumerate(s.loss_mask):
            if m:
                trained.setdefault(tuple(s.token_ids[: j + 1]), []).append(
                    (s.logprobs[j], s.versions[j])
                )
            else:
                assert (s.logprobs[j], s.versions[j]) == (0.0, ENV)
    generated = {p: label for p, label in labels.items() if label[1] != ENV}
    # Each generated token once, with its logprob and version; no environment token trained.
    assert trained == {p: [label] for p, label in generated.items()}
    assert built.loss_tokens == len(generated)
    assert all(s.session_samples == len(built.samples) for s in built.samples)


@settings(max_examples=100, deadline=None)
@given(sessions())
def test_sample_ids_are_deterministic_and_unique(calls):
    first = build_session(calls, END)
    again = build_session([c.model_copy() for c in calls], END)
    ids = [s.sample_id for s in first.samples]
    assert ids == [s.sample_id for s in again.samples]
    assert len(set(ids)) == len(ids)
    other = build_session(calls, END.model_copy(update={"session_id": "s2"}))
    assert not set(ids) & {s.sample_id for s in other.samples}
