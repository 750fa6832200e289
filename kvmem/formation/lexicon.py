"""Word lists the rule extractor reads: occupations, pet species, relatives, demonyms, filler and discourse
markers, each with the canonical form a slot or value uses.

Plain data, general English; knows nothing of patterns or facts (`clauses.py` and `slots.py` read it).
"""

from __future__ import annotations

# Head nouns of occupations: "I'm a <...> <head>" is a job only when the head is one of these, so "I'm a big
# fan" or "I'm a morning person" are not jobs. "I work as a ..." needs no list.
OCCUPATIONS = frozenset(
    """
    accountant actor actress administrator analyst animator architect artist assistant astronomer attorney
    au-pair baker bank-teller barber barista bartender biologist blogger bookkeeper builder butcher buyer
    carpenter cashier caregiver ceo cfo chef chemist cleaner clerk coach consultant cook counselor counsellor
    courier cto dancer dentist designer detective developer dietitian director doctor driver economist editor
    electrician engineer entrepreneur farmer firefighter fisherman freelancer gardener geologist graphic
    hairdresser historian illustrator influencer instructor intern interpreter investor janitor jeweler
    journalist judge lawyer lecturer librarian lifeguard linguist mechanic manager marketer mathematician
    midwife model musician nanny neurologist nurse nutritionist officer operator optician painter paralegal paramedic
    pharmacist photographer physician physicist physiotherapist pilot plumber poet police policeman
    policewoman politician postman producer professor programmer psychiatrist psychologist publisher
    receptionist recruiter reporter researcher salesman saleswoman salesperson scientist secretary
    shopkeeper singer soldier statistician student surgeon surveyor tailor teacher technician therapist
    trainer translator tutor veterinarian vet waiter waitress welder writer youtuber streamer sailor
    carer cook mechanic realtor banker broker copywriter tester sysadmin guide guard
    associate attendant inspector dispatcher
    controller signaller signalman supervisor adviser advisor solicitor barrister registrar
    radiographer sonographer postie labourer laborer roofer plasterer joiner bricklayer
    landscaper florist beautician stylist childminder machinist rigger deckhand shepherd
    brewer fishmonger grocer concierge auditor actuary underwriter postdoc hygienist
    optometrist podiatrist chiropractor osteopath gp anaesthetist curator archivist
    videographer glazier locksmith groundsman greenkeeper jockey zookeeper constable
    fireman doorman trucker foreman forewoman headteacher headmaster headmistress
    chaplain vicar priest rabbi imam pastor undertaker doula sommelier teller estimator draughtsman draftsman
    proofreader merchandiser telemarketer assessor valuer auctioneer croupier paramedic
    """.split()
)

# Pet species as said -> the species a name slot is kept under ("user|dog.name").
SPECIES = {
    "dog": "dog",
    "puppy": "dog",
    "pup": "dog",
    "doggo": "dog",
    "cat": "cat",
    "kitten": "cat",
    "kitty": "cat",
    "rabbit": "rabbit",
    "bunny": "rabbit",
    "hamster": "hamster",
    "guinea pig": "guinea_pig",
    "parrot": "parrot",
    "budgie": "parrot",
    "bird": "bird",
    "fish": "fish",
    "goldfish": "fish",
    "turtle": "turtle",
    "tortoise": "tortoise",
    "horse": "horse",
    "pony": "horse",
    "snake": "snake",
    "lizard": "lizard",
    "gecko": "lizard",
    "ferret": "ferret",
    "rat": "rat",
    "mouse": "mouse",
}

# Relatives as said -> the subject their slots are kept under ("sister|home_city"). Those in
# NEEDS_NAME are rarely unique ("my friend"), so they get a slot only with a name: "friend:tom|home_city".
RELATIVES = {
    "mom": "mother",
    "mum": "mother",
    "mother": "mother",
    "mama": "mother",
    "dad": "father",
    "father": "father",
    "papa": "father",
    "sister": "sister",
    "sis": "sister",
    "brother": "brother",
    "bro": "brother",
    "wife": "wife",
    "husband": "husband",
    "partner": "partner",
    "boyfriend": "boyfriend",
    "girlfriend": "girlfriend",
    "fiance": "fiance",
    "fiancé": "fiance",
    "fiancee": "fiance",
    "fiancée": "fiance",
    "son": "son",
    "daughter": "daughter",
    "grandma": "grandmother",
    "grandmother": "grandmother",
    "granny": "grandmother",
    "grandpa": "grandfather",
    "grandfather": "grandfather",
    "aunt": "aunt",
    "uncle": "uncle",
    "boss": "boss",
    "roommate": "roommate",
    "flatmate": "roommate",
    "best friend": "best_friend",
    "friend": "friend",
    "cousin": "cousin",
    "neighbor": "neighbour",
    "neighbour": "neighbour",
    "colleague": "colleague",
    "coworker": "colleague",
    "co-worker": "colleague",
}
NEEDS_NAME = frozenset({"friend", "cousin", "neighbour", "colleague"})

# "I'm Portuguese" is a nationality, not a name.
DEMONYMS = frozenset(
    """
    american argentinian australian austrian belgian brazilian british bulgarian canadian chilean chinese
    colombian croatian cuban czech danish dutch egyptian english estonian filipino finnish french german
    greek hungarian indian indonesian irish israeli italian japanese kenyan korean latvian lithuanian
    mexican moroccan nigerian norwegian pakistani peruvian polish portuguese romanian russian scottish
    serbian slovak spanish swedish swiss taiwanese thai turkish ukrainian vietnamese welsh
    """.split()
)
# Capitalized words after "I'm" that are not names either.
NOT_NAMES = DEMONYMS | frozenset(
    """
    catholic christian muslim jewish buddhist hindu atheist agnostic vegan vegetarian ok okay fine good great
    back here home sorry sure ready done not so very just also still really
    """.split()
)

# Diets as said -> value.
DIETS = {
    "vegetarian": "vegetarian",
    "veggie": "vegetarian",
    "vegan": "vegan",
    "pescatarian": "pescatarian",
    "pescetarian": "pescatarian",
    "flexitarian": "flexitarian",
    "keto": "keto",
    "gluten-free": "gluten-free",
    "gluten free": "gluten-free",
    "paleo": "paleo",
    "plant-based": "vegan",
    "plant based": "vegan",
}

# Relationship states as said -> value of user|relationship.
RELATIONSHIP = {
    "single": "single",
    "married": "married",
    "engaged": "engaged",
    "divorced": "divorced",
    "separated": "separated",
    "widowed": "widowed",
    "a widow": "widowed",
    "a widower": "widowed",
    "in a relationship": "in a relationship",
    "taken": "in a relationship",
    "seeing someone": "in a relationship",
    "dating someone": "in a relationship",
}

# Whole clauses (lowercased, end punctuation stripped) that are conversation, not memory, even though they
# start with "I": reactions, acknowledgements, transient states.
FILLER_CLAUSES = frozenset(
    """
    i see|i agree|i understand|i think so|i don't think so|i don't know|i dunno|i'm not sure|i am not sure|i guess
    |i guess so|i hope so|i suppose|i suppose so|i'm good|i'm fine|i'm ok|i'm okay|i'm alright|i am fine
    |i'm doing well|i'm doing good|i'm doing great|i'm doing fine|i'm doing ok|i'm doing okay|i'm great
    |i'm back|i'm here|i mean|i know|i know right|i think|i'm glad|i'm so glad|i appreciate it|i'm in|i'm sure
    |i was joking|i'm kidding|i'm just kidding|i get it|i got it|i will|i'll try|i can't wait|i'm so excited
    |i'm excited|my bad|my pleasure|i'm sorry|i'm ready|i'm done|i'm curious|i'm confused|i'm bored
    |i'm tired|i'm so tired|i'm hungry|i'm sleepy|i'm busy|i'm lost|i'm listening|i'm all ears|i did
    |i do|i don't|i didn't|i am|i'm not|i have|i haven't|i can|i can't|i was|i wasn't|me too|i'm off
    |i'm heading out|i have to go|i gotta go|i need to go|i'm going to bed|i'm off to bed|i'm leaving
    |i'll be back|i'm on it|i'm impressed|i'm shocked|i'm surprised|i feel better|i love you|i like you
    |we'll see|i'm thinking|i was thinking|i'm wondering|i'm just curious|i'm just wondering
    |i got distracted|i got sidetracked|i got carried away|i lost my train of thought|i forgot what i was saying
    |i swear|i swear down|i kid you not|i tell you|i tell ya|i promise|i said yes|i said no|i'm telling you
    """.replace("\n", "")
    .replace("    ", "")
    .split("|")
)

# Words that open a sentence or clause without carrying meaning; stripped before anything else.
DISCOURSE_MARKERS = (
    "oh and",
    "oh",
    "ah",
    "well",
    "so",
    "ok so",
    "okay so",
    "ok",
    "okay",
    "alright",
    "all right",
    "um",
    "uh",
    "umm",
    "hmm",
    "haha",
    "hahaha",
    "lol",
    "btw",
    "by the way",
    "anyway",
    "anyways",
    "actually",
    "also",
    "plus",
    "and",
    "but",
    "yeah",
    "yes",
    "yep",
    "yup",
    "no",
    "nope",
    "nah",
    "hey",
    "hi",
    "hello",
    "hiya",
    "heh",
    "honestly",
    "basically",
    "just so you know",
    "fyi",
    "fun fact",
    "quick update",
    "update",
    "news",
    "big news",
    "good news",
    "some news",
    "good news for once",
    "long story short",
    "plot twist",
    "believe it or not",
    "hard to believe",
    "it's hard to believe",
    "correction",
    "sorry",
    "wait",
    "no wait",
    "oops",
    "ugh",
    "wow",
    "good morning",
    "good evening",
    "good afternoon",
    "thanks",
    "thank you",
    "great",
    "cool",
    "nice",
    "sure",
    "right",
    "true",
    "guess what",
    # thanks before news: "Alhamdulillah I am now working as pharmacist", "Thank god I've found a flat"
    "alhamdulillah",
    "thank god",
    "thank goodness",
    "praise god",
    "remember",
    "as i said",
    "as i mentioned",
    "like i said",
    "to be honest",
    "tbh",
    "oh yeah",
    "oh right",
    "oh by the way",
    "speaking of which",
    "i meant",
    "i mean",
    "what i meant is",
    "what i meant was",
)

# Chat drops the subject: "Moved to Berlin last month", "Been living here since 2020", "Can't stand jazz".
# A clause opening with one of these is read as the user's own statement, with the subject put back.
PAST_VERBS = frozenset(
    """
    went got saw met came left took made ate drank bought began found gave told felt ran won lost sold spent
    paid wrote broke flew drove caught kept brought heard sent slept swam threw woke wore had did became quit
    grew built drew fell forgot hit hurt knew led lent rode rang rose sang sank shook shot spoke stole stood
    struck swore taught tore understood wept laid
    """.split()
)
# Words ending in "ed" that are no past tense ("I need", "the Red Cross").
ED_NOT_PAST = frozenset({"need", "feed", "seed", "speed", "bed", "red", "shed", "weed", "indeed", "ted"})
# "Married with two kids", "Allergic to cats": the dropped words are "I'm".
DROPPED_BE = frozenset(
    """
    based married engaged divorced separated widowed retired allergic intolerant obsessed single vegan
    vegetarian pescatarian pregnant unemployed employed located settled originally currently
    """.split()
)
# ... and "I": adverbs and auxiliaries that only open a statement.
DROPPED_I = frozenset(
    """
    can't cannot don't didn't won't haven't hasn't wasn't never just finally recently also still really
    totally absolutely kinda love loved hate hated like liked enjoy enjoyed adore adored prefer started cut
    """.split()
)
# Subject-less openings that are conversation, not statements ("Just kidding", "Don't worry").
SUBJECTLESS_FILLER = frozenset(
    """
    just kidding|just wondering|just curious|just checking|just saying|never mind|don't worry|don't mention it
    |made my day|got it|got you|been there|been there done that|love it|love that|love this|loved it|liked it
    |hate it|hate that|can't wait|can't complain|can't believe it|totally agree|really agree|totally|really
    |kinda|can't argue with that|don't know|didn't know|never heard of it|just a thought|got distracted
    |got sidetracked|got carried away
    """.replace("\n", "")
    .replace("    ", "")
    .split("|")
)

# Work named by what one does ("I quit teaching", "I gave up nursing"): leaving it is leaving a job, not a
# dislike. Gerunds of occupations and fields of work.
JOB_GERUNDS = frozenset(
    """
    teaching nursing farming accounting acting modelling modeling coaching tutoring bartending waitressing
    waiting cleaning plumbing policing consulting freelancing engineering banking lecturing lawyering
    hairdressing cooking baking driving trucking sailing fishing mining translating editing reporting
    journalism law medicine dentistry retail hospitality sales marketing programming nannying babysitting
    catering construction carpentry dancing singing writing photography design research academia
    """.split()
)
# Fields of work one goes into ("I've gone into comms"), beyond the gerunds above.
FIELDS = frozenset(
    {
        *"""comms communications insurance finance banking marketing sales retail hospitality it tech software
        consulting consultancy management hr recruitment journalism pr politics property accountancy engineering
        construction academia research publishing advertising design catering farming fashion pharmacy dentistry
        physio nursing teaching law medicine policing government logistics healthcare education nhs admin
        administration compliance audit""".split(),
        "social work", "care work", "the civil service", "the police", "the army", "the navy", "the raf",
        "local government", "the nhs", "it support", "customer service", "customer services",
    }
)  # fmt: skip
# Nouns naming a workplace or a post: "I quit the cafe", "I left my firm" leave a job.
WORKPLACES = frozenset(
    """
    job jobs work company firm shop store restaurant cafe café bar pub bakery bank hospital clinic school
    office agency factory warehouse practice studio salon position role post team business department lab
    startup start-up gig career employer workplace plant mill hotel kitchen newsroom branch surgery
    centre center practise nursery university college council steakhouse diner chippy brewery distillery
    supermarket dealership rigs rig
    """.split()
)
# The user's divorce through: "The decree absolute came through", "My divorce is final" (the caller says what may follow)
DIVORCE_THROUGH = (
    r"(?:the|my|our) (?:divorce|decree absolute)(?: papers)? (?:has |have |finally |just )*(?:came through|come "
    r"through|went through|gone through|is (?:now |finally )?final|(?:was|got|been) finali[sz]ed)"
)
# Who gives the user a job, as a subject: "they", "the new battery plant", "my boss" (and, for hiring, a
# capitalised name: "Tesco took me on"); not "lockdown made me a baker", "my kids made me a taxi driver"
_EMPLOYER_NOUNS = "|".join(
    sorted(WORKPLACES | {"boss", "manager", "bosses", "management", "owner", "owners"}, key=len, reverse=True)
)
EMPLOYER_SUBJECT = rf"(?:they|(?:the|my|our) (?:[\w'-]+ ){{0,3}}?(?:{_EMPLOYER_NOUNS}))(?:'ve| have)?"
HIRER_SUBJECT = rf"(?:{EMPLOYER_SUBJECT}|(?-i:[A-Z])[\w&'-]*(?: (?-i:[A-Z])[\w&'-]*)?(?:'ve| have)?)"

# things the user jokes of as a partner ("Coffee and I are not together anymore", "Netflix and me broke up"): not a
# name before "and I" / "and me"
JOKED_PARTNERS = (
    r"coffee|tea|netflix|chocolate|wine|beer|gin|sugar|carbs|cheese|pizza|bread|meat|dairy|booze|alcohol|caffeine|"
    r"cigarettes|smoking|vaping|gym|work|football|running|twitter|instagram|tiktok|facebook|snapchat|life|money|sleep"
)

# the user's partner, as chat names them ("my wife", "the missus", "me and the gf")
PARTNER_NOUNS = r"(?:wife|husband|partner|girlfriend|boyfriend|fianc\w*|bf|gf|other half|missus|hubby)"

# words that carry no content of their own, for comparing two statements' words
STOP_WORDS = frozenset(
    "i i'm i've my me we our the a an to of in on at for and but or is am are was were be been have has had "
    "do does did it its this that with as now so just user user's they their".split()
)
