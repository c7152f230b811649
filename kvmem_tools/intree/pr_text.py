"""A PR text in vLLM's template (``.github/PULL_REQUEST_TEMPLATE.md`` of
vLLM 0.32): Overview / Claims / Validation / Details and the checklist, each
item answered, with what ``AGENTS.md`` requires of AI-assisted work (the
duplicate-work answer, the test commands and their results, the statement
that AI assistance was used) and an attribution trailer.

Every patch of the series builds its commit message with :func:`pr_text`;
``series.write_series`` commits it with ``git commit -s``, which adds the
``Signed-off-by:`` trailer the DCO asks for: the submitter's own identity
(``git config user.name``/``user.email`` where the generator runs), under
the ``Co-authored-by:`` of the AI agent, as AGENTS.md's example orders them.

A checklist box is ticked only where its evidence is in the text: the
``/pr-checklist`` box stays empty, with the reason, unless the skill was
run (``pr_checklist``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: The checklist's items, as the template words them.
SKILL_ITEM = (
    "I used vLLM's `/pr-checklist` skill. (Mandatory for agents, optional for humans)."
)
AI_ITEM = "AI assistance was used during the creation of this PR."
ITEMS = {
    "design_fit": "**Design Fit:** Minimizes impact on core components, reuses "
    "existing functionality, and justifies added complexity.",
    "testing": "**Testing and Validation:** Validates the change and ensures any "
    "added tests are meaningful and reliable, with CI coverage or documented CI "
    "resource constraints and validation performed outside CI.",
    "code_quality": "**Code Quality and Style:** Keeps code and comments clear and "
    "concise, and updates relevant documentation and examples.",
    "contents": "**Pull Request Contents:** Includes a brief summary and relevant "
    "links, supports claims with evidence, explains root causes and implementation "
    "trade-offs, and follows the contributing guide.",
}
AI_STATEMENT = (
    "AI assistance was used: an AI coding agent wrote this change, its tests "
    "and this description. The human submitter reviews every changed line and "
    "reruns the commands under Validation before opening the PR."
)
#: AGENTS.md's attribution trailer for the agent ("Co-authored-by: Agent
#: Name"); ``git commit -s`` adds the submitter's ``Signed-off-by`` after it.
TRAILER = "Co-authored-by: Claude <noreply@anthropic.com>"


@dataclass(frozen=True)
class Answer:
    """One checklist item: met or not, and the one line that says why."""

    met: bool
    why: str


#: The skill box where the skill was not run on the PR.
SKILL_NOT_RUN = Answer(
    False,
    "Not run on this PR: the items below are answered by hand; the submitter "
    "runs `/pr-checklist` and addresses its findings before opening.",
)


def pr_text(
    *,
    overview: str,
    claims: Sequence[str],
    validation: str,
    details: str,
    duplicates: str,
    design_fit: Answer,
    testing: Answer,
    code_quality: Answer,
    contents: Answer,
    pr_checklist: Answer | None = None,
) -> str:
    """The PR text (the commit message's body) in vLLM 0.32's template.

    ``duplicates``: why this is not duplicate work (AGENTS.md); each
    :class:`Answer` is shown ticked only where ``met``, its ``why`` under it.
    ``pr_checklist``: whether vLLM's ``/pr-checklist`` skill was run on this
    PR (default: not run, unticked, saying so).
    The text holds no ``---`` line: ``git am`` would end the message there.
    """
    answers = {
        "design_fit": design_fit,
        "testing": testing,
        "code_quality": code_quality,
        "contents": contents,
    }
    skill = pr_checklist or SKILL_NOT_RUN
    items = [
        f"- [{'x' if skill.met else ' '}] {SKILL_ITEM}\n  {skill.why}",
        f"- [x] {AI_ITEM}",
        "",
    ]
    for key, text in ITEMS.items():
        answer = answers[key]
        items.append(f"- [{'x' if answer.met else ' '}] {text}\n  {answer.why}")
    bullets = "\n".join(f"- {c}" for c in claims)
    body = f"""\
## Overview

{overview.strip()}

## Claims

{bullets}

## Validation

{validation.strip()}

## Details

{details.strip()}

Duplicate work: {duplicates.strip()}

{AI_STATEMENT}

<details>
<summary> Pull Request Checklist </summary>

{chr(10).join(items)}
</details>

{TRAILER}
"""
    assert "\n---\n" not in body, "a --- line ends the message in git am"
    return body
