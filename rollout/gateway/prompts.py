"""Prompt token ids that keep token fidelity across the turns of a session.

Pure core (no NATS). Agents send text; the engine generated token ids. Re-tokenizing an echoed
assistant message can give other ids than the ones generated (a BPE tokenizer merges bytes the
model emitted one by one), and training on ids the model never produced breaks PPO. So the
gateway remembers, per session, every turn it served and builds new prompts on top of them:

- a turn is (prompt text, prompt ids, output text, output ids), where the output text is exactly
  what an echo of the output the client was given renders to after the prompt (``echoed_turn``),
  and the output ids are the ids generated, whatever that text leaves out (special tokens, a stop
  string, bytes that are not valid UTF-8, the form of a tool call);
- for a new rendered prompt, the longest stored boundary (a turn's prompt end, or its prompt +
  output end) whose text is a prefix of the new text is found, and the prompt ids are that
  boundary's ids followed by the tokenization of the rest of the text (no special tokens added);
  with no match the whole text is tokenized.

Each session's turns are stored as a trie of text segments with their ids, so a long session
costs memory linear in its text, not quadratic. Sessions are kept in LRU order within a budget
of sessions and stored tokens.
"""

from array import array
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rollout.exceptions import InvalidRequestError

Tokenize = Callable[[str], list[int]]
"""Text to ids with no special tokens added (special-token text in it becomes those tokens)."""


@dataclass(frozen=True)
class Prompt:
    """The ids a call is generated from; ``text`` is None when the client sent ids."""

    ids: list[int]
    text: str | None = None
    reused: int = 0
    """How many leading ids came from stored turns instead of tokenizing."""


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    generation_prompt: bool = True,
    template: str | None = None,
) -> str:
    """The chat template (``template``, else the model's) applied to ``messages`` (with
    ``tools`` and ``tool_choice`` passed to the template), ending with the generation prompt
    unless ``generation_prompt`` is False."""
    extra: dict[str, Any] = {} if tool_choice is None else {"tool_choice": tool_choice}
    if template is not None:
        extra["chat_template"] = template
    try:
        return tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=generation_prompt,
            tokenize=False,
            **extra,
        )
    except Exception as exc:  # jinja raises TemplateError and anything a template's code raises
        raise InvalidRequestError(
            f"the chat template cannot render these messages: {type(exc).__name__}: {exc}",
            param="messages",
        ) from exc


def echoed_turn(
    prompt_text: str,
    rendered: str,
    output_ids: Sequence[int],
    end_markers: Mapping[str, int],
) -> tuple[str, list[int]] | None:
    """The assistant turn a chat client echoes, as a stored output: (its text after the prompt,
    up to and including the template's end-of-turn marker; the ids that text stands for).

    ``rendered`` is the conversation of ``prompt_text`` with the assistant message the client
    was given appended, rendered without a generation prompt; ``end_markers`` maps the text of
    each stop token to its id. The ids are the output ids, which end with the marker's id when
    generation stopped on it; else (cut by length or a stop string, or stopped on another stop
    token) the marker's id is added, as an echo renders it. The text before the marker is
    whatever the template makes of the message, so special tokens and stop strings the client
    never saw, bytes shown as U+FFFD and tool calls in the template's own form all map to the
    ids generated. None when the rendering does not extend the prompt or has no marker."""
    if not rendered.startswith(prompt_text):
        return None
    turn = rendered[len(prompt_text) :]
    ends = [(turn.rfind(m) + len(m), m) for m in end_markers if m and m in turn]
    if not ends:
        return None
    end, marker = max(ends)
    ids = list(output_ids)
    if not ids or ids[-1] != end_markers[marker]:
        ids.append(end_markers[marker])
    return turn[:end], ids


@dataclass(eq=False)
class _Node:
    """A text segment and its ids; the path from the root to a node is a stored boundary."""

    text: str
    ids: array
    children: list["_Node"] = field(default_factory=list)


@dataclass(eq=False)
class _Session:
    root: _Node = field(default_factory=lambda: _Node("", array("q")))
    tokens: int = 0


class SessionStore:
    """Per-session turn tries, LRU-bounded by ``max_sessions`` and ``max_tokens`` (ids stored
    over all sessions; a session alone over it is dropped)."""

    def __init__(self, max_sessions: int = 4096, max_tokens: int = 16_000_000) -> None:
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self._sessions: OrderedDict[str, _Session] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def tokens(self) -> int:
        return self._tokens

    def build(self, session_id: str, text: str, tokenize: Tokenize) -> Prompt:
        """The prompt ids of ``text``: the longest stored prefix's ids + the rest tokenized."""
        session = self._sessions.get(session_id)
        reused: list[int] = []
        matched = 0
        if session is not None:
            self._sessions.move_to_end(session_id)
            matched, path = _longest_prefix(session.root, text)
            for node in path:
                reused.extend(node.ids)
        rest = text[matched:]
        ids = reused + (tokenize(rest) if rest else [])
        return Prompt(ids=ids, text=text, reused=len(reused))

    def record(
        self,
        session_id: str,
        prompt: Prompt,
        output_text: str,
        output_ids: Sequence[int],
        after: str | None = None,
    ) -> None:
        """Remember a served turn: its prompt, and ``output_text`` after ``after`` (default: the
        prompt text) standing for the prompt ids + ``output_ids``. ``after`` is shorter when the
        prompt ends with text the echo renders its own way (a forced tool call's start: the
        echo may put content before the call). Prompts sent as ids (no text) are not stored."""
        if prompt.text is None or not prompt.ids:
            return
        session = self._sessions.get(session_id)
        if session is None:
            session = self._sessions[session_id] = _Session()
        self._sessions.move_to_end(session_id)
        added = _insert(session.root, [(prompt.text, prompt.ids)])
        if output_text and output_ids:  # ids with no text would match any text: not a boundary
            base = prompt.text if after is None else after
            added += _insert(session.root, [(base + output_text, [*prompt.ids, *output_ids])])
        session.tokens += added
        self._tokens += added
        self._evict()

    def _evict(self) -> None:
        # The session just used is the newest: it goes last, only if it alone is over budget.
        while len(self._sessions) > self.max_sessions or self._tokens > self.max_tokens:
            _, session = self._sessions.popitem(last=False)
            self._tokens -= session.tokens


def _longest_prefix(root: _Node, text: str) -> tuple[int, list[_Node]]:
    """The deepest node whose path text is a prefix of ``text``: (its text length, the path)."""
    best_len, best_path = 0, []
    stack: list[tuple[_Node, int, list[_Node]]] = [(root, 0, [])]
    while stack:
        node, pos, path = stack.pop()
        if pos > best_len:
            best_len, best_path = pos, path
        for child in node.children:
            if text.startswith(child.text, pos):
                stack.append((child, pos + len(child.text), [*path, child]))
    return best_len, best_path


def _insert(root: _Node, boundaries: list[tuple[str, Sequence[int]]]) -> int:
    """Make each (text, ids) boundary a path from the root, reusing nodes whose text and ids
    agree; return how many ids were newly stored."""
    added = 0
    node, pos, ipos = root, 0, 0
    for text, id_list in boundaries:
        ids = array("q", id_list)
        while pos < len(text) or ipos < len(ids):
            child = _descend(node, text, ids, pos, ipos)
            if child is None:
                if pos == len(text) or ipos == len(ids):
                    return added  # text without ids or ids without text: not a boundary
                child = _Node(text[pos:], ids[ipos:])
                node.children.append(child)
                added += len(child.ids)
            node, pos, ipos = child, pos + len(child.text), ipos + len(child.ids)
    return added


def _descend(node: _Node, text: str, ids: array, pos: int, ipos: int) -> _Node | None:
    """A child of ``node`` that continues (text, ids) from (pos, ipos) and ends, in both, before
    or at their ends, reaching the text end exactly when it reaches the ids end."""
    for child in node.children:
        end, iend = pos + len(child.text), ipos + len(child.ids)
        if (
            end <= len(text)
            and iend <= len(ids)
            and (end == len(text)) == (iend == len(ids))
            and text.startswith(child.text, pos)
            and ids[ipos:iend] == child.ids
        ):
            return child
    return None
