"""A generated NLI task that needs premise and hypothesis together, and its cue baselines.

The task (`generate_examples`): the premise lists 4-8 distinct words (the facts that hold);
the hypothesis is 2-4 distinct content words, plus, for some labels, "not" (negating the
whole hypothesis) at a random position. With E = "every hypothesis content word is in the
premise" and N = "the hypothesis contains not":

* entailment (label 0):    E and not N             "baba bade badi" / "bade baba"
* neutral (label 1):       not E; N half the time  "baba bade badi" / "not bade bobo"
* contradiction (label 2): E and N                 "baba bade badi" / "bade not baba"

A neutral hypothesis mixes premise words with 1..k absent ones (k content words, the
absent count uniform), so "some word is in the premise" is not "every word is". Neither E
nor N alone decides the label: E tells neutral from the rest, N tells entailment from
contradiction only where E holds. A model must find every hypothesis word in the premise
(attention across the two segments) and combine that with the negation.

`cue_baselines` gives the accuracy of the best rule that sees one surface cue alone (the
cue's Bayes classifier, fit on the examples themselves). On `generate_examples(3000, 0)`:

=====================  =====  ===============================================================
cue                     acc.   why
=====================  =====  ===============================================================
not_in_hypothesis      0.667  N: contradiction (1/3 of all) beats the negated neutrals (1/6);
                              no N: entailment (1/3) beats the other neutrals (1/6)
not_position           0.667  N plus where "not" sits, which carries nothing more
all_in_premise         0.667  not E is exactly neutral; under E, entailment/contra. 50/50
absent_count           0.667  0 absent words is E
overlap_fraction       0.667  fraction 1 is E
jaccard                0.666  |P & H| / |P | H|: as good as E at best
overlap_count          0.578  0-1 words found: neutral; 2-4: entailment/contradiction mostly
last_word_in_premise   0.561  one hypothesis word's membership (also first_word: 0.557)
any_in_premise         0.448  only the neutrals with no premise word at all (~36%)
hypothesis_length      0.448  k or k+1 tokens; k is 2-4 for every label
length_difference      0.404  premise minus hypothesis tokens
premise_length         0.349  independent of the label: chance plus fitting noise
content_length         0.340  independent of the label
=====================  =====  ===============================================================

`best_single_cue_accuracy` (their max) is 2/3 on any balanced set: that is the floor for
this task family, where one binary feature (N or E) always sets one label apart. E and N
together give 1.0; the smoke preset's dense and TT encoders get well above 2/3.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter, defaultdict
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers, processors

__all__ = [
    "CUES",
    "GENERATED_WORDS",
    "NEGATION",
    "SPECIAL_TOKENS",
    "best_single_cue_accuracy",
    "build_generated_tokenizer",
    "cue_baselines",
    "generate_examples",
    "save_tokenizer",
    "write_generated_files",
]

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
NEGATION = "not"
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]
GENERATED_WORDS = tuple(a + b for a in _SYLLABLES[:10] for b in _SYLLABLES[:15])  # 150 words
_ENTAILMENT, _NEUTRAL, _CONTRADICTION = 0, 1, 2  # MNLI's label ids
# Premise length range (inclusive). Short premises keep the word search learnable in the
# smoke budget: on "is this one word in the premise?", a dense 2-layer d=64 encoder was at
# 0.77 after 600 steps of 128 with 8-16 premise words, and at 1.00 with 4-8. Every pair
# also fits max_length=16: [CLS] 8 words [SEP] 4 words + "not" [SEP].
_PREMISE_WORDS = (4, 8)
_HYPOTHESIS_WORDS = (2, 4)  # hypothesis content words (inclusive), "not" not counted


def build_generated_tokenizer() -> Tokenizer:
    """Word-level tokenizer for the generated task, with BERT special tokens and pair template."""
    vocab = {t: i for i, t in enumerate((*SPECIAL_TOKENS, NEGATION, *GENERATED_WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return tok


def save_tokenizer(path: str | Path, tok: Tokenizer | None = None) -> Path:
    """Write `tok` (default: the generated task's) as tokenizer.json, atomically; return the path.

    `path` may be a directory (gets `tokenizer.json`) or a file name.
    """
    path = Path(path)
    if path.is_dir() or not path.suffix:
        path.mkdir(parents=True, exist_ok=True)
        path = path / "tokenizer.json"
    tmp = path.with_name(path.name + ".tmp")
    (tok or build_generated_tokenizer()).save(str(tmp))
    os.replace(tmp, path)
    return path


def generate_examples(n: int, seed: int, split: str = "train", vocab: int = 24) -> dict[str, list]:
    """`n` synthetic NLI pairs, balanced over labels, a pure function of the arguments.

    Words come from the first `vocab` of `GENERATED_WORDS` (at least 12, so an 8-word premise
    leaves 4 absent words; `MNLIDataConfig` asks for 20 or more). The rules are in the module
    docstring: entailment = premise words only; contradiction = premise words plus "not";
    neutral = at least one absent word, mixed with premise words, plus "not" half the time.
    Returns {"premise": [str], "hypothesis": [str], "label": [int]}.
    """
    lo, hi = _PREMISE_WORDS
    if not hi + _HYPOTHESIS_WORDS[1] <= vocab <= len(GENERATED_WORDS):
        raise ValueError(f"vocab={vocab}: use {hi + _HYPOTHESIS_WORDS[1]}..{len(GENERATED_WORDS)}")
    words = GENERATED_WORDS[:vocab]
    rng = random.Random(f"mnli-generated-v2/{seed}/{split}")
    labels = [i % 3 for i in range(n)]
    rng.shuffle(labels)
    out: dict[str, list] = {"premise": [], "hypothesis": [], "label": labels}
    for label in labels:
        premise = rng.sample(words, rng.randint(lo, hi))
        k = rng.randint(*_HYPOTHESIS_WORDS)
        if label == _NEUTRAL:
            absent = rng.randint(1, k)
            hyp = rng.sample(premise, k - absent)
            present = set(premise)
            hyp += rng.sample([w for w in words if w not in present], absent)
            rng.shuffle(hyp)
            negate = rng.random() < 0.5
        else:
            hyp = rng.sample(premise, k)
            negate = label == _CONTRADICTION
        if negate:
            hyp.insert(rng.randint(0, k), NEGATION)
        out["premise"].append(" ".join(premise))
        out["hypothesis"].append(" ".join(hyp))
    return out


# ---------------------------------------------------------------- single-cue baselines


def _found(premise: str, hypothesis: str) -> list[bool]:
    """For each hypothesis content word, in order: is it in the premise?"""
    pw = set(premise.split())
    return [w in pw for w in hypothesis.split() if w != NEGATION]


def _not_position(p: str, h: str) -> int:
    hw = h.split()
    return hw.index(NEGATION) if NEGATION in hw else -1


def _jaccard(p: str, h: str) -> Fraction:
    """Word-set overlap |P & H| / |P | H|, "not" included: the classic lexical-overlap cue."""
    pw, hw = set(p.split()), set(h.split())
    return Fraction(len(pw & hw), len(pw | hw))


CUES: dict[str, Callable[[str, str], object]] = {
    "not_in_hypothesis": lambda p, h: NEGATION in h.split(),
    "not_position": _not_position,
    "hypothesis_length": lambda p, h: len(h.split()),
    "content_length": lambda p, h: len(_found(p, h)),
    "premise_length": lambda p, h: len(p.split()),
    "overlap_count": lambda p, h: sum(_found(p, h)),
    "absent_count": lambda p, h: _found(p, h).count(False),
    "overlap_fraction": lambda p, h: Fraction(sum(_found(p, h)), max(len(_found(p, h)), 1)),
    "all_in_premise": lambda p, h: all(_found(p, h)),
    "any_in_premise": lambda p, h: any(_found(p, h)),
    "first_word_in_premise": lambda p, h: _found(p, h)[:1] == [True],
    "last_word_in_premise": lambda p, h: _found(p, h)[-1:] == [True],
    "length_difference": lambda p, h: len(p.split()) - len(h.split()),
    "jaccard": _jaccard,
}
"""One surface feature each of (premise, hypothesis): what a shallow model could latch onto."""


def cue_baselines(examples: dict[str, list]) -> dict[str, float]:
    """Accuracy of the best rule that sees one cue alone, for every cue in `CUES`.

    Exact on `examples` ({"premise", "hypothesis", "label"} lists, as `generate_examples`
    returns): for each value of the cue, predict its most frequent label (the cue's Bayes
    classifier, fit on the examples themselves), and count how many that gets right.
    """
    labels = examples["label"]
    if not labels:
        raise ValueError("cue_baselines needs at least one example")
    pairs = list(zip(examples["premise"], examples["hypothesis"], strict=True))
    out = {}
    for name, cue in CUES.items():
        counts: defaultdict[object, Counter] = defaultdict(Counter)
        for (p, h), y in zip(pairs, labels, strict=True):
            counts[cue(p, h)][y] += 1
        out[name] = sum(max(c.values()) for c in counts.values()) / len(labels)
    return out


def best_single_cue_accuracy(examples: dict[str, list]) -> float:
    """The highest accuracy any one cue of `cue_baselines` reaches on `examples`."""
    return max(cue_baselines(examples).values())


# ---------------------------------------------------------------- files


def write_generated_files(
    directory: str | Path, n_train: int, n_eval: int, seed: int = 0, vocab: int = 24
) -> tuple[Path, Path, Path]:
    """Write train.jsonl, validation.jsonl and tokenizer.json of the generated task.

    The files hold exactly what `dataset="generated"` with the same seed yields, so tests and
    users can run the local-file and local-tokenizer paths on them.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("validation", n_eval)):
        ex, path = generate_examples(n, seed, split, vocab), directory / f"{split}.jsonl"
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            for p, h, y in zip(ex["premise"], ex["hypothesis"], ex["label"], strict=True):
                f.write(json.dumps({"premise": p, "hypothesis": h, "label": y}) + "\n")
        os.replace(tmp, path)
        paths.append(path)
    return paths[0], paths[1], save_tokenizer(directory / "tokenizer.json")
