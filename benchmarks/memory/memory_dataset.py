"""A deterministic synthetic long-term-memory benchmark: multi-session chats with planted facts and questions.

Owns the data only: per user, sessions of chatter spread over a year, facts planted at random turns, and
questions whose evidence turns are known. Some facts change over time (an early and a late value); their
questions carry a time range that selects one. Questions are written both close to and far from the fact's
wording, so neither keyword nor dense retrieval is favoured by construction. Knows nothing of the store.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

NAMES = [
    "Max",
    "Luna",
    "Biscuit",
    "Pepper",
    "Olive",
    "Mango",
    "Ziggy",
    "Nala",
    "Rocco",
    "Juniper",
    "Tofu",
    "Waffles",
    "Hazel",
    "Otis",
    "Clementine",
    "Basil",
    "Miso",
    "Pickles",
    "Indigo",
    "Sprocket",
]
PEOPLE = [
    "Ana",
    "Priya",
    "Tomasz",
    "Keiko",
    "Ruth",
    "Diego",
    "Ingrid",
    "Malik",
    "Sofia",
    "Ewan",
    "Leila",
    "Bruno",
    "Freya",
    "Omar",
    "Greta",
    "Hugo",
    "Yara",
    "Idris",
    "Nadia",
    "Felix",
]
CITIES = [
    "Lisbon",
    "Oslo",
    "Nairobi",
    "Montreal",
    "Kyoto",
    "Valparaiso",
    "Tbilisi",
    "Porto",
    "Hanoi",
    "Edinburgh",
    "Cusco",
    "Ljubljana",
    "Tallinn",
    "Busan",
    "Marrakesh",
    "Seville",
    "Bergen",
    "Perth",
]
ANIMALS = [
    "beagle",
    "tabby cat",
    "corgi",
    "parrot",
    "rabbit",
    "greyhound",
    "husky",
    "siamese cat",
    "tortoise",
    "labrador",
]
FOODS = ["peanuts", "shellfish", "sesame", "kiwi", "gluten", "strawberries", "cashews", "eggs"]
INSTRUMENTS = ["cello", "banjo", "ukulele", "saxophone", "harp", "drums", "violin", "accordion"]
JOBS = [
    ("nurse", "St. Brigid's hospital"),
    ("data analyst", "Fernhill Insurance"),
    ("carpenter", "Oakline Builders"),
    ("teacher", "Riverside Primary"),
    ("pharmacist", "Medora"),
    ("architect", "Kessler & Vine"),
    ("chef", "the Copper Pot"),
    ("paralegal", "Hart Lowe LLP"),
]
CARS = [
    "Subaru Outback",
    "Honda Civic",
    "Volvo V60",
    "Toyota Prius",
    "Mazda CX-5",
    "Kia Niro",
    "Skoda Octavia",
]
COLORS = ["red", "silver", "dark green", "white", "navy blue", "yellow"]
BOOKS = [
    ("The Remains of the Day", "Kazuo Ishiguro"),
    ("Middlemarch", "George Eliot"),
    ("The Left Hand of Darkness", "Ursula K. Le Guin"),
    ("Pedro Paramo", "Juan Rulfo"),
    ("Beloved", "Toni Morrison"),
    ("The Master and Margarita", "Mikhail Bulgakov"),
]
COUNTRIES = ["Iceland", "Vietnam", "Chile", "Georgia", "Morocco", "Norway", "Peru", "Japan"]
SHOPS = [
    "Bean Theory",
    "Grindhouse",
    "Little Fox Coffee",
    "Northside Roasters",
    "The Daily Drip",
    "Kettle & Crumb",
    "Copper Cup",
    "Slow Pour",
]
GYMS = ["Ironworks", "Peak Fitness", "the YMCA on 5th", "Boulder Barn", "FlexZone", "Harbor Athletic"]
PROJECTS = ["Zephyr", "Bluebird", "Cobalt", "Falcon", "Juniper", "Orca", "Quartz", "Sable"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]


@dataclass(frozen=True)
class Turn:
    """One chat message: which user, session, role, text and when; `key` marks a planted fact."""

    user_id: str
    session_id: str
    role: str
    text: str
    chat_time: str
    key: str | None = None


@dataclass(frozen=True)
class Question:
    """A question about a user's memories and the keys of the turns that answer it."""

    user_id: str
    text: str
    evidence_keys: tuple[str, ...]
    time_range: tuple[str, str] | None = None


@dataclass(frozen=True)
class Dataset:
    turns: list[Turn]
    questions: list[Question]


def _fact_templates(rng: random.Random) -> list[tuple[str, list[str], list[str]]]:
    """(fact the user says, the assistant's reply, questions asked much later): fresh slot values."""
    name, animal = rng.choice(NAMES), rng.choice(ANIMALS)
    sister, city = rng.choice(PEOPLE), rng.choice(CITIES)
    food, instrument = rng.choice(FOODS), rng.choice(INSTRUMENTS)
    job, company = rng.choice(JOBS)
    car, color = rng.choice(CARS), rng.choice(COLORS)
    book, author = rng.choice(BOOKS)
    country, month = rng.choice(COUNTRIES), rng.choice(MONTHS)
    friend, project = rng.choice(PEOPLE), rng.choice(PROJECTS)
    code = f"{rng.randint(1000, 9999)}"
    minutes, seconds = rng.randint(95, 130), rng.randint(10, 59)
    race_city = rng.choice(CITIES)
    return [
        (
            f"By the way, I adopted a {animal} named {name} last weekend.",
            [f"Congratulations! {name} is a lovely name."],
            ["What's the name of my pet?", f"What did I call the {animal} I adopted?"],
        ),
        (
            f"My sister {sister} just moved to {city} for her new job.",
            [f"{city} is a great place, I hope {sister} settles in well."],
            ["Which city does my sister live in now?", "Where did my sibling relocate to?"],
        ),
        (
            f"I found out I'm allergic to {food}, so I have to check every menu now.",
            ["That must be stressful, always ask the staff about ingredients."],
            ["What food allergy do I have?", "Which ingredient makes me sick?"],
        ),
        (
            f"I started a new position as a {job} at {company} this month.",
            ["Congratulations on the new role!"],
            ["Where do I work these days?", "What is my current job?"],
        ),
        (
            f"I've been taking {instrument} lessons every Saturday morning.",
            ["Learning an instrument as an adult takes patience, good for you."],
            ["What musical instrument am I learning?", "What do I do on Saturday mornings?"],
        ),
        (
            f"We finally bought a {color} {car}, it replaced our old van.",
            ["Enjoy the new car!"],
            ["What car did we buy?", "Which vehicle replaced our old van?"],
        ),
        (
            f"My all-time favourite novel is {book} by {author}.",
            [f"{author} is a wonderful writer."],
            ["Which book do I love the most?", "Who wrote my favourite novel?"],
        ),
        (
            f"We're planning a two-week trip to {country} in {month}.",
            [f"{country} in {month} sounds amazing."],
            ["Where am I travelling on holiday?", "Which country are we visiting?"],
        ),
        (
            f"The door code for the {project} project room is {code}.",
            ["Noted, keep it somewhere safe."],
            [f"What's the code for the {project} room?", f"How do I get into the {project} project room?"],
        ),
        (
            f"{friend} from my climbing group lent me a tent for the weekend.",
            [f"That was kind of {friend}."],
            ["Who lent me camping gear?", "Which friend gave me a tent to borrow?"],
        ),
        (
            f"I ran the {race_city} half marathon in {minutes // 60} hours {minutes % 60} minutes and {seconds} "
            "seconds.",
            ["That's a solid time, well done!"],
            ["How long did my half marathon take?", f"What was my finishing time in {race_city}?"],
        ),
    ]


def _changing_facts(rng: random.Random) -> list[tuple[str, str, str, str]]:
    """(early statement, late statement, question): a fact whose value changes; the time range picks one."""
    shop_a, shop_b = rng.sample(SHOPS, 2)
    gym_a, gym_b = rng.sample(GYMS, 2)
    city_a, city_b = rng.sample(CITIES, 2)
    return [
        (
            f"My usual coffee spot is {shop_a}, I go there before work.",
            f"I've switched my morning coffee to {shop_b} lately.",
            "Which coffee place did I go to before work?",
        ),
        (
            f"I signed up at {gym_a} and go three times a week.",
            f"I cancelled my old membership and joined {gym_b} instead.",
            "Which gym was I a member of?",
        ),
        (
            f"I'm living in a small flat in {city_a} right now.",
            f"We just finished moving into our new place in {city_b}.",
            "Which city was I living in?",
        ),
    ]


_CHATTER_USER = [
    "Can you suggest something quick for dinner tonight?",
    "I'm so tired today, work was exhausting.",
    "What's a good way to stay focused while studying?",
    "The weather has been awful all week.",
    "My neighbour's dog barked the whole night again.",
    "Do you have any tips for sleeping better?",
    "I watched a documentary about octopuses yesterday.",
    "Should I repaint the living room blue or grey?",
    "My phone battery dies so fast lately.",
    "Any ideas for a birthday gift for my dad?",
    "I keep forgetting to drink enough water.",
    "How do I get better at public speaking?",
    "I think I need a new pair of running shoes.",
    "What's the difference between baking soda and powder?",
    "Traffic this morning was unbelievable.",
    "I'm trying to read more books this year.",
    "Can you explain how compound interest works?",
    "My plants keep dying, what am I doing wrong?",
    "I had a weird dream about flying last night.",
    "What should I name my new sourdough starter?",
    "I'm thinking about learning a new language.",
    "My sister called me to talk about her kids.",
    "Do you know any good podcasts about history?",
    "We had a picnic at the lake, it was lovely.",
    "My car needs an oil change soon.",
    "I can't decide what to cook for the potluck.",
    "Is it worth buying an electric bike?",
    "My friend recommended a new series to watch.",
    "How many cups of coffee a day is too many?",
    "I spent the afternoon cleaning out the garage.",
    "I want to plan a weekend trip somewhere nearby.",
    "Work is moving to a new office next month.",
    "My cat knocked a glass off the table again.",
    "What's a good stretching routine after a run?",
    "I'm hosting friends for dinner on Friday.",
    "How do I stop procrastinating on emails?",
    "I tried a new restaurant downtown, the pasta was great.",
    "My gym was packed this evening.",
    "Can you recommend a board game for four players?",
    "I need to renew my passport soon.",
    "The kids next door are learning the trumpet, it's loud.",
    "I'm knitting a scarf for the winter.",
    "What's the best way to store fresh herbs?",
    "My laptop fan is making a strange noise.",
    "We're thinking about getting solar panels.",
    "I burned the toast again this morning.",
    "How do I politely decline a meeting invitation?",
    "My back hurts from sitting all day.",
    "I found an old photo album in the attic.",
    "Do you think I should take the train or drive?",
]
_CHATTER_ASSISTANT = [
    "That sounds like a good plan, let me know how it goes.",
    "Here are a few ideas you could try.",
    "It depends a bit on your budget and how much time you have.",
    "Many people find that a routine helps.",
    "I'd start small and build up gradually.",
    "That's a common problem, you're not alone.",
    "Good question! There are a couple of ways to look at it.",
    "Try to keep it simple at first.",
    "It might help to write down what you notice over a week.",
    "That sounds frustrating, sorry to hear it.",
    "A short walk outside can make a big difference.",
    "You could ask a friend to join you.",
]


def _iso(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def generate(num_users: int, num_sessions: int, turns_per_session: int, seed: int = 0) -> Dataset:
    """Users with `num_sessions` sessions of `turns_per_session` messages each; facts planted at random."""
    if num_sessions < 2 or turns_per_session < 8:
        raise ValueError(f"need >= 2 sessions of >= 8 turns, got {num_sessions} x {turns_per_session}")
    rng = random.Random(seed)
    start = datetime(2024, 1, 1, tzinfo=timezone.utc)
    turns: list[Turn] = []
    questions: list[Question] = []
    for u in range(num_users):
        user_id = f"user-{u:03d}"
        facts = _fact_templates(rng)
        changing = _changing_facts(rng)
        session_days = sorted(rng.sample(range(0, 360), num_sessions))
        session_turns: list[list[tuple[str, str, str | None]]] = []
        for _ in range(num_sessions):
            chat: list[tuple[str, str, str | None]] = []
            for t in range(turns_per_session):
                if t % 2 == 0:
                    chat.append(("user", rng.choice(_CHATTER_USER), None))
                else:
                    chat.append(("assistant", rng.choice(_CHATTER_ASSISTANT), None))
            session_turns.append(chat)

        used: set[tuple[int, int]] = set()

        def plant(session: int, text: str, reply: str, key: str, chats=session_turns, used=used) -> None:
            free = [p for p in range(0, turns_per_session, 2) if (session, p) not in used]
            if not free:
                raise ValueError(f"session {session} has no free turn left for fact {key}")
            position = rng.choice(free)
            used.add((session, position))
            chats[session][position] = ("user", text, key)
            if position + 1 < turns_per_session:
                chats[session][position + 1] = ("assistant", reply, None)

        for f, (fact, replies, fact_questions) in enumerate(facts):
            key = f"{user_id}/fact{f}"
            plant(rng.randrange(num_sessions), fact, rng.choice(replies), key)
            for text in fact_questions:
                questions.append(Question(user_id, text, (key,)))
        half = num_sessions // 2
        for c, (early, late, question) in enumerate(changing):
            early_session, late_session = rng.randrange(half), rng.randrange(half, num_sessions)
            plant(early_session, early, "Good to know.", f"{user_id}/change{c}/early")
            plant(late_session, late, "Thanks for the update.", f"{user_id}/change{c}/late")
            for which, session in (("early", early_session), ("late", late_session)):
                day = start + timedelta(days=session_days[session])  # sessions fall on distinct days
                window = (_iso(day), _iso(day + timedelta(hours=23, minutes=59)))
                questions.append(Question(user_id, question, (f"{user_id}/change{c}/{which}",), window))
        for s, chat in enumerate(session_turns):
            moment = start + timedelta(days=session_days[s], hours=rng.randint(8, 20))
            for t, (role, text, key) in enumerate(chat):
                turns.append(
                    Turn(
                        user_id,
                        f"{user_id}/s{s:02d}",
                        role,
                        text,
                        _iso(moment + timedelta(minutes=2 * t)),
                        key,
                    )
                )
    return Dataset(turns=turns, questions=questions)


def filler_texts(rng: random.Random, count: int) -> list[str]:
    """Chatter-like texts for bulk users (scale tests), mixing the same pools with small variations."""
    out = []
    for _ in range(count):
        base = rng.choice(_CHATTER_USER if rng.random() < 0.6 else _CHATTER_ASSISTANT)
        extra = rng.choice(
            [
                "",
                f" {rng.choice(PEOPLE)} agreed.",
                f" Maybe in {rng.choice(MONTHS)}.",
                f" It reminded me of {rng.choice(CITIES)}.",
                f" Day {rng.randint(1, 400)}.",
            ]
        )
        out.append(base + extra)
    return out
