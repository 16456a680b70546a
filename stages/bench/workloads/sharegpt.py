"""ShareGPT-format conversations: a JSON list of ``{"conversations": [{"from": "human" |
"gpt", "value": "..."}]}`` (``"id"`` optional). Only the human turns are replayed; the bench
answers them with the server's own replies. A leading ``"system"`` turn is the system prompt.
"""

from __future__ import annotations

from pathlib import Path

import orjson

from stages.bench.workloads.conversations import Conversation
from stages.errors import EldrError

USER_ROLES = ("human", "user")
ASSISTANT_ROLES = ("gpt", "assistant", "chatgpt", "bard", "bing", "model")


def load_sharegpt(path: Path, min_turns: int = 1) -> list[Conversation]:
    """Every conversation with at least ``min_turns`` human turns; a malformed entry is an
    error naming its index."""
    path = Path(path)
    if not path.is_file():
        raise EldrError(f"ShareGPT file {path} does not exist")
    try:
        doc = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as exc:
        raise EldrError(f"{path} is not JSON: {exc}") from exc
    if not isinstance(doc, list):
        raise EldrError(f"{path}: expected a JSON list of conversations, got"
                        f" {type(doc).__name__}")
    out = []
    for i, entry in enumerate(doc):
        conversation = _conversation(entry, f"{path}[{i}]", i)
        if len(conversation.user_messages) >= min_turns:
            out.append(conversation)
    if not out:
        raise EldrError(f"{path} holds no conversation with {min_turns} or more human turns")
    return out


def _conversation(entry: object, where: str, index: int) -> Conversation:
    if not isinstance(entry, dict) or not isinstance(entry.get("conversations"), list):
        raise EldrError(f"{where}: expected an object with a 'conversations' list")
    system, users = "", []
    for j, turn in enumerate(entry["conversations"]):
        if not (isinstance(turn, dict) and isinstance(turn.get("from"), str)
                and isinstance(turn.get("value"), str)):
            raise EldrError(f"{where}.conversations[{j}]: expected {{'from': str, 'value':"
                            " str}}")
        role = turn["from"].lower()
        if role in USER_ROLES:
            if turn["value"]:
                users.append(turn["value"])
        elif role == "system" and not users:
            system = turn["value"]
        elif role not in ASSISTANT_ROLES:
            raise EldrError(f"{where}.conversations[{j}]: unknown speaker {turn['from']!r}"
                            f" (expected one of {', '.join(USER_ROLES + ASSISTANT_ROLES)},"
                            " system)")
    ident = entry.get("id")
    return Conversation(str(ident) if ident is not None else f"sharegpt-{index}", system,
                        tuple(users))
