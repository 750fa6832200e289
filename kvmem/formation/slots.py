"""The attribute a first-person statement sets, as a slot and a normalized value ("I moved to Berlin" ->
("user|home_city", "berlin")), so that consolidation can retire the value it replaces.

Owns the pattern table (regex, slot builder, kind), read top to bottom, the first pattern whose builder
accepts the match wins. Knows nothing of turns, dates or consolidation; value normalizers live in `values.py`.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from kvmem.formation import values as v
from kvmem.formation.lexicon import DIETS, RELATIONSHIP, RELATIVES, SPECIES


@dataclass(frozen=True)
class SlotMatch:
    """What a statement sets: `slot` "subject|attribute", normalized `value`, and the fact's kind."""

    slot: str
    value: str
    kind: str


Build = Callable[[re.Match[str]], "tuple[str, str] | None"]


@dataclass(frozen=True)
class SlotRule:
    pattern: re.Pattern[str]
    build: Build  # (slot, value), or None to let the next rule try
    kind: str


def _alt(words: object) -> str:
    return "|".join(sorted((re.escape(str(w)) for w in words), key=len, reverse=True))


# ---- pattern pieces --------------------------------------------------------------------------------------

_STOP = (
    r"and|but|or|because|cause|since|as|so|now|anymore|any more|these days|right now|at the moment|with|for|"
    r"in|on|at|from|near|after|before|when|while|who|whom|which|where|that|not|too|again|already|still|"
    r"though|although|ever|yet|lately|recently|currently|nowadays|instead|either|then|this|last|next|every|"
    r"each|to|than|over|until|till|by|ago|haha|lol|full-time|part-time|anyway|honestly|though"
)
_END = rf"(?=\s*$|\s*[,.;:!?()\"]|\s+(?:{_STOP})\b)"


def _val(name: str) -> str:
    """A value up to the clause end, punctuation or a stop word ("Berlin" in "in Berlin with my wife")."""
    return rf"(?P<{name}>[^,.;:!?()\"]+?){_END}"


_NAME = rf"(?P<name>[A-Za-z][\w'-]*(?: (?-i:[A-Z])[\w'-]*)?){_END}"
_I = r"(?:I|we|me and my \w+|my \w+ and I)"
_BE = r"(?:'m| am|'re| are)"
_HAVE = r"(?:'ve| have)?"
_ADV = (
    r"(?:(?:now|currently|still|just|recently|finally|officially|actually|already|also|happily|proudly|"
    r"basically|technically|really|absolutely|totally|kind of|kinda|truly|do|even|literally|definitely|"
    r"honestly|genuinely|mostly|full-time|part-time|permanently|originally|newly|so|pretty|quite|completely|"
    r"sort of)\s+)*"
)
_ADJ = r"(?:(?:older|younger|little|big|baby|twin|eldest|oldest|youngest|new|old|dear|sweet|cute)\s+)?"
_SPECIES = _alt(SPECIES)
_REL = _alt(RELATIVES)
_DIETS = _alt(DIETS)
_RELATIONSHIP = _alt(RELATIONSHIP)
_POSITIVE = r"love|like|enjoy|adore|prefer|dig|am into|'m into|are into|'re into"
_NEGATIVE = (
    r"hate|dislike|detest|loathe|can't stand|cannot stand|can't bear|don't like|do not like|don't enjoy|"
    r"don't love|no longer like|no longer enjoy|no longer love|don't really like|don't care for|"
    r"never liked|never really liked|am not into|'m not into|'re not into|am over|'m over|am done with|"
    r"'m done with|am sick of|'m sick of|am tired of|'m tired of|'m fed up with|am fed up with|"
    r"'m not (?:a |really a )?(?:big |huge )?fan of|am not (?:a )?(?:big |huge )?fan of|went off|"
    r"'ve gone off|have gone off|'ve gone off of|have lost interest in|lost interest in|have fallen out of love "
    r"with|fell out of love with|have grown tired of|grew tired of|stopped liking|stopped enjoying|"
    r"have stopped liking|have stopped enjoying"
)
_CONSUME = r"drink|eat|smoke|play|watch|do|listen to|read|touch|use|buy|wear"
_QUIT = r"stopped|quit|gave up|given up|cut out|kicked|quit on|ditched|dropped"


# ---- builders: a slot template and a value, both from the match ----------------------------------------


def _user(attribute: str, value: Callable[[re.Match[str]], str | None]) -> Build:
    def build(m: re.Match[str]) -> tuple[str, str] | None:
        got = value(m)
        return (f"user|{attribute}", got) if got else None

    return build


def _fixed(text: str) -> Callable[[re.Match[str]], str | None]:
    return lambda m: text


def _group(name: str, normalize: Callable[[str], str | None]) -> Callable[[re.Match[str]], str | None]:
    return lambda m: normalize(m.group(name))


def _lookup(name: str, table: dict[str, str], prefix: str = "") -> Callable[[re.Match[str]], str | None]:
    return lambda m: prefix + table[m.group(name).lower()]


def _relative(attribute: str, value: Callable[[re.Match[str]], str | None]) -> Build:
    """A relative's slot, "sister|home_city"; a friend, cousin or colleague needs a name: "friend:tom|..."."""

    def build(m: re.Match[str]) -> tuple[str, str] | None:
        subject = v.relative_subject(m.group("rel"), m.groupdict().get("relname"))
        got = value(m)
        return (f"{subject}|{attribute}", got) if subject and got else None

    return build


def _pet_name(m: re.Match[str]) -> tuple[str, str] | None:
    """A pet's name per species; "another dog", "a second cat", "also a dog" add a pet rather than rename."""
    if v.ADDS_ANOTHER.search(m.string, 0, m.end()) or v.ALSO_AT_END.search(m.string):
        return None
    groups = m.groupdict()
    raw_species = groups.get("species") or groups.get("species2") or groups["species3"]
    species = SPECIES[raw_species.lower()]
    raw_name = groups.get("name") or groups.get("name2") or groups.get("name3")
    name = v.name(raw_name) if raw_name else "none"
    return (f"user|{species}.name", name) if name else None


def _favourite(m: re.Match[str]) -> tuple[str, str] | None:
    thing, value = v.thing(m.group("thing")), v.plain(m.group("val"))
    return (f"user|favourite:{thing}", value) if thing and value else None


def _likes(answer: str, attribute: str = "likes", group: str = "obj") -> Build:
    def build(m: re.Match[str]) -> tuple[str, str] | None:
        if v.MORE_OBJECTS.match(m.string, m.end(group)):
            return None  # "I love coffee and tea": two objects, one statement; no slot
        obj = v.thing_object(m.group(group))
        return (f"user|{attribute}:{obj}", answer) if obj else None

    return build


def _rule(pattern: str, build: Build, kind: str = "fact") -> SlotRule:
    return SlotRule(re.compile(pattern, re.IGNORECASE), build, kind)


# ---- the table -------------------------------------------------------------------------------------------

RULES: tuple[SlotRule, ...] = (
    # contact and name
    _rule(
        r"^my (?:new |current |personal |work )?(?:e-?mail|e-?mail address|mail address) is (?:now )?"
        r"(?P<email>[\w.+-]+@[\w-]+(?:\.[\w-]+)+)",
        _user("email", _group("email", str.lower)),
    ),
    _rule(
        r"^my (?:new |current )?(?:phone|phone number|number|cell|cell number|mobile|mobile number|"
        r"cellphone|cellphone number) is (?:now )?(?P<phone>\+?\d[\d ()./-]{5,}\d)",
        _user("phone", _group("phone", v.phone)),
    ),
    _rule(
        rf"^my (?:first )?name(?:'s| is) (?:now |actually )?{_NAME}", _user("name", _group("name", v.name))
    ),
    _rule(
        r"^(?:you can |please |just )?call me (?P<name>[A-Za-z][\w'-]*)$|"
        r"^(?:people|everyone|my friends) (?:call|calls) me (?P<name2>[A-Za-z][\w'-]*)$",
        _user("name", lambda m: v.name(m.group("name") or m.group("name2"))),
    ),
    _rule(r"^I(?:'m| am) (?P<name>(?-i:[A-Z])[a-z]+)$", _user("name", _group("name", v.person_name))),
    # age
    _rule(
        r"^I(?:'m| am) (?:now |actually )?(?P<age>\d{1,3})(?: years? old| years of age| yo| y/o| yrs old)?"
        r"(?=\s*$|\s*[,;]|\s+(?:now|and|but|since|as of|this year)\b)|"
        r"^I (?:just |recently |finally )?turned (?P<age2>\d{1,3})\b",
        _user("age", lambda m: v.age(m.group("age") or m.group("age2"))),
    ),
    # origin is not home
    _rule(rf"^{_I}{_BE} {_ADV}from {_val('place')}", _user("origin", _group("place", v.place))),
    _rule(
        rf"^{_I} {_ADV}(?:grew up|was raised|were raised) in {_val('place')}",
        _user("origin", _group("place", v.place)),
    ),
    _rule(rf"^I was born in {_val('place')}", _user("birthplace", _group("place", v.place))),
    # home: where the user lives now (a city or a country: one slot, so either kind of move supersedes)
    _rule(
        rf"^{_I} {_ADV}(?:live|reside) {_ADV}in {_val('place')}", _user("home_city", _group("place", v.place))
    ),
    _rule(
        rf"^{_I}{_BE} {_ADV}(?:living|based|settled|residing) {_ADV}in {_val('place')}",
        _user("home_city", _group("place", v.place)),
    ),
    _rule(
        rf"^{_I}(?:'ve| have) {_ADV}(?:been living|lived) {_ADV}in {_val('place')}(?=\s+(?:for|since|now)\b)",
        _user("home_city", _group("place", v.place)),
    ),
    _rule(
        rf"^{_I}{_HAVE} {_ADV}(?:moved|relocated|emigrated|immigrated|moved back|moved over|moved out) "
        rf"{_ADV}(?:back |over |here |all the way )?to {_val('place')}",
        _user("home_city", _group("place", v.place)),
    ),
    _rule(
        r"^(?:my|our) (?:new |current |)(?:home|flat|house|apartment|place) is (?:now )?in " + _val("place"),
        _user("home_city", _group("place", v.place)),
    ),
    _rule(
        r"^home (?:is|for me is) (?:now )?(?:in )?"
        + _val("place")
        + r"|^(?P<place2>[\w' -]{1,30}?) is (?:now )?"
        r"(?:my )?home\b",
        _user("home_city", lambda m: v.place(m.group("place") or m.group("place2"))),
    ),
    _rule(
        rf"^{_I} {_ADV}call (?P<place>[^,.;!?]+?) (?:my )?home\b",
        _user("home_city", _group("place", v.place)),
    ),
    _rule(
        rf"^{_I}{_HAVE} {_ADV}(?:made|make) the (?:big |)move {_ADV}(?:back |over |)to {_val('place')}|"
        rf"^{_I}(?:'ve| have) {_ADV}been in {_val('place2')}(?=\s+(?:for|since)\b)",
        _user("home_city", lambda m: v.place(m.group("place") or m.group("place2"))),
    ),
    # relationship status
    _rule(
        rf"^I{_BE} {_ADV}(?P<rs>{_RELATIONSHIP})\b(?!-)",
        _user("relationship", _lookup("rs", RELATIONSHIP)),
        "relation",
    ),
    _rule(
        rf"^{_I}{_HAVE} {_ADV}(?:got|gotten) (?P<rs>married|engaged|divorced|separated)\b",
        _user("relationship", _lookup("rs", RELATIONSHIP)),
        "relation",
    ),
    _rule(
        rf"^(?:{_I}{_HAVE} {_ADV}(?:broke up|broken up|split up|separated|called it off|ended things)|"
        r"^(?:my|me and my) (?:ex-?)?(?:girlfriend|boyfriend|partner|wife|husband|fiancée?|fiance)"
        r"(?: and I)? (?:just |recently |finally )?(?:broke up|split up|separated|left me|dumped me|"
        r"divorced me))\b",
        _user("relationship", _fixed("single")),
        "relation",
    ),
    _rule(
        rf"^I{_HAVE} {_ADV}(?:have|got|have got|now have|found) (?:a |an )?(?:new |lovely |)"
        r"(?:girlfriend|boyfriend|partner)\b|"
        rf"^I{_BE} {_ADV}(?:dating|seeing|going out with|together with|in a relationship with) \w",
        _user("relationship", _fixed("in a relationship")),
        "relation",
    ),
    # job and employer
    _rule(
        rf"^I{_HAVE} {_ADV}(?:quit|left|lost|resigned from|walked away from|handed in my notice at) "
        r"(?:my|the) (?:\w+ )?job\b|"
        rf"^I{_HAVE} {_ADV}(?:got|was|been|were|got myself) (?:fired|laid off|let go|made redundant|sacked)\b|"
        rf"^I{_BE} {_ADV}(?:unemployed|jobless|out of work|between jobs|not working)\b",
        _user("job", _fixed("none")),
    ),
    _rule(rf"^I(?:'m| am|'ve| have)? {_ADV}(?:retired|been retired)\b", _user("job", _fixed("retired"))),
    _rule(
        rf"^{_I}{_HAVE} {_ADV}(?:work|working|started working|began working|been working|'m working|"
        rf"am working|'re working|are working|am employed|are employed|employed) {_ADV}as (?:a |an )?{_val('job')}|"
        rf"^{_I}(?:'ve| have) {_ADV}worked as (?:a |an )?{_val('job2')}(?=\s+(?:for|since)\b)",
        _user("job", lambda m: v.job_any(m.group("job") or m.group("job2"))),
    ),
    _rule(
        rf"^I{_HAVE} {_ADV}(?:got|landed|accepted|started|took|found|began|start|was offered) (?:a |an |my |the )?"
        rf"(?:new |first |dream )?(?:job|position|role|gig)(?: offer)? as (?:a |an )?{_val('job')}",
        _user("job", _group("job", v.job_any)),
    ),
    _rule(
        rf"^I{_HAVE} {_ADV}(?:became|become|got promoted to|was promoted to|retrained as|qualified as) "
        rf"(?:a |an )?{_val('job')}",
        _user("job", _group("job", v.job_known)),
    ),
    _rule(rf"^I{_BE} {_ADV}(?:a |an ){_val('job')}", _user("job", _group("job", v.job_known))),
    _rule(
        rf"^{_I}{_HAVE} {_ADV}(?:work|working|been working|'m working|am working|'re working|are working) "
        rf"{_ADV}(?:at|for) {_val('org')}",
        _user("employer", _group("org", v.org)),
    ),
    _rule(
        rf"^I{_HAVE} {_ADV}(?:got|landed|accepted|started|took|found|began|start|was offered) "
        rf"(?:a |an |my |the )?(?:new |first |dream )?(?:job|position|role|internship|gig)(?: offer)? "
        rf"(?:at|with) {_val('org')}|"
        rf"^I{_HAVE} {_ADV}(?:started|began) (?:working|a new job|my new job|my job) (?:at|for|with) {_val('org2')}",
        _user("employer", lambda m: v.org(m.group("org") or m.group("org2"))),
    ),
    _rule(
        rf"^I{_HAVE} {_ADV}(?:accepted|took) (?:an |a |the )?(?:job |work )?offer (?:from|with|at) {_val('org')}|"
        rf"^my (?:new |current |)(?:employer|company|workplace) is (?:now )?{_val('org2')}",
        _user("employer", lambda m: v.org(m.group("org") or m.group("org2"))),
    ),
    _rule(
        rf"^I{_HAVE} {_ADV}joined (?P<org>(?-i:[A-Z])[\w&.'-]*(?: (?-i:[A-Z])[\w&.'-]*)*){_END}",
        _user("employer", _group("org", v.org)),
    ),
    # diet and allergies
    _rule(
        rf"^{_I}{_BE} {_ADV}(?:no longer|not) (?:a |an )?(?P<diet>{_DIETS})\b",
        _user("diet", _lookup("diet", DIETS, "not:")),
    ),
    _rule(
        rf"^{_I}{_HAVE} {_ADV}(?:stopped|quit|gave up|given up) being (?:a |an )?(?P<diet>{_DIETS})\b",
        _user("diet", _lookup("diet", DIETS, "not:")),
    ),
    _rule(
        rf"^{_I}{_BE} {_ADV}(?:a |an )?(?:strict |full |committed |fully |)(?P<diet>{_DIETS})\b"
        r"(?! food| restaurant| recipe| option| dish| place)",
        _user("diet", _lookup("diet", DIETS)),
    ),
    _rule(
        rf"^{_I}{_HAVE} {_ADV}(?:went|gone|became|become|turned|switched to|converted to|been|started being) "
        rf"(?:a |an |fully |full |)(?P<diet>{_DIETS})\b",
        _user("diet", _lookup("diet", DIETS)),
    ),
    _rule(
        rf"^{_I}{_HAVE}(?: am| are)? {_ADV}(?:follow|following|on|eat|eating|have|keep|stick to|sticking to) "
        rf"(?:a |an )?(?:strict |mostly |fully |)(?P<diet>{_DIETS}) diet\b",
        _user("diet", _lookup("diet", DIETS)),
    ),
    _rule(
        rf"^{_I}{_HAVE} {_ADV}(?:eat|eating|started eating|began eating|gone back to eating|went back to "
        r"eating|'m eating|am eating) meat(?: again| now|$)",
        _user("diet", _fixed("omnivore")),
    ),
    _rule(
        rf"^I{_BE} {_ADV}(?:no longer|not) (?:really |)allergic to {_val('obj')}",
        _likes("no", "allergy"),
    ),
    _rule(
        rf"^I{_BE} {_ADV}(?:severely |very |mildly |deathly |really |highly |)(?:allergic|intolerant) to "
        rf"{_val('obj')}",
        _likes("yes", "allergy"),
    ),
    _rule(rf"^I{_BE} {_ADV}(?P<obj>[a-z]+) intolerant\b", _likes("yes", "allergy")),
    # pets: a name per species
    _rule(
        rf"^(?:my|our|the) {_ADJ}(?P<species>{_SPECIES})(?:'s name is| is called| is named| goes by|(?:'s| is) "
        rf"(?:actually |now |)(?:called|named)) (?:actually )?{_NAME}|"
        rf"^{_I}{_HAVE} {_ADV}renamed (?:my|our|the) {_ADJ}(?P<species2>{_SPECIES}) (?:to )?(?P<name2>[A-Za-z]"
        rf"[\w'-]*){_END}|"
        rf"^(?:my|our) {_ADJ}(?P<species3>{_SPECIES}),? (?P<name3>(?-i:[A-Z])[a-z]+)\b(?!')(?!,? {_ADV}(?:died|"
        r"passed|was put down|had to be put down|ran away|is gone))",
        _pet_name,
    ),
    _rule(
        rf"^{_I}{_HAVE} {_ADV}(?:have|got|have got|adopted|rescued|bought|brought home|took in|own|got "
        rf"ourselves|got myself) (?:a |an |one )?(?:new |little |cute |sweet |beautiful |)"
        rf"(?P<species>{_SPECIES}),? (?:named|called|whose name is) {_NAME}",
        _pet_name,
    ),
    _rule(
        rf"^(?:my|our) {_ADJ}(?P<species>{_SPECIES})(?: (?-i:[A-Z])\w+)? (?:just |recently |sadly |)"
        r"(?:died|passed away|passed|was put down|had to be put down|ran away|is gone)\b",
        _pet_name,
        "event",
    ),
    # favourites
    _rule(
        r"^my (?:new |current |all-time |absolute |)(?:favou?rite|fave?) (?P<thing>[a-z][a-z -]{0,25}?) "
        r"(?:these days |right now |at the moment |nowadays |lately |)(?:is|are|has become|became|is now|are "
        r"now|has changed to|changed to|has always been|has been) (?:now |still |definitely |probably "
        rf"|actually |)(?:to )?{_val('val')}",
        _favourite,
        "preference",
    ),
    _rule(
        r"^(?P<val>[\w' -]{1,30}?) (?:is|are|has become|became|has always been|has been|was always|will always "
        r"be) (?:now |still |officially |definitely |)my (?:new |current |all-time |absolute |)(?:favou?rite|fave?) "
        rf"{_val('thing')}",
        _favourite,
        "preference",
    ),
    # likes and dislikes, per object
    _rule(rf"^{_I} {_ADV}(?:{_NEGATIVE}) {_val('obj')}", _likes("no"), "preference"),
    _rule(
        rf"^{_I}{_BE} {_ADV}(?:not|no longer) (?:really |)(?:into|a (?:big |huge |)fan of|crazy about) "
        rf"{_val('obj')}",
        _likes("no"),
        "preference",
    ),
    _rule(
        rf"^{_I} (?:don't|do not|no longer|never|can't|cannot|won't) (?:really |even |)(?:{_CONSUME}) "
        rf"{_val('obj')}",
        _likes("no"),
        "preference",
    ),
    _rule(
        rf"^{_I}{_HAVE} {_ADV}(?:{_QUIT}) (?:on )?(?:drinking |eating |smoking |playing |watching |doing "
        rf"|listening to |buying |)(?!my job\b|the job\b|my \w+ job\b){_val('obj')}",
        _likes("no"),
        "preference",
    ),
    _rule(
        r"^(?:I|we) (?:don't|do not|no longer|never) (?P<verb>[a-z]+) (?:anymore|any more|now|these days)$|"
        r"^(?:I|we) no longer (?P<verb2>[a-z]+)$",
        lambda m: _likes_verb_any(m),
        "preference",
    ),
    _rule(rf"^{_I} {_ADV}(?:{_POSITIVE}) {_val('obj')}", _likes("yes"), "preference"),
    _rule(
        rf"^{_I}{_HAVE} {_ADV}(?:started|begun|began|come|grown|learned|learnt) to {_ADV}(?:love|like|enjoy|"
        rf"appreciate) {_val('obj')}|^{_I}{_HAVE} {_ADV}(?:started|begun|began) (?:liking|loving|enjoying) "
        rf"{_val('obj2')}",
        lambda m: _likes("yes")(m) if m.group("obj") else _likes("yes", group="obj2")(m),
        "preference",
    ),
    _rule(
        r"^(?P<obj>[\w' -]{1,30}?) (?:is|are|has always been|has been) (?:now |still |definitely |)my "
        r"(?:guilty pleasure|jam|thing|weakness|comfort food|happy place)\b",
        _likes("yes"),
        "preference",
    ),
    _rule(
        rf"^{_I}{_BE} {_ADV}(?:into|a (?:big |huge |massive |)fan of|obsessed with|crazy about|passionate "
        rf"about|addicted to|hooked on|a sucker for|in love with) {_val('obj')}",
        _likes("yes"),
        "preference",
    ),
    # relatives: where they live, their name, their job
    _rule(
        rf"^my {_ADJ}(?P<rel>{_REL})(?:,? (?P<relname>(?-i:[A-Z])[a-z]+),?)?(?: {_ADV}(?:lives|is living|"
        rf"resides|is based|moved|has moved|relocated|has relocated)|'s {_ADV}(?:living|based|moved)) "
        rf"{_ADV}(?:in|to|back to|over to) {_val('place')}",
        _relative("home_city", _group("place", v.place)),
        "relation",
    ),
    _rule(
        rf"^my {_ADJ}(?P<rel>{_REL})(?:'s name is| is called| is named| goes by) {_NAME}|"
        rf"^{_I} (?:have|'ve got|have got) (?:a|an|one) {_ADJ}(?P<rel2>{_REL}) (?:named|called) (?P<name2>"
        rf"[A-Za-z][\w'-]*){_END}",
        lambda m: _relative_name(m),
        "relation",
    ),
    _rule(
        rf"^my {_ADJ}(?P<rel>{_REL})(?: (?P<relname>(?-i:[A-Z])[a-z]+))?(?: is|'s| works as| is working as) "
        rf"{_ADV}(?:a |an ){_val('job')}",
        _relative("job", _group("job", v.job_known)),
        "relation",
    ),
    _rule(
        rf"^my {_ADJ}(?P<rel>{_REL})(?: (?P<relname>(?-i:[A-Z])[a-z]+))? {_ADV}(?:works|is working|started "
        rf"working|got a job) (?:at|for) {_val('org')}",
        _relative("employer", _group("org", v.org)),
        "relation",
    ),
)


def _likes_verb_any(m: re.Match[str]) -> tuple[str, str] | None:
    verb = (m.group("verb") or m.group("verb2")).lower()
    return (f"user|likes:{v.gerund(verb)}", "no") if verb not in v.NOT_ACTIVITIES else None


def _relative_name(m: re.Match[str]) -> tuple[str, str] | None:
    rel = m.group("rel") or m.group("rel2")
    name = v.name(m.group("name") or m.group("name2"))
    subject = RELATIVES[rel.lower()]
    if not name or subject in v.NEEDS_NAME:
        return None
    return f"{subject}|name", name


_CONTRACTIONS = (
    (re.compile(r"\b(I|we)'m\b", re.I), r"\1 am"),
    (re.compile(r"\b(I|we)'re\b", re.I), r"\1 are"),
    (re.compile(r"\b(I|we)'ve\b", re.I), r"\1 have"),
)


_INTENSIFIERS = re.compile(
    r"\b(?:really|totally|absolutely|completely|kind of|kinda|sort of|pretty much|so|just|actually|"
    r"definitely|honestly|seriously|literally|genuinely|truly|finally|officially|now|currently|recently|"
    r"basically|already)\s+(?=[a-z])",
    re.I,
)


def expand_contractions(text: str) -> str:
    """ "I'm" -> "I am", "we're" -> "we are", "I've" -> "I have", and intensifiers or time adverbs before a
    word dropped ("I'm so over it" -> "I am over it"): the patterns then need one spelling."""
    for pattern, replacement in _CONTRACTIONS:
        text = pattern.sub(replacement, text)
    return _INTENSIFIERS.sub("", text)


def match_slot(core: str) -> SlotMatch | None:
    """The slot a clause sets, or None. `core` starts at the clause's subject (leading dates and adverbs
    already stripped, see `clauses.strip_adverbials`) and has no end punctuation."""
    core = expand_contractions(core)
    for rule in RULES:
        m = rule.pattern.search(core)
        if m is None:
            continue
        built = rule.build(m)
        if built is not None:
            return SlotMatch(built[0], built[1], rule.kind)
    return None
