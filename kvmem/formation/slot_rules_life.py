"""The slot table's rules for the three single-valued areas of a life, read in this order: home (where the user lives
now), relationship status, and job and employer. A change in one of them retires the value it replaces, so these are
the readings a change of state turns on (issue 45 item 3). Part of `slots.RULES`, which puts them after the contact,
age and origin rules and before diet, pets and tastes; the first pattern whose builder accepts a match wins.
"""

from __future__ import annotations

from kvmem.formation import slot_grammar as g
from kvmem.formation import values as v
from kvmem.formation.lexicon import (
    DIVORCE_THROUGH,
    EMPLOYER_SUBJECT,
    HIRER_SUBJECT,
    PARTNER_NOUNS,
    RELATIONSHIP,
)
from kvmem.formation.slot_grammar import SlotRule

_HOME = (
    r"flat|house|terrace|terraced house|semi|bungalow|apartment|condo|two-bed|one-bed|three-bed|maisonette|"
    r"townhouse|bedsit|council house|council flat"
)
_BUSINESS = (
    r"farm|pub|cafe|café|b&b|bakery|restaurant|salon|business|hotel|deli|takeaway|chippy|guest ?house|kennels"
)
# where one stays a night, or what one stays in that is no place ("I stay in Travelodge", "I stay in Discord")
_LODGING = (
    r"(?-i:[A-Z])\w* (?:Inn|Hotel|Lodge|Hostel|Parcs?)|Inn|Hotel|Hostel|Halls?|Hilton|Marriott|Travelodge|Premier|Ibis|"
    r"Airbnb|Center|Centre|Discord|Skyrim|Minecraft|Bed|Uni|College|Church"
)
# a place said last in its clause: "in Derby", "in Dublin 8" (not "in Derby, for my son")
_PLACE_LAST = r"(?P<place>(?-i:[A-Z])[\w'-]*(?: (?:(?-i:[A-Z])[\w'-]*|\d+))*)(?=\s*$)"
# nothing after, or only a day: the clause ends there ("... on 2026-04-27", "... in the week of 2026-04-20")
_THEN_END = (
    r"(?=(?:\s+(?:on \d{4}-\d\d-\d\d|in the (?:week|weekend) of \d{4}-\d\d-\d\d|on the (?:morning|afternoon|evening|"
    r"night) of \d{4}-\d\d-\d\d|yesterday|today|this (?:week|morning)|last (?:week|month)))?\s*$)"
)
_PARTNER = PARTNER_NOUNS
# a partner "left me" as the clause's end, or before a time or whom for: not "left me in charge of the kids"
_LEFT_END = r"(?=\s*$|\s*[,.;:!?]|\s+(?:for|after|last|yesterday|this|on|and|but|so|because)\b)"

LIFE_RULES: tuple[SlotRule, ...] = (
    # home: where the user lives now (a city or a country: one slot, so either kind of move supersedes)
    g.rule(
        rf"^{g.SUBJ} {g.ADV}(?:live|reside) {g.ADV}in (?:a|an|the|my|our) [\w' -]{{1,30}}? in {g.val('place')}",
        g.user("home_city", g.group("place", v.place)),
    ),
    g.rule(
        rf"^{g.SUBJ} {g.ADV}(?:live|reside) {g.ADV}in {g.val('place')}",
        g.user("home_city", g.group("place", v.place)),
    ),
    # "I live with my parents in Kraków" (not "I live with my parents in term time": a capitalised place)
    g.rule(
        rf"^{g.SUBJ} {g.ADV}live with (?:my|our|the|a) (?:[\w'-]+ ){{0,2}}?(?:parents|folks|family|mum|mom|dad|"
        r"mother|father|partner|wife|husband|girlfriend|boyfriend|gran|granny|nan|nana|grandma|grandparents|aunt|uncle|"
        r"sister|brother|"
        r"kids|children|son|daughter|flatmates?|roommates?|housemates?|friends?|in-laws|cousins?|dog|cat)"
        r" in (?!(?:january|february|march|april|may|june|july|august|september|october|november|december|ramadan|"
        r"lockdown|christmas|easter|term|halls?|zone|summer|winter|holidays?|airbnbs?|the)\b)"
        r"(?P<place>(?-i:[A-Z])[a-z][\w'-]*(?<!'s)(?: (?-i:[A-Z])[a-z][\w'-]*(?<!'s))?)\s*$",
        g.user("home_city", g.group("place", v.place)),
    ),
    # "I stay in Durban" (South African, Scottish, Indian, West African English: where one lives), a capitalised
    # place said last or before a comma and where in it (not "I stay in hotels", "I stay in on Fridays", "I stay in
    # Rome for a week", "I stay in London, Monday to Friday", "I stay in Travelodge", "I stay in Discord all night")
    g.rule(
        rf"^(?!.*\b(?:for|during|until|till|temporarily|every|when|whenever|while|half|weekdays?|weekends?|summer|"
        rf"winter|holidays?|term|monday|friday)\b){g.SUBJ} {g.ADV}stay {g.ADV}in (?!(?:{_LODGING})\b)"
        r"(?P<place>(?-i:[A-Z])[\w'-]*(?: (?-i:[A-Z])[\w'-]*){0,2})(?=\s*$|, (?:near|close to|by|in|on|off|just) )",
        g.user("home_city", g.group("place", v.place)),
    ),
    # "I'm in Leeds now": a capitalised place and a word saying it is the present state, said last (not "I'm in
    # Hospital now", "I'm in the Army now")
    g.rule(
        rf"^{g.SUBJ}{g.BE} (?:in|based in|settled in|out in|up in|down in) (?!(?:hospital|hospice|rehab|prison|jail|"
        r"church|school|uni|college|work|bed|office|A&E|ICU|ER)\b)(?P<place>(?-i:[A-Z])[\w'-]*(?: (?-i:[A-Z])"
        r"[\w'-]*){0,2}) (?:now|these days|nowadays|for good)"
        # or before a home of their own: "We're in Jersey City now, closed on the condo last month", "I'm in
        # Christchurch now, renting two streets from my brother" (not "I'm in Rome now, staying at a hostel",
        # "renting a moped", "renting a villa for the holiday", "bought a flat for my sister", "closed on the deal")
        r"(?:$|, (?!.*\b(?:for|holiday|week|weekend|conference|trip|airbnb|hotel|hostel|villa|cabin|till|until|through|"
        r"during|over|while|short-term|term|internship|project|monday|tuesday|wednesday|thursday|friday|saturday|sunday|"
        r"backpackers|at the|here|summer|winter|staying|tonight|tomorrow)\b)(?:renting "
        r"(?:a |an |our |my )?(?:room|flat|house|place|apartment|studio|bedsit)\b|renting (?:\w+ )?(?:streets?|doors?|"
        r"minutes?) from\b|(?:closed on|bought) (?:a|the|our|my) (?:house|flat|condo|apartment|place|"
        r"bungalow|home)\b))",
        g.user("home_city", g.group("place", v.place)),
    ),
    g.rule(
        rf"^{g.SUBJ} (?:no longer|don't|do not) (?:live|reside) in {g.val('place')}|"
        rf"^{g.SUBJ}{g.BE} (?:no longer|not) (?:living|based) in {g.val('place2')}(?=\s+(?:anymore|any more)\b)|"
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:moved|moved away) (?:away |out )?from {g.val('place3')}",
        g.user(
            "home_city",
            g.negated(v.place, "place", "place2", "place3"),
        ),
    ),
    g.rule(
        rf"^{g.SUBJ}{g.BE} {g.ADV}(?:living|based|settled|residing) {g.ADV}in {g.val('place')}",
        g.user("home_city", g.group("place", v.place)),
    ),
    g.rule(
        rf"^{g.SUBJ}(?:'ve| have) {g.ADV}(?:been living|lived) {g.ADV}in {g.val('place')}(?=\s+(?:for|since|now)\b)",
        g.user("home_city", g.group("place", v.place)),
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:moved|relocated|emigrated|immigrated|moved back|moved over|moved out|moved up|moved down) "
        rf"{g.ADV}(?:back |over |here |all the way )?to {g.val('place')}",
        g.user("home_city", g.group("place", v.place)),
    ),
    # a new home taken: "Got the keys to my new place in Porto", "We've moved into our new flat in Leeds"
    # (not one taken for a while or for something else: "for the summer", "for my pottery", "that does pizza")
    g.rule(
        rf"^(?!.*\s(?:for|that)\s){g.SUBJ}{g.HAVE} {g.ADV}(?:(?:got the keys (?:to|for)|moved into) (?:my |our |a |the )"
        rf"(?:own |new |first )*(?:home|flat|house|apartment|place|condo|one-bed|studio flat|bungalow|cottage)|"
        rf"(?:completed|closed) on (?:my |our |a |the )(?:new )?(?:home|flat|house|apartment|place|condo|bungalow|cottage)|"
        rf"(?:bought|got|found|rented) (?:my |our |a )(?:(?:own |first )*new|(?:new )?(?:own|first|proper)) "
        rf"(?:home|flat|house|apartment|condo|one-bed|studio flat|bungalow|cottage))(?: of (?:my|our) own)? "
        rf"(?:here )?in {g.val('place')}",
        g.user("home_city", g.group("place", v.place)),
    ),
    # a home rented, the place said last ("We rent a semi in Coventry"): not one for a while, for something or for
    # someone else ("for the winter", "that we let out", "a friend with a flat"); not one owned or "got", which may
    # be a second home ("We've got a place in Spain", "I own a flat in Sheffield but I rent in Manchester")
    g.rule(
        rf"^(?:I|we) {g.ADV}(?:rent|are renting|am renting) (?:a|an) (?:(?:little|small|tiny|big|lovely|new|"
        rf"rented|terraced|semi-detached|\w+-bed(?:room)?) )?(?:{_HOME}) in {_PLACE_LAST}",
        g.user("home_city", g.group("place", v.place)),
    ),
    # "We've packed up and gone to Joburg now", "Packed up and moved over to Perth": the place said last (not "to
    # Mum's", "to Spain for the summer")
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}packed up and (?:gone|moved|relocated) (?:back |over |up |down )?to "
        r"(?!(?:Mum|Mom|Mam|Dad|Nan|Gran|Grandma|Granny|Auntie)\b)(?P<place>(?-i:[A-Z])[\w'-]*(?: (?-i:[A-Z])[\w'-]*)*)"
        r"(?=\s*$|\s+now\s*$)",
        g.user("home_city", g.group("place", v.place)),
    ),
    # "We've moved back home to Cork" (not "I went home to Sligo for the weekend", "I've gone home to Mum")
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}moved (?:back )?home to {_PLACE_LAST}",
        g.user("home_city", g.group("place", v.place)),
    ),
    g.rule(
        r"^(?:my|our) (?:new |current |)(?:home|flat|house|apartment|place) is (?:now )?in " + g.val("place"),
        g.user("home_city", g.group("place", v.place)),
    ),
    g.rule(
        r"^home (?:is|for me is) (?:now )?(?:in )?"
        + g.val("place")
        + r"|^(?P<place2>[\w' -]{1,30}?) is (?:now )?"
        r"(?:my )?home\b",
        g.user("home_city", lambda m: v.place(m.group("place") or m.group("place2"))),
    ),
    g.rule(
        rf"^{g.SUBJ} {g.ADV}call (?P<place>[^,.;!?]+?) (?:my )?home\b",
        g.user("home_city", g.group("place", v.place)),
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:made|make) the (?:big |)move {g.ADV}(?:back |over |)to {g.val('place')}|"
        rf"^{g.SUBJ}(?:'ve| have) {g.ADV}been in {g.val('place2')}(?=\s+(?:for|since)\b)",
        g.user("home_city", lambda m: v.place(m.group("place") or m.group("place2"))),
    ),
    # relationship status
    g.rule(
        rf"^I{g.BE} {g.ADV}(?P<rs>{g.RELATIONSHIP_RE})\b(?!-)",
        g.user("relationship", g.lookup("rs", RELATIONSHIP)),
        "relation",
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE}{g.BE}? {g.ADV}(?:(?:got|gotten) (?:re)?|re)(?P<rs>married|engaged|divorced|"
        r"separated)\b|"
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?P<rs2>remarried)\b",
        g.user("relationship", lambda m: RELATIONSHIP.get((m.group("rs") or "married").lower())),
        "relation",
    ),
    # a marriage held for a time, and nothing after ("I've been married to Clive for 23 years"; not "... for ten
    # years before the divorce", "... until he died", "... to my job")
    g.rule(
        rf"^I have {g.ADV}been (?:happily )?married(?: to (?-i:[A-Z])[a-z]+)? (?:for (?:\w+ ){{1,3}}(?:years?|months?)|"
        r"since \w+)(?: now)?\s*$",
        g.user("relationship", g.fixed("married")),
        "relation",
    ),
    # "Tom proposed and I said yes", "I'm a husband now"
    g.rule(
        r"^(?!.*\bthat\b)(?!.*\band (?!I\b)\w+ said yes)"
        r"(?:(?-i:[A-Z])[a-z]+|my (?:boyfriend|girlfriend|partner|bf|gf|other half)) (?:finally |just )?proposed"
        r"(?=\s*$|\s+(?:to me|on|at|in|last|yesterday|this|after|while|during|and|over|when)\b)",
        g.user("relationship", g.fixed("engaged")),
        "relation",
    ),
    g.rule(
        rf"^I{g.BE} {g.ADV}(?:a )?(?:husband|wife) now\b|^I{g.BE} {g.ADV}(?:now )?(?:a )?married (?:man|woman)\b",
        g.user("relationship", g.fixed("married")),
        "relation",
    ),
    g.rule(
        r"^(?-i:[A-Z])[a-z]+ (?:is|'s) (?:now |officially )?my (?P<rel>wife|husband|fianc\w*|girlfriend|boyfriend|"
        r"partner)\b",
        g.user(
            "relationship",
            lambda m: {"wife": "married", "husband": "married"}.get(
                m.group("rel").lower(),
                "engaged" if m.group("rel").lower().startswith("fianc") else "in a relationship",
            ),
        ),
        "relation",
    ),
    g.rule(
        rf"^{g.SUBJ}{g.BE}{g.HAVE} {g.ADV}(?:getting divorced|getting a divorce|going through a divorce)\b",
        g.user("relationship", g.fixed("divorced")),
        "relation",
    ),
    # the divorce through, said last or before a day (not "... came through for my sister", "... in 1998")
    g.rule(
        rf"^{DIVORCE_THROUGH}{_THEN_END}",
        g.user("relationship", g.fixed("divorced")),
        "relation",
    ),
    g.rule(
        rf"^(?:{g.SUBJ}|we){g.BE} {g.ADV}(?:no longer|not) together\b|^{g.SUBJ}{g.BE} {g.ADV}not together "
        r"(?:anymore|any more)\b|"
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:called off|cancelled|canceled|broke off|broken off) (?:the|our|my) "
        r"(?:engagement|wedding)\b|^(?:the|our|my) engagement(?: is|'s) (?:off|over)\s*$|"
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:called|broke|broken) (?:the|our|my) engagement off{_THEN_END}|"
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}called it quits\b(?!\s+(?:on|with) (?!\d))|"
        rf"^I{g.BE} {g.ADV}no longer (?:with|together with|dating|seeing) (?-i:[A-Z])[a-z]+{g.END}|"
        rf"^I{g.HAVE} {g.ADV}(?:dumped|broke up with|split up with|split from|divorced|separated from) "
        r"(?:my (?:wife|husband|partner|girlfriend|boyfriend|fianc\w*)\b|(?-i:[A-Z])[a-z]+$)|"
        rf"^I{g.HAVE} {g.ADV}left my (?:wife|husband|partner|girlfriend|boyfriend|fianc\w*)\b|"
        r"^(?-i:[A-Z])[a-z]+ (?:just |)(?:broke up with me|dumped me|left me|ended things with me|ended it with me|"
        rf"divorced me|split up with me){_LEFT_END}|"
        r"^(?:the|my) (?:missus|wife|husband|hubby|other half|partner|girlfriend|boyfriend|bf|gf) (?:has |'s )?"
        rf"(?:just |)(?:broke up with me|dumped me|left me|ended things with me|ended it with me|divorced me|split up "
        rf"with me|ghosted me|walked out on me){_LEFT_END}",
        g.user("relationship", g.fixed("single")),
        "relation",
    ),
    g.rule(
        rf"^(?:{g.SUBJ}{g.HAVE} {g.ADV}(?:broke up|broken up|split up|separated|called it off|ended things)|"
        rf"^(?:(?-i:[A-Z])[a-z]+|my {_PARTNER}) and I{g.HAVE} {g.ADV}called it (?:a day|quits)(?=\s*$|\s+(?:after|for good)\b)|"
        rf"^my {_PARTNER} and I{g.BE} (?:officially )?(?:done|over|finished)\s*$|"
        r"^(?:my|me and my) (?:ex-?)?(?:girlfriend|boyfriend|partner|wife|husband|fiancée?|fiance)"
        r"(?: and I)? (?:just |recently |finally )?(?:broke up|split up|separated|left me|dumped me|"
        r"divorced me))\b",
        g.user("relationship", g.fixed("single")),
        "relation",
    ),
    g.rule(
        rf"^I{g.HAVE} {g.ADV}(?:have|got|have got|now have|found) (?:a |an )?(?:new |lovely |)"
        r"(?:girlfriend|boyfriend|partner)\b|"
        rf"^I(?:{g.BE}|(?:'ve| have) been) {g.ADV}(?:dating|seeing|going out with|together with|in a relationship "
        r"with) \w|^we{g.BE} {g.ADV}(?:together|a couple|an item|dating|going out)(?:{g.END})",
        g.user("relationship", g.fixed("in a relationship")),
        "relation",
    ),
    # job and employer: leaving one ("I quit the cafe", "I quit teaching", "I resigned from Boots"), not a
    # workplace left for the day ("I left the office early", "I just left work not too long ago": REALTALK)
    g.rule(
        # (not "I've just left the office", "I just left work": the day's work done)
        r"^(?!I(?:'ve| have)? just left (?:the |my )?(?:office|work|site|shift|ward|school|hospital|shop|store|gym|"
        r"studio|depot|warehouse|yard|surgery|clinic|salon|restaurant|cafe|bar|pub|hotel|kitchen|factory|plant)\b"
        rf"(?! for good| for the last time| after))I{g.HAVE} {g.ADV}(?:{g.LEAVE}) (?:my |the |a |our |this |that )?"
        rf"(?:[\w'-]+ ){{0,2}}(?:{g.WORKPLACES_RE})\b(?!{g.FOR_THE_DAY})|"
        rf"^I{g.HAVE} {g.ADV}(?:{g.LEAVE}|gave up|given up|stopped|retired from|am done with|'m done with) "
        rf"(?:{g.JOB_GERUNDS_RE}){g.END}|"
        rf"^I{g.HAVE} {g.ADV}(?:resigned|handed in my notice|gave my notice|gave notice)(?! (?:on|for) (?:the|my|our) "
        rf"(?:flat|house|apartment|place|room|lease|tenancy|car|allotment|unit)\b)(?:{g.END}|\s+(?:from|at)\b)|"
        rf"^I{g.HAVE} {g.ADV}(?:got|been given|was given) the sack(?: from (?:work|my job))?{_THEN_END}",
        g.user("job", g.fixed("none")),
    ),
    g.rule(
        rf"^I{g.HAVE} {g.ADV}(?:{g.LEAVE}) {g.ORG_NAME}{g.END}|"
        rf"^I (?:no longer|don't|do not) work (?:at|for) (?:the )?(?P<org2>[^,.;:!?()\"]+?){g.END}|"
        rf"^I{g.BE} {g.ADV}(?:no longer|not) (?:working |employed )?(?:at|for|with) (?:the )?"
        rf"(?P<org3>(?-i:[A-Z])[^,.;:!?()\"]*?)(?=\s+(?:anymore|any more)\b)",
        g.user("employer", g.negated(v.org, "org", "org2", "org3")),
    ),
    g.rule(
        rf"^I{g.HAVE} {g.ADV}(?:quit|left|lost|resigned from|walked away from|handed in my notice at|gave up|given up) "
        r"(?:my|the) (?:\w+ )?job\b(?! (?:application|interview|offer|search|hunt|hunting|ad|advert|listing|fair|"
        r"spec))|"
        rf"^I{g.HAVE} {g.ADV}(?:got|was|been|were|got myself) (?:fired|laid off|let go|made redundant|sacked)\b|"
        rf"^I{g.BE} {g.ADV}(?:unemployed|jobless|out of work|between jobs|not working(?! (?:today|tonight|"
        r"tomorrow|the day|the now|the morra|this (?:week|weekend|morning|afternoon|evening|shift)|"
        r"next (?:week|weekend)|on \d{4}-|on (?:the )?\w+days?|at (?:the )?weekends?|weekends|(?:over )?christmas|"
        r"for (?:the )?(?:day|week|weekend|night)|"
        r"till (?!further)|until (?!further))\b))\b|"
        # "I've been unemployed since March" (not "... before", "... twice", "out of work with flu")
        rf"^I(?:'ve| have) been {g.ADV}(?:unemployed|jobless|between jobs)(?= since\b)",
        g.user("job", g.fixed("none")),
    ),
    g.rule(
        rf"^I(?:'m| am|'ve| have)? {g.ADV}(?:retired|been retired)\b(?! (?:my|our|his|her|their|it|them|"
        r"those|these)\b| (?:the|an?) (?:old|broken|worn)\b)|"
        rf"^I{g.HAVE} {g.ADV}(?:went into|gone into|took|taken|started|began|entered|am in|'m in) (?:early |)retirement\b|"
        rf"^I{g.BE} {g.ADV}(?:a |an )?(?:retiree|pensioner|retired \w+)\b|"
        # the idioms: "I hung up my stethoscope", "announced my retirement"
        # (what may be hung up for the night too, only "for good", "for the last time", "after N years")
        rf"^I{g.HAVE} {g.ADV}(?:hung|hang) up my (?:stethoscope|spurs|whistle|gavel|cleats)(?=\s*$|\s+(?:for good|"
        r"for the last time|after|at the end of|last|on \d{4}-|in (?:\w+ )?\d{4}\b))|"
        rf"^I{g.HAVE} {g.ADV}(?:hung|hang) up my (?:boots|apron|gloves|uniform|scrubs|tools|badge|helmet|gown|wig|"
        r"clippers|scissors|chalk|pen)(?= for good\b| for the last time\b| after \w+ years\b)|"
        rf"^I{g.HAVE} {g.ADV}(?:announced|confirmed) my retirement(?=\s*$|\s+(?:from|after|on \d{{4}}-|in (?:\w+ )?\d{{4}}))",
        g.user("job", g.fixed("retired")),
    ),
    g.rule(
        rf"^I{g.BE} {g.ADV}(?:no longer|not) (?:a |an ){g.val('job')}(?=\s+(?:anymore|any more)\b|\s*$)",
        g.user("job", g.negated(v.job_known, "job")),
    ),
    # "I have been a X for N years": the job held now
    g.rule(
        rf"^I(?:'ve| have) {g.ADV}been (?:a |an ){g.val('job')}(?=\s+(?:for|since)\b)",
        g.user("job", g.group("job", v.job_held)),
    ),
    # "I work in retail", "I've been working in IT support": a field is the job as far as it was said
    g.rule(
        rf"^I{g.HAVE}{g.BE}? {g.ADV}(?:work|working|been working) in (?P<field>(?-i:[a-z])[a-z -]+?){g.END}",
        g.user("job", g.group("field", v.work_field)),
    ),
    # a new field of work: "I've gone into comms for the ambulance service" (not "gone into labour", "survival mode")
    g.rule(
        rf"^I have {g.ADV}(?:gone|moved|switched|retrained) into (?P<field>{g.FIELDS_RE})"
        r"(?=\s*$|\s+(?:for|at|with) (?:a|an|the|(?-i:[A-Z])))",
        g.user("job", g.group("field", v.work_field)),
    ),
    # "I teach maths at a secondary school": a teacher
    g.rule(
        r"^I (?:still |currently |now |)teach\b(?! (?:myself|my (?:kids|children|son|daughter|dog)\b))",
        g.user("job", g.fixed("teacher")),
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:work|working|started working|began working|been working|'m working|"
        rf"am working|'re working|are working|am employed|are employed|employed|got hired|was hired|been hired|"
        rf"hired|got taken on|was taken on|signed on|started out) {g.ADV}as (?:a |an )?{g.val('job')}|"
        rf"^{g.SUBJ}(?:'ve| have) {g.ADV}worked as (?:a |an )?{g.val('job2')}(?=\s+(?:for|since)\b)",
        g.user("job", lambda m: v.job_any(m.group("job") or m.group("job2"))),
    ),
    g.rule(
        rf"^I{g.HAVE} {g.ADV}(?:got|landed|accepted|started|took|found|began|start|was offered) (?:a |an |my |the )?"
        rf"(?:new |first |dream )?(?:job|position|role|gig)(?: offer)? as (?:a |an )?{g.val('job')}",
        g.user("job", g.group("job", v.job_any)),
    ),
    g.rule(
        rf"^I{g.HAVE} {g.ADV}(?:became|become|got promoted to|was promoted to|retrained as|qualified as) "
        rf"(?:a |an )?{g.val('job')}",
        g.user("job", g.group("job", v.job_known)),
    ),
    g.rule(rf"^I{g.BE} {g.ADV}(?:a |an ){g.val('job')}", g.user("job", g.group("job", v.job_known))),
    # said without the article, before a workplace and a town and nothing else: "I am software architect at a bank in
    # Frankfurt" (not "I'm DJ at my mate's wedding", "I'm bartender at a pub on Saturday night")
    g.rule(
        rf"^I am {g.ADV}(?P<job>[\w-]+(?: [\w-]+)?) (?=(?:at|in|for|with) (?:a|an|the) (?:[\w'-]+ ){{0,2}}"
        rf"(?:{g.WORKPLACES_RE})(?: in (?-i:[A-Z])[\w'-]*(?: (?-i:[A-Z])[\w'-]*)*)?\s*$)",
        g.user("job", g.group("job", v.job_known)),
    ),
    # the job told from the employer's side or as a post filled: "They've made me practice manager", "the plant
    # took me on as a line operator", "I'm the new sous chef at a gastropub"
    g.rule(
        rf"^(?!.*\bfor the (?:weekend|day|night|evening|summer|week)\b)(?:{HIRER_SUBJECT} {g.ADV}(?:promoted me "
        rf"to|took me on as|taken me on as|hired me as)|{EMPLOYER_SUBJECT} {g.ADV}made me(?! the\b)) "
        rf"(?:a |an |the |their )?(?:new )?{g.val('job')}",
        g.user("job", g.group("job", v.job_known)),
    ),
    g.rule(rf"^I{g.BE} {g.ADV}(?:now )?the new {g.val('job')}", g.user("job", g.group("job", v.job_known))),
    # a post taken up at a place, the job said after "as": "Started at the Royal Mint on Monday as a quality inspector",
    # "I have accepted, and commenced, a post as a junior actuary" (an occupation's noun; not "joined the choir as a
    # tenor", "started at the club as a sub", "began life as a chemist", "joined the cast as a dancer", "started at
    # the firm as a trainee back in 1998")
    g.rule(
        r"^(?!.*\b(?:ago|back in|in (?:19|20)\d\d|volunteer\w*|years)\b)"
        rf"I{g.HAVE} {g.ADV}(?:(?:started|began|joined) (?:at|with) |commenced |accepted, and commenced, |"
        r"accepted and commenced )(?:[\w&.'-]+ ){0,6}?(?:on \d{4}-\d\d-\d\d )?as (?:a |an |the )?"
        rf"{g.val('job')}",
        g.user("job", g.group("job", v.job_known)),
    ),
    # "I run a family farm", "We run a B&B in Pitlochry": the business said last (not "a stall on Sundays", "a pop-up
    # cafe, once a month", "a Minecraft farm"; not one owned: "I own a pub, well a share in one")
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}run (?:a|an|my|our) (?:own )?(?!(?:[\w'&-]+ ){{0,2}}?(?:virtual|fantasy|pop-up|online|"
        rf"side|minecraft|roblox)\b)(?P<job>(?:[\w'&-]+ ){{0,2}}(?:{_BUSINESS}))"
        r"(?: in (?-i:[A-Z])[\w'-]*(?: (?-i:[A-Z])[\w'-]*)*)?\s*$",
        g.user("job", lambda m: v.plain(f"runs a {m.group('job')}")),
    ),
    g.rule(
        rf"^{g.SUBJ}{g.HAVE} {g.ADV}(?:work|working|been working|'m working|am working|'re working|are working) "
        rf"{g.ADV}(?:at|for) {g.val('org')}",
        g.user("employer", g.group("org", v.org)),
    ),
    # "Started at the council's housing office on Monday": a workplace (not one a customer starts at: a bank, a
    # restaurant), and only a day after it (not "started at the office at 9", "at the firm in 1995 and left in 2001")
    g.rule(
        rf"^I{g.HAVE} {g.ADV}(?:started|began) (?:work |working )?at (?P<org>(?:the|a|an) (?:(?:[\w'-]+ ){{1,3}}office|"
        r"(?:[\w'-]+ ){0,3}(?:firm|company|agency|factory|warehouse|plant|mill|council|startup|newsroom)))"
        rf"{_THEN_END}",
        g.user("employer", g.group("org", v.org)),
    ),
    g.rule(
        rf"^I{g.HAVE} {g.ADV}(?:got|landed|accepted|started|took|found|began|start|was offered) "
        rf"(?:a |an |my |the )?(?:new |first |dream )?(?:job|position|role|internship|gig)(?: offer)? "
        rf"(?:at|with) {g.val('org')}|"
        rf"^I{g.HAVE} {g.ADV}(?:started|began) (?:working|a new job|my new job|my job) (?:at|for|with) {g.val('org2')}",
        g.user("employer", lambda m: v.org(m.group("org") or m.group("org2"))),
    ),
    g.rule(
        rf"^I{g.HAVE} {g.ADV}(?:accepted|took) (?:an |a |the )?(?:job |work )?offer (?:from|with|at) {g.val('org')}|"
        rf"^my (?:new |current |)(?:employer|company|workplace) is (?:now )?{g.val('org2')}",
        g.user("employer", lambda m: v.org(m.group("org") or m.group("org2"))),
    ),
    g.rule(
        rf"^I{g.HAVE} {g.ADV}joined (?P<org>(?-i:[A-Z])[\w&.'-]*(?: (?-i:[A-Z])[\w&.'-]*)*){g.END}",
        g.user("employer", g.group("org", v.org)),
    ),
)
