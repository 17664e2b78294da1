"""Prompts for distillation data: GSM8K train questions (../shared/data/gsm8k_train.jsonl) and a
small hand-written set covering other kinds of requests (writing, roleplay, coding, extraction,
translation, summarisation, QA over a passage). None are taken from Spec-Bench.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

GSM8K_HELD_OUT = 64  # the last rows of gsm8k_train: evaluation only, never trained on

_PASSAGE_A = (
    "The town council met on Tuesday to discuss the new bike lanes on Main Street. Supporters "
    "said the lanes would make cycling safer and reduce traffic, while several shop owners worried "
    "that removing parking spaces would hurt their business. The council agreed to run a six-month "
    "trial and to collect data on traffic, accidents and shop sales before making a final decision."
)
_PASSAGE_B = (
    "Honeybees live in colonies of up to sixty thousand insects. A single queen lays the eggs, "
    "worker bees collect nectar and pollen, build wax combs and care for the young, and drones "
    "exist mainly to mate with new queens. Bees communicate the location of flowers through a "
    "'waggle dance' whose angle and duration encode direction and distance."
)
_PASSAGE_C = (
    "Maria started a small bakery in 2015 with one oven and two employees. By 2020 the bakery had "
    "three shops and forty employees, and it sold about two thousand loaves of bread every day. "
    "Maria says the secret is simple: fresh ingredients, early mornings and listening to customers."
)

COMPOSED = [
    "Write a short poem about the ocean at night.",
    "Write a friendly email to a colleague asking to move our meeting to Thursday.",
    "Write a short story about a robot who learns to paint.",
    "Give me three tips for staying focused while studying.",
    "Write a product description for a reusable water bottle.",
    "Write a thank-you note to a teacher who helped you a lot this year.",
    "Describe a sunrise in the mountains in a few sentences.",
    "Write a short motivational speech for a soccer team before a final.",
    "Pretend you are a pirate captain and describe your ship to a new sailor.",
    "Act as a travel guide and recommend things to do in Paris for one day.",
    "You are a chef. Explain how to make a simple tomato pasta sauce.",
    "Imagine you are a cat. Describe your typical day.",
    "Act as a job interviewer and ask me three questions for a software engineer role.",
    "If all roses are flowers and some flowers fade quickly, can we conclude that some roses fade quickly? Explain.",
    "A train leaves at 3 pm and travels for 2.5 hours. What time does it arrive? Explain your reasoning.",
    "Which is heavier, a kilogram of feathers or a kilogram of iron? Explain.",
    "What is the next number in the sequence 2, 4, 8, 16? Why?",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a Python function to compute the factorial of a number.",
    "Explain what a for loop is in programming, with an example in Python.",
    "Write a SQL query that returns the ten most recent orders from a table called orders.",
    "Write a JavaScript function that reverses an array.",
    "Explain the difference between a list and a tuple in Python.",
    "Extract all the names of people from this text: 'Alice met Bob at the station, and later they had dinner with Carol.'",
    "List the dates mentioned in this sentence: 'The project started on March 3, paused on June 10, and ended on December 1.'",
    f"Extract the numbers and what they count from this text: {_PASSAGE_C}",
    "Explain how photosynthesis works in simple terms.",
    "Why is the sky blue?",
    "What is the difference between weather and climate?",
    "Explain Newton's three laws of motion.",
    "How does a vaccine help the body fight disease?",
    "What causes the seasons on Earth?",
    "Explain what DNA is and why it is important.",
    "Who was Leonardo da Vinci and why is he famous?",
    "What were the main causes of the First World War?",
    "Explain the importance of the printing press in history.",
    "What is democracy? Give a short explanation.",
    "Why do people study philosophy?",
    "Translate to French: 'Good morning, how are you today?'",
    "Translate to Spanish: 'I would like a cup of coffee, please.'",
    "Translate to German: 'The weather is nice and we are going to the park.'",
    "Translate into English: 'Je voudrais réserver une table pour deux personnes.'",
    "Translate into English: 'El perro corre en el parque con su dueño.'",
    "Translate to French: 'My brother works in a hospital in the city.'",
    f"Summarize the following text in two sentences: {_PASSAGE_A}",
    f"Summarize this paragraph: {_PASSAGE_B}",
    f"Give a one-sentence summary of this text: {_PASSAGE_C}",
    "What is the capital of Japan?",
    "How many continents are there, and what are they?",
    "Who wrote Romeo and Juliet?",
    "What is the largest planet in our solar system?",
    "How do airplanes stay in the air?",
    "What is the boiling point of water at sea level?",
    f"Read the passage and answer the question.\nPassage: {_PASSAGE_A}\nQuestion: What did the council decide?",
    f"Use the text below to answer: how do bees tell each other where flowers are?\n\n{_PASSAGE_B}",
    f"Based on this text, how many employees did the bakery have in 2020?\n\n{_PASSAGE_C}",
    f"Context: {_PASSAGE_B}\nQuestion: What is the role of the queen?",
    "Give me a healthy breakfast idea and explain why it is healthy.",
    "What are the benefits of regular exercise?",
    "How can I save money on groceries?",
    "Explain how to change a flat tire, step by step.",
    "What should I pack for a weekend camping trip?",
    "Write a haiku about autumn leaves.",
    "Explain the rules of chess briefly.",
]


# Task templates over GSM8K *train* question text (used as a passage) and over plain topics: the
# kinds of request Spec-Bench measures (summaries, translation, extraction, QA over a passage,
# rewriting, open writing), so a drafter trained on the answers is not a math-only drafter.
PASSAGE_TASKS = [
    "Summarize the following text in one sentence: {text}",
    "Translate the following text into French: {text}",
    "Translate this into German: {text}",
    "Translate to Spanish: {text}",
    "Rewrite this text in a more formal style: {text}",
    "List every number in this text and say what it refers to: {text}",
    "Read the passage and answer: who is the text about, and what do they want to know?\nPassage: {text}",
    "Context: {text}\nQuestion: What is the main question asked here? Answer briefly.",
    "Explain this problem to a ten-year-old, without solving it: {text}",
    "Write a short title for this text: {text}",
]
TOPIC_TASKS = [
    "Write a short story about {topic}.",
    "Explain {topic} in simple terms.",
    "Give three tips about {topic}.",
    "Write a short poem about {topic}.",
    "What are the pros and cons of {topic}?",
    "Write a friendly email to a colleague about {topic}.",
    "Describe the history of {topic} in a paragraph.",
    "Write a Python function related to {topic}, with a docstring.",
]
TOPICS = [
    "gardening", "the ocean", "electric cars", "learning a language", "coffee", "the moon",
    "public libraries", "remote work", "volcanoes", "healthy breakfast", "chess", "recycling",
    "birds", "the internet", "saving money", "rain forests", "robots", "football", "music lessons",
    "a rainy day", "friendship", "mountains", "solar energy", "time management", "trains",
    "cooking pasta", "the human heart", "photography", "ancient Egypt", "city parks",
]


def templated(questions: list[str], n: int) -> list[str]:
    """`n` prompts: passage tasks over GSM8K train questions, interleaved with topic tasks."""
    out = []
    for i in range(n):
        if i % 3 == 2:
            task = TOPIC_TASKS[(i // 3) % len(TOPIC_TASKS)]
            out.append(task.format(topic=TOPICS[(i * 7) % len(TOPICS)]))
        else:
            task = PASSAGE_TASKS[i % len(PASSAGE_TASKS)]
            out.append(task.format(text=questions[i % len(questions)]))
    return out


def read_gsm8k(path: str | Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def clean_answer(answer: str) -> str:
    """Drop GSM8K's calculator annotations `<<48/2=24>>`; keep the `#### N` line."""
    return re.sub(r"<<[^>]*>>", "", answer)


def split_gsm8k(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """(train rows, held-out rows). The held-out slice is used for evaluation only."""
    return rows[:-GSM8K_HELD_OUT], rows[-GSM8K_HELD_OUT:]


# Two-stage data for the request kinds GSM8K text cannot imitate (news summaries, answers over
# several passages, short factual questions, German -> English): stage 1 has the target write
# passages (news reports, encyclopedia entries) on composed subjects; stage 2 builds tasks over
# those passages (`passage_tasks`). All text is composed here or written by the target itself.
NEWS_SUBJECTS = [
    "a city council vote on new bike lanes", "a storm that closed schools", "a local bakery that won a national prize",
    "a new hospital wing opening", "a football club signing a young striker", "a power outage downtown",
    "rising rents for students", "a museum returning stolen paintings", "a bridge closed for repairs",
    "a tech company announcing layoffs", "a wildfire near a national park", "a record heat wave",
    "a teachers' strike", "a new subway line", "a rescued whale", "a mayor resigning after a scandal",
    "a farmers' market moving to a new square", "a spacecraft landing on the moon", "a flood in river towns",
    "an election for state governor", "a marathon with ten thousand runners", "a factory closing",
    "a new law on plastic bags", "a zoo welcoming baby pandas", "a cyber attack on a bank",
    "a shortage of nurses", "a film festival opening night", "an airline cancelling flights",
    "a drought affecting wheat farmers", "a famous singer's farewell tour", "a school lunch program",
    "a court ruling on data privacy", "a rise in bicycle thefts", "a new species of frog discovered",
    "a trade deal between two countries", "a chess prodigy winning a tournament", "a housing project approved",
    "a volcano erupting on an island", "a charity raising money for a library", "a self-driving bus trial",
]
ENCYCLOPEDIA_SUBJECTS = [
    "the Roman Empire", "photosynthesis", "the Amazon rainforest", "the printing press", "black holes",
    "the French Revolution", "honeybees", "the Great Wall of China", "vaccines", "the water cycle",
    "the Industrial Revolution", "volcanoes", "the human immune system", "Mount Everest", "the Olympic Games",
    "electric cars", "the Nile river", "the Renaissance", "coral reefs", "the internet", "glaciers",
    "the Moon", "democracy", "coffee", "the Sahara desert", "earthquakes", "the piano", "penguins",
    "the Silk Road", "solar panels", "antibiotics", "the Pacific Ocean", "jazz music", "tea",
    "the Cold War", "rain forests in Africa", "the periodic table", "the stock market", "forests",
    "the Eiffel Tower", "climate change", "the human brain", "the Byzantine Empire", "dinosaurs",
    "the printing of money", "wind energy", "the Milky Way", "chess", "the United Nations", "bread",
]
PASSAGE_PROMPTS = [
    "Write a news article about {s}.",
    "Write a detailed news report about {s}, with quotes from people involved.",
]
ENCYCLOPEDIA_PROMPTS = [
    "Write an encyclopedia entry about {s}.",
    "Write a few informative paragraphs about {s}.",
]


def passage_prompts() -> list[tuple[str, str]]:
    """(subject, prompt) pairs for stage 1."""
    out = [(s, p.format(s=s)) for s in NEWS_SUBJECTS for p in PASSAGE_PROMPTS]
    out += [(s, p.format(s=s)) for s in ENCYCLOPEDIA_SUBJECTS for p in ENCYCLOPEDIA_PROMPTS]
    return out


QUESTION_FORMS = [
    "What is {s}?", "Why is {s} important?", "How does {s} work?", "What do people say about {s}?",
    "Describe the main facts about {s}.", "What happened with {s}?", "Where can we find {s}?",
    "What are the effects of {s}?",
]
SHORT_QUESTIONS = [
    "who wrote {s}", "when did {s} start", "where is {s}", "what is {s} known for", "who invented {s}",
    "how old is {s}", "what is the history of {s}", "why is {s} famous",
]
MT_FORMS = [
    "Compose an engaging blog post about {s}.", "Pretend you are an expert on {s}. Explain it to a beginner.",
    "Write a persuasive essay about {s}.", "Imagine you are a journalist. Interview someone about {s}.",
    "Write a Python program that stores facts about {s} in a dictionary and prints them.",
    "Give a step-by-step plan for a school project about {s}.", "Write a short dialogue between two friends about {s}.",
    "What are three common misconceptions about {s}?",
]
GERMAN_SENTENCES = [
    "Die Stadt plant neue Radwege in der Innenstadt .", "Der Zug nach Berlin hat heute eine Stunde Verspätung .",
    "Die Regierung will die Steuern für Familien senken .", "Im Sommer ist es in Spanien sehr heiß .",
    "Mein Bruder arbeitet seit drei Jahren in einem Krankenhaus .", "Die Schüler haben morgen eine wichtige Prüfung .",
    "Das neue Museum wurde am Sonntag eröffnet .", "Viele Menschen kaufen ihre Lebensmittel auf dem Markt .",
    "Der Präsident hat sich mit den Ministern getroffen , um über die Krise zu sprechen .",
    "Die Preise für Wohnungen sind in den letzten Jahren stark gestiegen .",
    "Nach dem Sturm waren viele Straßen gesperrt .", "Die Mannschaft hat das Spiel mit zwei zu eins gewonnen .",
    "Wissenschaftler haben eine neue Art von Frosch entdeckt .", "Das Unternehmen will im nächsten Jahr tausend neue Mitarbeiter einstellen .",
    "Die Polizei sucht nach Zeugen des Unfalls .", "Ich trinke jeden Morgen eine Tasse Kaffee .",
    "Die Bibliothek ist am Wochenende geschlossen .", "Der Flughafen wurde wegen Nebel vorübergehend geschlossen .",
    "Die Zahl der Arbeitslosen ist im Mai gesunken .", "Kinder sollten jeden Tag draußen spielen .",
    "Das Konzert war ausverkauft , und die Stimmung war großartig .", "Die Ärzte warnen vor einer neuen Grippewelle .",
    "In der Schweiz gibt es vier Landessprachen .", "Der Bürgermeister ist nach dem Skandal zurückgetreten .",
    "Die Bauern leiden unter der langen Trockenheit .", "Immer mehr Menschen arbeiten von zu Hause aus .",
    "Die Brücke wird ab Montag für drei Monate repariert .", "Die Firma hat einen Gewinn von zehn Millionen Euro gemacht .",
    "Die Wahl findet am ersten Sonntag im Oktober statt .", "Der Film erzählt die Geschichte einer armen Familie in Paris .",
    "Die Banken haben die Zinsen erneut erhöht .", "Der Wald brennt seit zwei Tagen , und die Feuerwehr kämpft gegen die Flammen .",
    "Die Universität bietet neue Kurse für ältere Studenten an .", "Das Wetter wird am Wochenende sonnig und warm .",
    "Die Gewerkschaft hat zu einem Streik aufgerufen .", "Der Roboter kann einfache Aufgaben im Haushalt erledigen .",
    "Die Kinder haben im Zoo die jungen Pandas gesehen .", "Die Regierung hat ein neues Gesetz gegen Plastiktüten beschlossen .",
    "Die Krise hat die Mittelschicht erreicht .", "Der Sänger gibt in diesem Jahr seine letzte Tournee .",
]


def passage_tasks(passages: list[tuple[str, str]], n: int, draw: int = 0) -> list[str]:
    """`n` stage-2 prompts over stage-1 (subject, passage text) pairs, cycling through: summary,
    answer over several passages, short factual question, German -> English, MT-bench-like.
    draw=0: passages and question forms in a fixed stride (data-tasks.yaml); draw=k>0: drawn at
    random with seed k, so a further data dir gets new passage/task pairings (no translation:
    each German sentence is used once, by draw 0)."""
    out, m = [], len(passages)
    for i in range(n):
        kind = i % 6
        if draw:
            rng = np.random.default_rng([draw, i])
            pick, o1, o2 = (int(x) for x in rng.integers(m, size=3))
            form = int(rng.integers(1 << 30))
            kind = 4 if kind == 3 else kind
        else:
            pick, o1, o2, form = (i * 7) % m, (i * 7 + 13) % m, (i * 7 + 26) % m, i // 6
        subject, text = passages[pick]
        if kind == 0:
            out.append(f"Summarize: {text}")
        elif kind == 1:
            ctx = "\n".join([passages[o1][1], text, passages[o2][1]])
            out.append(f"{ctx}\n{QUESTION_FORMS[form % len(QUESTION_FORMS)].format(s=subject)}")
        elif kind == 2:
            out.append(SHORT_QUESTIONS[form % len(SHORT_QUESTIONS)].format(s=subject) + "?")
        elif kind == 3 and form < len(GERMAN_SENTENCES):  # each sentence once
            out.append(f"Translate German to English: {GERMAN_SENTENCES[form]}")
        elif kind in (3, 4):
            out.append(MT_FORMS[form % len(MT_FORMS)].format(s=subject))
        else:
            out.append(f"Write a short summary of this text:\n\n{text}")
    return out
