"""A compound statement cut into atomic ones, so a memory holds one fact and a later change retires only what
it changes: "I live in Lisbon with my wife Ana" -> "I live in Lisbon" and "My wife is Ana" (a move then
supersedes the city and never the wife's name); "I work at Deloitte as an auditor" -> "I work at Deloitte"
and "I work as an auditor"; "I'm a nurse at St Mary's" -> "I'm a nurse" and "I work at St Mary's".

Pure string rewriting over one clause (relative dates already resolved); knows nothing of slots or facts.
"""

from __future__ import annotations

import re

from kvmem.formation.lexicon import RELATIVES

_RELS = "|".join(sorted((re.escape(r) for r in RELATIVES), key=len, reverse=True))
_NAME = r"(?-i:[A-Z])[a-z]+(?:[ -](?-i:[A-Z])[a-z]+)?"
# "... with my wife Ana", "... with my wife, Ana", "... with Ana, my wife" (and what follows it, kept)
_COMPANION = re.compile(
    rf"^(?P<main>.+?),? (?:together )?with (?:my (?P<rel>{_RELS}),? (?P<name>{_NAME})|(?P<name2>{_NAME}),? my "
    rf"(?P<rel2>{_RELS}))(?P<rest>(?:,? (?:since|for|in|at|on|near|now)\b.*)?)$",
    re.I,
)
# the main clause must be a state the companion does not belong to: where one lives or works
_STATE = re.compile(
    r"^(?:I|we)(?:'m| am|'re| are|'ve| have)? (?:\w+ )?(?:live|living|lived|reside|residing|based|settled|"
    r"moved|relocated|work|working|worked)\b",
    re.I,
)
_JOB_AT = re.compile(
    r"^(?P<subj>I|we) (?P<adv>(?:\w+ )?)(?P<verb>work|am working|'m working) (?P<prep>at|for) (?P<org>[^,]+?) as "
    r"(?P<job>(?:a|an) [^,]+?)(?P<rest>(?:,? (?:since|for|now)\b.*)?)$|"
    r"^(?P<subj2>I|we) (?P<adv2>(?:\w+ )?)(?P<verb2>work|am working|'m working) as (?P<job2>(?:a|an) [^,]+?) "
    r"(?P<prep2>at|for) (?P<org2>(?-i:[A-Z])[^,]*?)(?P<rest2>(?:,? (?:since|for|now)\b.*)?)$",
    re.I,
)
# "I'm a nurse at St Mary's": a job and a named workplace
_ROLE_AT = re.compile(
    r"^I(?P<be>'m| am) (?P<job>(?:a|an) [a-z][\w -]*?) (?:at|for|with) (?P<org>(?-i:[A-Z])[^,]*?)"
    r"(?P<rest>(?:,? (?:since|for|now)\b.*)?)$",
    re.I,
)


def _relative_phrase(rel: str, name: str) -> str:
    return f"My {rel.lower()} is {name}"


def atoms(clause: str) -> list[str]:
    """The atomic statements in one clause, in order; the clause itself when it holds one fact."""
    m = _COMPANION.match(clause)
    if m is not None and _STATE.match(m.group("main")):
        rel, name = (
            (m.group("rel"), m.group("name")) if m.group("rel") else (m.group("rel2"), m.group("name2"))
        )
        main, rest = m.group("main"), m.group("rest").lstrip(",")
        if _STATE.fullmatch(main):  # "I live with my wife Ana": the living together is the fact
            main = f"{main} with my {rel.lower()}"
        return [*atoms(main + rest), _relative_phrase(rel, name)]
    m = _JOB_AT.match(clause)
    if m is not None:
        if m.group("subj"):
            keys = ("subj", "adv", "verb", "prep", "org", "job", "rest")
            subj, adv, verb, prep, org, job, rest = (m.group(k) for k in keys)
        else:
            subj, adv, verb, prep, org, job, rest = (
                m.group(k) for k in ("subj2", "adv2", "verb2", "prep2", "org2", "job2", "rest2")
            )
        return [f"{subj} {adv}{verb} {prep} {org}{rest}", f"{subj} {adv}{verb} as {job}{rest}"]
    m = _ROLE_AT.match(clause)
    if m is not None:
        return [f"I{m.group('be')} {m.group('job')}{m.group('rest')}", f"I work at {m.group('org')}"]
    return [clause]
