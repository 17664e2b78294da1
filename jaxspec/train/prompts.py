"""Prompts for distillation data: GSM8K train questions (../shared/data/gsm8k_train.jsonl) and a
small hand-written set covering other kinds of requests (writing, roleplay, coding, extraction,
translation, summarisation, QA over a passage). None are taken from Spec-Bench.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

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
