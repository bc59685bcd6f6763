"""Generate the shipped training assets: a synthetic English-like text corpus and a
byte-level BPE tokenizer trained on it.

    python scripts/make_assets.py            # writes titan_megamoe/assets/

The output is a pure function of this file: rerunning it rewrites identical bytes.
The text is produced by a small grammar over a fixed "world" (who lives where, what
each animal says, arithmetic, calendars), so a model can learn real regularities
and the training loss falls clearly within a few dozen steps.
"""

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO_ROOT = Path(__file__).resolve().parent.parent
ASSETS_DIR = REPO_ROOT / "titan_megamoe" / "assets"

SEED = 20240607
CORPUS_BYTES = 2_000_000
"""Stop adding documents once the corpus reaches this many bytes of text."""
VOCAB_SIZE = 2048
"""Tokenizer vocabulary, special tokens included; qwen3 debugmodel_moe embeds 2048 ids."""
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|eos|>"

# ---------------------------------------------------------------- the world

NAMES = {
    "Anna": "she", "Ben": "he", "Clara": "she", "Daniel": "he", "Ella": "she",
    "Felix": "he", "Grace": "she", "Henry": "he", "Iris": "she", "Jonah": "he",
    "Kate": "she", "Leo": "he", "Maya": "she", "Noah": "he", "Olive": "she",
    "Peter": "he", "Quinn": "she", "Ruben": "he", "Sara": "she", "Tom": "he",
    "Uma": "she", "Victor": "he", "Wendy": "she", "Xavier": "he", "Yara": "she",
    "Zane": "he",
}
OBJECT_PRONOUN = {"she": "her", "he": "him"}
POSSESSIVE = {"she": "her", "he": "his"}

# animal -> (sound, home, food)
ANIMALS = {
    "cow": ("moo", "barn", "grass"),
    "dog": ("woof", "kennel", "bones"),
    "cat": ("meow", "basket", "fish"),
    "duck": ("quack", "pond", "bread"),
    "sheep": ("baa", "meadow", "clover"),
    "horse": ("neigh", "stable", "hay"),
    "owl": ("hoot", "oak tree", "mice"),
    "frog": ("ribbit", "lily pad", "flies"),
    "pig": ("oink", "sty", "apples"),
    "goat": ("bleat", "hill", "weeds"),
    "bee": ("buzz", "hive", "nectar"),
    "lion": ("roar", "den", "meat"),
}
PET_NAMES = ["Pip", "Rusty", "Daisy", "Biscuit", "Pepper", "Misty", "Bolt", "Clover", "Sunny", "Tiny"]
PLACES = ["village", "town", "forest", "valley", "harbor", "city", "farm", "island", "mountain", "garden"]
LANDMARKS = ["river", "old bridge", "market", "school", "library", "well", "lighthouse", "bakery", "park", "station"]
OBJECTS = ["ball", "kite", "book", "cup", "hat", "box", "key", "lamp", "shell", "stone", "ribbon", "drum"]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "orange", "purple", "brown", "silver"]
ADJECTIVES = ["small", "quiet", "busy", "sunny", "windy", "cold", "warm", "bright", "old", "pretty"]
FEELINGS = ["happy", "surprised", "curious", "proud", "sleepy", "excited", "calm", "glad"]
FURNITURE = ["table", "shelf", "bed", "chair", "window sill", "desk"]
# verb -> past tense, for daily routines
ROUTINES = {
    "read a story": "read a story", "water the plants": "watered the plants",
    "bake bread": "baked bread", "sweep the floor": "swept the floor",
    "feed the birds": "fed the birds", "paint a picture": "painted a picture",
    "sing a song": "sang a song", "write a letter": "wrote a letter",
}
NUMBER_WORDS = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen", "nineteen", "twenty",
]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January", "February", "March", "April", "May", "June", "July", "August",
    "September", "October", "November", "December",
]
# Each person lives in one place, so the same facts recur across documents.
HOMES = {name: PLACES[i % len(PLACES)] for i, name in enumerate(NAMES)}


def capital(text: str) -> str:
    return text[0].upper() + text[1:]


def article(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


# ---------------------------------------------------------------- documents

def story(rng: random.Random) -> str:
    hero, friend = rng.sample(sorted(NAMES), 2)
    he = NAMES[hero]
    animal = rng.choice(sorted(ANIMALS))
    sound, home, food = ANIMALS[animal]
    pet = rng.choice(PET_NAMES)
    color, thing = rng.choice(COLORS), rng.choice(OBJECTS)
    landmark = rng.choice(LANDMARKS)
    day = rng.choice(DAYS)
    routine = rng.choice(sorted(ROUTINES))
    lines = [
        f"Once upon a time, {hero} lived in {article(rng.choice(ADJECTIVES))} {HOMES[hero]}.",
        f"{hero} had {article(animal)} named {pet}. {pet} lived in the {home} and ate {food}.",
        f"Every {day}, {hero} liked to {routine}.",
        f"One morning, {hero} and {pet} walked to the {landmark}.",
        f"Near the {landmark}, {he} found {article(color)} {thing}.",
        f"{capital(he)} picked up the {color} {thing} and felt {rng.choice(FEELINGS)}.",
        f"Then {hero} met {friend}, who lived in the {HOMES[friend]}.",
        f'{friend} looked at the {thing} and said, "What {article(rng.choice(ADJECTIVES))} {thing}!"',
        f'{pet} the {animal} said "{sound}, {sound}."',
        f"In the evening, {hero} went home and put the {color} {thing} on the {rng.choice(FURNITURE)}.",
        f"{friend} came to visit {OBJECT_PRONOUN[he]}, and they played with {POSSESSIVE[he]} {thing} until dark.",
        "The end.",
    ]
    # Drop a few middle sentences so stories vary in length but keep their order.
    keep = [0, 1] + sorted(rng.sample(range(2, len(lines) - 1), rng.randint(5, len(lines) - 3)))
    return " ".join(lines[i] for i in keep) + " " + lines[-1]


def arithmetic(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(4, 9)):
        a, b = rng.randint(0, 10), rng.randint(0, 10)
        style = rng.randrange(3)
        if style == 0:
            lines.append(f"{capital(NUMBER_WORDS[a])} plus {NUMBER_WORDS[b]} is {NUMBER_WORDS[a + b]}.")
        elif style == 1:
            lines.append(f"{a} + {b} = {a + b}")
        else:
            big, small = max(a, b), min(a, b)
            lines.append(f"{capital(NUMBER_WORDS[big])} minus {NUMBER_WORDS[small]} is {NUMBER_WORDS[big - small]}.")
    n = rng.randint(2, 9)
    table = ", ".join(f"{n} times {k} is {n * k}" for k in range(1, 11))
    lines.append(f"The table of {n}: {table}.")
    return "\n".join(lines)


def sequences(rng: random.Random) -> str:
    start = rng.randint(0, 10)
    count = ", ".join(NUMBER_WORDS[start:start + rng.randint(5, 10)])
    first_day = rng.randrange(7)
    week = ", ".join(DAYS[(first_day + i) % 7] for i in range(7))
    first_month = rng.randrange(12)
    year = ", ".join(MONTHS[(first_month + i) % 12] for i in range(rng.randint(4, 12)))
    day = rng.randrange(7)
    month = rng.randrange(12)
    letter = rng.randrange(20)
    alphabet = " ".join("abcdefghijklmnopqrstuvwxyz"[letter:letter + rng.randint(4, 7)])
    lines = [
        f"Counting: {count}.",
        f"The days of the week, starting on {DAYS[first_day]}: {week}.",
        f"Some months in order: {year}.",
        f"The day after {DAYS[day]} is {DAYS[(day + 1) % 7]}.",
        f"The month after {MONTHS[month]} is {MONTHS[(month + 1) % 12]}.",
        f"Letters: {alphabet}.",
    ]
    rng.shuffle(lines)
    return "\n".join(lines)


def questions(rng: random.Random) -> str:
    lines = []
    for _ in range(rng.randint(4, 8)):
        kind = rng.randrange(5)
        animal = rng.choice(sorted(ANIMALS))
        sound, home, food = ANIMALS[animal]
        name = rng.choice(sorted(NAMES))
        if kind == 0:
            q, a = f"What does the {animal} say?", f"The {animal} says {sound}."
        elif kind == 1:
            q, a = f"Where does the {animal} live?", f"The {animal} lives in the {home}."
        elif kind == 2:
            q, a = f"What does the {animal} eat?", f"The {animal} eats {food}."
        elif kind == 3:
            q, a = f"Where does {name} live?", f"{name} lives in the {HOMES[name]}."
        else:
            x, y = rng.randint(0, 10), rng.randint(0, 10)
            q, a = f"What is {NUMBER_WORDS[x]} plus {NUMBER_WORDS[y]}?", f"It is {NUMBER_WORDS[x + y]}."
        lines.append(f"Question: {q}\nAnswer: {a}")
    return "\n".join(lines)


def letter(rng: random.Random) -> str:
    writer, reader = rng.sample(sorted(NAMES), 2)
    animal = rng.choice(sorted(ANIMALS))
    routine = rng.choice(sorted(ROUTINES))
    month = rng.choice(MONTHS)
    return (
        f"Dear {reader},\n"
        f"I hope you are well in the {HOMES[reader]}. Here in the {HOMES[writer]} it is "
        f"{rng.choice(ADJECTIVES)} this {month}. Yesterday I {ROUTINES[routine]}, and my "
        f"{animal} sat next to me and said {ANIMALS[animal][0]}. "
        f"Next {rng.choice(DAYS)} I will visit you and bring {article(rng.choice(COLORS))} "
        f"{rng.choice(OBJECTS)}.\nYours, {writer}"
    )


# Relative frequency of each document kind in the corpus.
DOCUMENT_KINDS = ((story, 5), (questions, 3), (arithmetic, 2), (sequences, 2), (letter, 2))


def document(rng: random.Random) -> str:
    makers, weights = zip(*DOCUMENT_KINDS)
    parts = [rng.choices(makers, weights)[0](rng) for _ in range(rng.randint(1, 3))]
    return "\n\n".join(parts)


def corpus(seed: int, target_bytes: int) -> list[str]:
    rng = random.Random(seed)
    texts, size = [], 0
    while size < target_bytes:
        texts.append(document(rng))
        size += len(texts[-1].encode())
    return texts


# ---------------------------------------------------------------- files

def write_text(texts: list[str], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for text in texts:
            f.write(json.dumps({"text": text}, ensure_ascii=False) + "\n")


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    # Byte-level BPE: any string encodes and decodes back exactly.
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS_TOKEN, EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return tokenizer


def write_tokenizer(tokenizer: Tokenizer, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"), pretty=True)
    # TorchTitan's HuggingFaceTokenizer reads bos/eos from here; it adds them itself.
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 262144,
    }
    with open(directory / "tokenizer_config.json", "w", encoding="utf-8", newline="\n") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ASSETS_DIR, help="assets directory to write")
    args = parser.parse_args()

    texts = corpus(SEED, CORPUS_BYTES)
    text_path = args.out / "megamoe_text.jsonl"
    write_text(texts, text_path)
    tokenizer = train_tokenizer(texts, VOCAB_SIZE)
    write_tokenizer(tokenizer, args.out / "tokenizer")

    n_tokens = sum(len(e.ids) for e in tokenizer.encode_batch(texts))
    print(
        f"wrote {text_path} ({len(texts)} documents, {text_path.stat().st_size:,} bytes, "
        f"{n_tokens:,} tokens) and {args.out / 'tokenizer'} (vocab {tokenizer.get_vocab_size()})"
    )


if __name__ == "__main__":
    main()
