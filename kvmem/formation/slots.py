"""The attribute a first-person statement sets, as a slot and a normalized value ("I moved to Berlin" ->
("user|home_city", "berlin")), so that consolidation can retire the value it replaces.

Owns the pattern table (regex, slot builder, kind), read top to bottom, the first pattern whose builder
accepts the match wins; the rules of home, relationship and job are in `slot_rules_life.py`, the table's pieces in
`slot_grammar.py`, value normalizers in `values.py`. Knows nothing of turns, dates or consolidation.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvmem.formation import slot_grammar as g
from kvmem.formation import values as v
from kvmem.formation.lexicon import DIETS
from kvmem.formation.slot_grammar import SlotRule
from kvmem.formation.slot_rules_life import LIFE_RULES


@dataclass(frozen=True)
class SlotMatch:
    """What a statement sets: `slot` "subject|attribute", normalized `value`, and the fact's kind."""

    slot: str
    value: str
    kind: str


# what comes before "fan" and is no object: "I'm a big fan", "a former Chelsea fan"
_NOT_FAN = (
    r"big|huge|massive|new|true|real|casual|ex|former|old|long-time|longtime|fair-weather|bandwagon|proper|super|ceiling|"
    r"desk|electric|pedestal"
)

# ---- the table -------------------------------------------------------------------------------------------

RULES: tuple[SlotRule, ...] = (
    # contact and name
    g.rule(
        r"^my (?:new |current |personal |work )?(?:e-?mail|e-?mail address|mail address) is (?:now )?"
        r"(?P<email>[\w.+-]+@[\w-]+(?:\.[\w-]+)+)",
        g.user("email", g.group("email", str.lower)),
    ),
    g.rule(
        r"^my (?:new |current )?(?:phone|phone number|number|cell|cell number|mobile|mobile number|"
        r"cellphone|cellphone number) is (?:now )?(?P<phone>\+?\d[\d ()./-]{5,}\d)",
        g.user("phone", g.group("phone", v.phone)),
    ),
    g.rule(
        rf"^my (?:first )?name(?:'s| is) (?:now |actually )?{g.NAME}", g.user("name", g.group("name", v.name))
    ),
    g.rule(
        r"^(?:you can |please |just )?call me (?P<name>[A-Za-z][\w'-]*)$|"
        r"^(?:people|everyone|my friends) (?:call|calls) me (?P<name2>[A-Za-z][\w'-]*)$",
        g.user("name", lambda m: v.name(m.group("name") or m.group("name2"))),
    ),
    g.rule(r"^I(?:'m| am) (?P<name>(?-i:[A-Z])[a-z]+)$", g.user("name", g.group("name", v.person_name))),
    # age
    g.rule(
        r"^I(?:'m| am) (?:now |actually )?(?P<age>\d{1,3})(?: years? old| years of age| yo| y/o| yrs old)?"
        r"(?=\s*$|\s*[,;]|\s+(?:now|and|but|since|as of|this year)\b)|"
        r"^I (?:just |recently |finally )?turned (?P<age2>\d{1,3})\b",
        g.user("age", lambda m: v.age(m.group("age") or m.group("age2"))),
    ),
    # origin is not home
    g.rule(rf"^{g.SUBJ}{g.BE} {g.ADV}from {g.val('place')}", g.user("origin", g.group("place", v.place))),
    g.rule(
        rf"^{g.SUBJ} {g.ADV}(?:grew up|was raised|were raised) in {g.val('place')}",
        g.user("origin", g.group("place", v.place)),
    ),
    g.rule(rf"^I was born in {g.val('place')}", g.user("birthplace", g.group("place", v.place))),
    *LIFE_RULES,
    # diet and allergies
    g.rule(
        rf"^{g.SUBJ}{g.BE} {g.ADV}(?:no longer|not) (?:a |an )?(?P<diet>{g.DIETS_RE})\b",
        g.user("diet", g.lookup("diet", DIETS, "not:")),
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:stopped|quit|gave up|given up) being (?:a |an )?(?P<diet>{g.DIETS_RE})\b",
        g.user("diet", g.lookup("diet", DIETS, "not:")),
    ),
    g.rule(
        rf"^{g.SUBJ}{g.BE} {g.ADV}(?:a |an )?(?:strict |full |committed |fully |)(?P<diet>{g.DIETS_RE})\b"
        r"(?! food| restaurant| recipe| option| dish| place)",
        g.user("diet", g.lookup("diet", DIETS)),
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:went|gone|became|become|turned|switched to|converted to|been|started being) "
        rf"(?:a |an |fully |full |)(?P<diet>{g.DIETS_RE})\b",
        g.user("diet", g.lookup("diet", DIETS)),
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE}(?: am| are)? {g.ADV}(?:follow|following|on|eat|eating|have|keep|stick to|sticking to) "
        rf"(?:a |an )?(?:strict |mostly |fully |)(?P<diet>{g.DIETS_RE}) diet\b",
        g.user("diet", g.lookup("diet", DIETS)),
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:eat|eating|started eating|began eating|gone back to eating|went back to "
        r"eating|'m eating|am eating) meat(?: again| now|$)",
        g.user("diet", g.fixed("omnivore")),
    ),
    g.rule(
        rf"^I{g.BE} {g.ADV}(?:no longer|not) (?:really |)allergic to {g.val('obj')}",
        g.likes("no", "allergy"),
    ),
    g.rule(
        rf"^I{g.BE} {g.ADV}(?:severely |very |mildly |deathly |really |highly |)(?:allergic|intolerant) to "
        rf"{g.val('obj')}",
        g.likes("yes", "allergy"),
    ),
    g.rule(rf"^I{g.BE} {g.ADV}(?P<obj>[a-z]+) intolerant\b", g.likes("yes", "allergy")),
    # pets: a name per species
    g.rule(
        rf"^(?:my|our|the) {g.ADJ}(?P<species>{g.SPECIES_RE})(?:'s name is| is called| is named| goes by|(?:'s| is) "
        rf"(?:actually |now |)(?:called|named)) (?:actually )?{g.NAME}|"
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}renamed (?:my|our|the) {g.ADJ}(?P<species2>{g.SPECIES_RE}) (?:to )?(?P<name2>[A-Za-z]"
        rf"[\w'-]*){g.END}|"
        rf"^(?:my|our) {g.ADJ}(?P<species3>{g.SPECIES_RE}),? (?P<name3>(?-i:[A-Z])[a-z]+)\b(?!')(?!,? {g.ADV}(?:died|"
        r"passed|was put down|had to be put down|ran away|is gone))",
        g.pet_name,
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:have|got|have got|adopted|rescued|bought|brought home|took in|own|got "
        rf"ourselves|got myself) (?:a |an |one )?(?:new |little |cute |sweet |beautiful |)"
        rf"(?P<species>{g.SPECIES_RE}),? (?:named|called|whose name is) {g.NAME}",
        g.pet_name,
    ),
    g.rule(
        rf"^(?:my|our) {g.ADJ}(?P<species>{g.SPECIES_RE})(?: (?-i:[A-Z])\w+)? (?:just |recently |sadly |)"
        r"(?:died|passed away|passed|was put down|had to be put down|ran away|is gone)\b",
        g.pet_name,
        "event",
    ),
    # favourites
    g.rule(
        r"^my (?:new |current |all-time |absolute |)(?:favou?rite|fave?) (?P<thing>[a-z][a-z -]{0,25}?) "
        r"(?:these days |right now |at the moment |nowadays |lately |)(?:is|are|has become|became|is now|are "
        r"now|has changed to|changed to|has always been|has been) (?:now |still |definitely |probably "
        rf"|actually |)(?:to )?{g.val('val')}",
        g.favourite,
        "preference",
    ),
    g.rule(
        r"^(?P<val>[\w' -]{1,30}?) (?:is|are|has become|became|has always been|has been|was always|will always "
        r"be) (?:now |still |officially |definitely |)my (?:new |current |all-time |absolute |)(?:favou?rite|fave?) "
        rf"{g.val('thing')}",
        g.favourite,
        "preference",
    ),
    # likes and dislikes, per object
    g.rule(rf"^{g.SUBJ} {g.ADV}(?:{g.NEGATIVE}) {g.val('obj')}", g.likes("no"), "preference"),
    g.rule(
        rf"^{g.SUBJ}{g.BE} {g.ADV}(?:not|no longer) (?:really |)(?:into|a (?:big |huge |)fan of|crazy about) "
        rf"{g.val('obj')}",
        g.likes("no"),
        "preference",
    ),
    g.rule(
        rf"^{g.SUBJ} (?:don't|do not|no longer|never|can't|cannot|won't) (?:really |even |)(?:{g.CONSUME}) "
        rf"{g.val('obj')}",
        g.likes("no"),
        "preference",
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:{g.QUIT}) (?:on )?(?:drinking |eating |smoking |playing |watching |doing "
        rf"|listening to |buying |)(?!(?:my|the|that) (?:[\w'-]+ ){{0,2}}(?:job|place|{g.WORKPLACES_RE})\b)"
        rf"(?!(?:{g.JOB_GERUNDS_RE}) (?:for )?\w){g.val('obj')}",
        g.likes("no"),
        "preference",
    ),
    g.rule(
        r"^(?:I|we) (?:don't|do not|no longer|never) (?P<verb>[a-z]+) (?:anymore|any more|now|these days)$|"
        r"^(?:I|we) no longer (?P<verb2>[a-z]+)$",
        lambda m: g.likes_verb_any(m),
        "preference",
    ),
    g.rule(rf"^{g.SUBJ} {g.ADV}(?:{g.POSITIVE}) {g.val('obj')}", g.likes("yes"), "preference"),
    # "these days I only drink tea": tea, and no other drink the user was said to like
    g.rule(
        rf"^{g.SUBJ} {g.ADV}(?:only|just) (?P<verb>{g.HABIT}) {g.val('obj')}",
        g.only,
        "preference",
    ),
    # habits: "I drink cola every day", "I smoke", "I play squash" (given up by "I stopped drinking cola")
    g.rule(
        rf"^{g.SUBJ} {g.ADV}(?:{g.HABIT}) (?!it\b|that\b|this\b|them\b){g.val('obj')}|^{g.SUBJ} {g.ADV}(?P<obj2>smoke|vape)"
        rf"{g.END}",
        lambda m: (
            g.likes("yes")(m)
            if m.group("obj")
            else (f"user|likes:{v.gerund(m.group('obj2').lower())}", "yes")
        ),
        "preference",
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:taken up|took up|picked up|got back into|gotten back into) {g.val('obj')}|"
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:started|begun|began) (?!(?:working|living|dating|seeing|feeling|"
        rf"thinking|getting|going|having|trying|looking)\b)(?P<obj2>[a-z]+ing){g.END}",
        lambda m: g.likes("yes")(m) if m.group("obj") else g.likes("yes", group="obj2")(m),
        "preference",
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:fallen|fell) (?:hard |head over heels |completely )?in love with "
        rf"(?=(?-i:[a-z]))(?!(?:someone|somebody|him|her|them|a (?:guy|girl|man|woman|boy|lad|lass))\b){g.val('obj')}|"
        rf"^I am {g.ADV}(?:a |an )(?:(?:big|huge|massive|lifelong|die-hard|diehard|mad|massive) )?"
        rf"(?P<obj2>(?!(?:{_NOT_FAN})\b)[\w'-]+(?: (?!(?:{_NOT_FAN})\b)[\w'-]+)?) fan(?=\s*$|\s*[,.;:!?]|\s+(?:and|but|so|"
        r"now)\b)",
        lambda m: g.likes("yes")(m) if m.group("obj") else g.likes("yes", group="obj2")(m),
        "preference",
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:got|gotten|getting|been getting) (?:really |properly |proper |)into "
        rf"(?=(?-i:[a-z])){g.val('obj')}",
        g.likes("yes"),
        "preference",
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:started|begun|began|come|grown|learned|learnt) to {g.ADV}(?:love|like|enjoy|"
        rf"appreciate) {g.val('obj')}|^{g.SUBJ}{g.HAVE} {g.ADV}(?:started|begun|began) (?:liking|loving|enjoying) "
        rf"{g.val('obj2')}",
        lambda m: g.likes("yes")(m) if m.group("obj") else g.likes("yes", group="obj2")(m),
        "preference",
    ),
    g.rule(
        r"^(?P<obj>[\w' -]{1,30}?) (?:is|are|has always been|has been) (?:now |still |definitely |)my "
        r"(?:guilty pleasure|jam|thing|weakness|comfort food|happy place)\b",
        g.likes("yes"),
        "preference",
    ),
    g.rule(
        rf"^{g.SUBJ}{g.BE} {g.ADV}(?:into|a (?:big |huge |massive |)fan of|obsessed with|crazy about|passionate "
        rf"about|addicted to|hooked on|a sucker for|in love with) {g.val('obj')}",
        g.likes("yes"),
        "preference",
    ),
    # relatives: where they live, their name, their job
    g.rule(
        rf"^my {g.ADJ}(?P<rel>{g.RELATIVES_RE})(?:,? (?P<relname>(?-i:[A-Z])[a-z]+),?)?(?: {g.ADV}(?:lives|is living|"
        rf"resides|is based|moved|has moved|relocated|has relocated)|'s {g.ADV}(?:living|based|moved)) "
        rf"{g.ADV}(?:in|to|back to|over to) {g.val('place')}",
        g.relative("home_city", g.group("place", v.place)),
        "relation",
    ),
    g.rule(
        rf"^my {g.ADJ}(?P<rel>{g.RELATIVES_RE})(?:'s name is| is called| is named| goes by) {g.NAME}|"
        rf"^{g.SUBJ} (?:have|'ve got|have got) (?:a|an|one) {g.ADJ}(?P<rel2>{g.RELATIVES_RE}) (?:named|called) (?P<name2>"
        rf"[A-Za-z][\w'-]*){g.END}",
        lambda m: g.relative_name(m),
        "relation",
    ),
    g.rule(
        rf"^my {g.ADJ}(?P<rel>{g.RELATIVES_RE}) is (?:called |named )?(?P<name>(?-i:[A-Z])[a-z]+){g.END}",
        lambda m: g.relative_name(m),
        "relation",
    ),
    g.rule(
        rf"^my {g.ADJ}(?P<rel>{g.RELATIVES_RE})(?: (?P<relname>(?-i:[A-Z])[a-z]+))?(?: is|'s| works as| is working as) "
        rf"{g.ADV}(?:a |an ){g.val('job')}",
        g.relative("job", g.group("job", v.job_known)),
        "relation",
    ),
    g.rule(
        rf"^my {g.ADJ}(?P<rel>{g.RELATIVES_RE})(?: (?P<relname>(?-i:[A-Z])[a-z]+))? {g.ADV}(?:works|is working|started "
        rf"working|got a job) (?:at|for) {g.val('org')}",
        g.relative("employer", g.group("org", v.org)),
        "relation",
    ),
)


def match_slot(core: str) -> SlotMatch | None:
    """The slot a clause sets, or None. `core` starts at the clause's subject (leading dates and adverbs
    already stripped, see `clause_subject.strip_adverbials`) and has no end punctuation."""
    core = g.expand_contractions(core)
    for rule in RULES:
        m = rule.pattern.search(core)
        if m is None:
            continue
        built = rule.build(m)
        if built is not None:
            return SlotMatch(built[0], built[1], rule.kind)
    return None
