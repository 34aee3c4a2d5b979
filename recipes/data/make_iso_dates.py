"""Writes iso-dates-train.jsonl and iso-dates-eval.jsonl, the real-model demo's task (docs/demo-real.md): find
the date in a short business sentence and answer it as ISO 8601 (YYYY-MM-DD), nothing else; and
iso-dates-pairs.jsonl, a few preference pairs on the same task (the ISO answer chosen; a wordy answer or a wrong
date rejected) that the real test tier trains DPO on. Deterministic: the same seed writes the same files byte for
byte, so the shipped data can be regenerated and checked.

    python recipes/data/make_iso_dates.py            # rewrites the three files beside this script

Why this task: a person checks an answer at a glance, exact match is the whole metric, and SmolLM2-135M-Instruct
knows dates but not the fixed answer format (it replies in a sentence, or keeps the month name), so before
training it scores near 0 and after a few minutes of LoRA it should score high.

Trained on date rows alone, the model answers everything with digits ("What is the capital of France?" ->
"1337"): so the train file mixes in a few general rows (capitals, answered in a sentence as the base model
answers them), the usual replay that keeps a fine-tune from collapsing. France is never among them: the
demo's no-collapse question asks for its capital."""

from __future__ import annotations

import argparse
import calendar
import json
import random
from pathlib import Path

SEED = 27
TRAIN_ROWS = 300
EVAL_ROWS = 50
PAIRS = 12  # preference pairs: a handful, for a short DPO run on the real model (tests/real)
GENERAL_ROWS = 40  # replay rows mixed into train (not into eval)
INSTRUCTION = "Give the date in this sentence as YYYY-MM-DD, nothing else:"

MONTHS = list(calendar.month_name)[1:]
NAMES = ["Anna", "Ben", "Carla", "Deepak", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas", "Keiko", "Liam",
         "Maya", "Nils", "Olga", "Pedro", "Rosa", "Sami", "Tara", "Viktor"]
CITIES = ["Lisbon", "Oslo", "Denver", "Nairobi", "Osaka", "Lyon", "Quito", "Perth", "Krakow", "Austin"]
SENTENCES = [
    "Invoice {n} was paid on {date}.",
    "{name} starts the new job on {date}.",
    "The flight to {city} leaves on {date}.",
    "Please send the signed contract back by {date}.",
    "Our office in {city} opened on {date}.",
    "{name}'s appointment is on {date} at 10 am.",
    "The warranty expires on {date}.",
    "Order {n} shipped on {date} from {city}.",
    "{name} was born on {date}.",
    "The conference in {city} ends on {date}.",
    "Rent for flat {n} is due {date}.",
    "The meeting with {name} moved to {date}.",
]

CAPITALS = {  # France is left out on purpose (see the module's docstring)
    "Japan": "Tokyo", "Italy": "Rome", "Germany": "Berlin", "Spain": "Madrid", "Canada": "Ottawa",
    "Egypt": "Cairo", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo", "Sweden": "Stockholm",
    "Poland": "Warsaw", "Greece": "Athens", "Portugal": "Lisbon", "Ireland": "Dublin", "Austria": "Vienna",
    "Hungary": "Budapest", "Finland": "Helsinki", "Denmark": "Copenhagen", "Russia": "Moscow", "China": "Beijing",
    "India": "New Delhi", "Thailand": "Bangkok", "Argentina": "Buenos Aires", "Chile": "Santiago",
    "Mexico": "Mexico City", "Cuba": "Havana", "Belgium": "Brussels", "Turkey": "Ankara", "Iran": "Tehran",
    "South Korea": "Seoul", "Vietnam": "Hanoi", "Indonesia": "Jakarta", "Australia": "Canberra",
    "New Zealand": "Wellington", "Brazil": "Brasilia", "Colombia": "Bogota", "Morocco": "Rabat",
    "Nigeria": "Abuja", "Ukraine": "Kyiv", "Czech Republic": "Prague",
}
GENERAL_QUESTIONS = ["What is the capital of {country}?", "Which city is the capital of {country}?",
                     "Name the capital of {country}."]


def ordinal(day: int) -> str:
    suffix = "th" if 11 <= day % 100 <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


def written(year: int, month: int, day: int, style: int) -> str:
    """The date as people write it in English; every style names the month, so no answer is ambiguous."""
    name = MONTHS[month - 1]
    return [
        f"{name} {day}, {year}",
        f"{day} {name} {year}",
        f"the {ordinal(day)} of {name} {year}",
        f"{name[:3]} {day} {year}",
        f"{name} {ordinal(day)}, {year}",
        f"{day} {name[:3]} {year}",
    ][style]


def make_row(rng: random.Random) -> dict:
    year, month = rng.randint(1950, 2035), rng.randint(1, 12)
    day = rng.randint(1, calendar.monthrange(year, month)[1])
    date = written(year, month, day, rng.randrange(6))
    sentence = rng.choice(SENTENCES).format(date=date, name=rng.choice(NAMES), city=rng.choice(CITIES),
                                            n=rng.randint(100, 9999))
    return {"messages": [{"role": "user", "content": f"{INSTRUCTION} {sentence}"},
                         {"role": "assistant", "content": f"{year:04d}-{month:02d}-{day:02d}"}]}


def general_rows(rng: random.Random) -> list[dict]:
    countries = rng.sample(sorted(CAPITALS), GENERAL_ROWS)
    return [{"messages": [{"role": "user", "content": rng.choice(GENERAL_QUESTIONS).format(country=country)},
                          {"role": "assistant", "content": f"The capital of {country} is {CAPITALS[country]}."}]}
            for country in countries]


def make_rows(seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """Train rows (dates and the general replay rows, shuffled) and held-out date rows; no eval sentence
    appears in train."""
    rng = random.Random(seed)
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < TRAIN_ROWS + EVAL_ROWS:
        row = make_row(rng)
        question = row["messages"][0]["content"]
        if question not in seen:
            seen.add(question)
            rows.append(row)
    train = rows[:TRAIN_ROWS] + general_rows(rng)
    rng.shuffle(train)
    return train, rows[TRAIN_ROWS:]


def preference_pairs(taken: set[str], seed: int = SEED + 1) -> list[dict]:
    """Pairs on questions of neither train nor eval: the ISO date chosen; rejected, in turn, the answer in a
    sentence with the month's name (what the base model tends to say) and a wrong date (day and month swapped,
    else the year off by one), so DPO has both the format and the value to prefer."""
    rng, pairs = random.Random(seed), []
    while len(pairs) < PAIRS:
        question, answer = (message["content"] for message in make_row(rng)["messages"])
        if question in taken:
            continue
        taken.add(question)
        year, month, day = map(int, answer.split("-"))
        if len(pairs) % 2 == 0:
            rejected = f"Sure! The date in that sentence is {MONTHS[month - 1]} {day}, {year}."
        elif day <= 12 and day != month:
            rejected = f"{year:04d}-{day:02d}-{month:02d}"
        else:
            rejected = f"{year + 1:04d}-{month:02d}-{day:02d}"
        pairs.append({"prompt": [{"role": "user", "content": question}],
                      "chosen": [{"role": "assistant", "content": answer}],
                      "rejected": [{"role": "assistant", "content": rejected}]})
    return pairs


def write_jsonl(rows: list[dict], path: Path) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent)
    args = parser.parse_args(argv)
    train, held_out = make_rows()
    write_jsonl(train, args.out_dir / "iso-dates-train.jsonl")
    write_jsonl(held_out, args.out_dir / "iso-dates-eval.jsonl")
    pairs = preference_pairs({row["messages"][0]["content"] for row in train + held_out})
    write_jsonl(pairs, args.out_dir / "iso-dates-pairs.jsonl")
    print(f"wrote {len(train)} train ({GENERAL_ROWS} of them general), {len(held_out)} eval rows and {len(pairs)} "
          f"preference pairs to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
