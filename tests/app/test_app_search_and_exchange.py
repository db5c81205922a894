"""The sidebar's search finds a word from an old reply, in any conversation and branch, and opens
it on that branch; File › export and import round-trip a conversation through a file."""

from __future__ import annotations

import json

from app.chat.conversations import ConversationStore
from app.paths import conversations_db_path


def seed(store: ConversationStore) -> tuple[int, int, int]:
    """An old conversation whose second (not shown) reply mentions glaciers, and a newer one."""
    old = store.create(title="Old chat")
    q = store.add_message(old.id, "user", "Tell me about ice", parent_id=None)
    store.add_message(old.id, "assistant", "Ice floats.", "stop", parent_id=q.id)
    hit = store.add_message(old.id, "assistant", "Glaciers carve valleys slowly.", "stop", parent_id=q.id)
    store.set_current_leaf(old.id, q.id + 1)  # the first reply is the one shown
    newer = store.create(title="Newer chat")
    store.add_message(newer.id, "user", "Hello there")
    return old.id, hit.id, newer.id


def test_search_finds_a_word_from_an_old_reply_and_opens_its_branch(make_window, qtbot):
    store = ConversationStore(conversations_db_path())
    old_id, hit_id, newer_id = seed(store)
    store.close()
    window = make_window(start=False)
    assert window.controller.conversation.id == newer_id  # the latest opens first
    window.sidebar.search.setText("glacier")
    items = [window.sidebar.list.item(i) for i in range(window.sidebar.list.count())]
    assert len(items) == 1 and "Old chat" in items[0].text() and "«Glaciers»" in items[0].text()
    assert window.sidebar.search_note.text() == "1 message found"
    window.sidebar.list.setCurrentRow(0)
    conv = window.controller.conversation
    assert conv.id == old_id and conv.messages[-1].id == hit_id  # on the branch that says it
    assert window.chat.transcript.bubbles[-1].fork_position == (2, 2)
    window.sidebar.search.setText("no such word anywhere")
    assert window.sidebar.list.count() == 0 and window.sidebar.search_note.text() == "Nothing found"
    window.sidebar.search.clear()
    assert window.sidebar.ids() == [newer_id, old_id]  # back to the conversations, newest first


def test_export_then_import_through_files_gives_the_same_conversation(make_window, tmp_path):
    store = ConversationStore(conversations_db_path())
    old_id, _, _ = seed(store)
    store.close()
    window = make_window(start=False)
    window.controller.open_conversation(old_id)
    window.controller.export_to(old_id, "json", tmp_path / "tree.json")
    window.controller.export_to(old_id, "json-path", tmp_path / "path.json")
    window.controller.export_to(old_id, "markdown", tmp_path / "path.md")
    tree = json.loads((tmp_path / "tree.json").read_text())
    assert (
        len(tree["messages"]) == 3 and len(json.loads((tmp_path / "path.json").read_text())["messages"]) == 2
    )
    assert "Glaciers" not in (tmp_path / "path.md").read_text()  # Markdown is the shown path

    assert window.chat_actions.import_path(tmp_path / "tree.json")
    imported = window.controller.conversation
    assert imported.id != old_id and imported.title == "Old chat" and len(imported.nodes) == 3
    window.controller.export_to(imported.id, "json", tmp_path / "again.json")
    assert (tmp_path / "again.json").read_text() == (tmp_path / "tree.json").read_text()

    (tmp_path / "bad.json").write_text('{"format": "kvscope-conversation", "version": 2, "messages": [1]}')
    assert not window.chat_actions.import_path(tmp_path / "bad.json")
    assert (
        "Import failed: Not a kvscope conversation: message 1 is not an object." in window.status.error.text()
    )
