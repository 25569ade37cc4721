"""A small environment nobody labelled, as a user would bring one: a plain class whose
public, typed and documented methods are the tools."""

from __future__ import annotations

from typing import Any


class Notebook:
    """A notebook of short notes with an archive."""

    def __init__(self) -> None:
        self.notes: dict[str, str] = {}
        self.archived: list[str] = []

    def list_notes(self) -> list[str]:
        """The titles of the notes that are not archived."""
        return sorted(title for title in self.notes if title not in self.archived)

    def read_note(self, title: str) -> str:
        """The text of the note with this title."""
        if title not in self.notes:
            raise KeyError(f"no note titled {title!r}")
        return self.notes[title]

    def add_note(self, title: str, text: str) -> dict[str, Any]:
        """Add a note with a title and its text."""
        if title in self.notes:
            raise ValueError(f"a note titled {title!r} exists")
        self.notes[title] = text
        return {"added": title, "notes": len(self.notes)}

    def archive_note(self, title: str) -> dict[str, Any]:
        """Move the note with this title to the archive."""
        if title not in self.notes:
            raise KeyError(f"no note titled {title!r}")
        self.archived.append(title)
        return {"archived": title}


INITIAL_STATES = [
    {"notes": {"groceries": "milk, eggs, bread", "plumber": "call on Monday at 9"}},
    {"notes": {"trip": "book the train to Lyon"}, "archived": []},
]
SECTION = {"notebook": {"class": f"{__name__}:Notebook", "initial_states": INITIAL_STATES}}
