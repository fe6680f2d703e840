"""The commit-msg hook: a subject of at most 72 characters, a blank line, then a body that says why.

Run by pre-commit (``.pre-commit-config.yaml``) with the message file git hands the hook, or by
hand: ``python scripts/check_commit_msg.py .git/COMMIT_EDITMSG``. Exits 1 with what to fix.
Subjects git or its tools write (merges, ``fixup!``/``squash!``/``amend!``, reverts) pass as they are.
"""

from __future__ import annotations

import sys
from pathlib import Path

MAX_SUBJECT = 72

#: Subjects written by git itself or by ``git commit --fixup`` and friends: not ours to reword.
EXEMPT = ("Merge ", "fixup! ", "squash! ", "amend! ", 'Revert "')

#: Everything below this line of a verbose commit (``git commit -v``) is the diff, not the message.
SCISSORS = "# ------------------------ >8 ------------------------"


def problems(message: str) -> list[str]:
    """What is wrong with ``message`` (empty: nothing), as git would store it.

    Comment lines (``#``) and a verbose commit's diff are left out first, as git leaves them out.

    Example:
        >>> problems("tests: cover the hook\\n\\nA subject alone says what, not why.\\n")
        []
        >>> problems("tests: cover the hook\\n")
        ['no body: add a blank line after the subject, then say why the change is made']
    """
    lines = []
    for line in message.splitlines():
        if line.startswith(SCISSORS):
            break
        if not line.startswith("#"):
            lines.append(line.rstrip())
    while lines and not lines[0]:
        lines.pop(0)
    if not lines:
        return ["the message is empty"]
    subject = lines[0]
    if subject.startswith(EXEMPT):
        return []
    found = []
    if len(subject) > MAX_SUBJECT:
        found.append(f"the subject has {len(subject)} characters, more than {MAX_SUBJECT}: move the detail to the body")
    if len(lines) > 1 and lines[1]:
        found.append("the second line must be blank: the subject is one line, the body starts after a blank line")
    elif not any(lines[2:]):
        found.append("no body: add a blank line after the subject, then say why the change is made")
    return found


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: check_commit_msg.py MESSAGE_FILE", file=sys.stderr)
        return 2
    found = problems(Path(args[0]).read_text(encoding="utf-8"))
    for problem in found:
        print(f"commit message: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
