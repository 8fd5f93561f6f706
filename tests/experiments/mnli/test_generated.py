"""The generated NLI task: determinism, balance, the label rules, cue baselines, files."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

import experiments.mnli.generated as mg

ENT, NEU, CON = 0, 1, 2


def _rows(ex: dict) -> list[tuple[list[str], list[str], int]]:
    return [
        (p.split(), h.split(), y)
        for p, h, y in zip(ex["premise"], ex["hypothesis"], ex["label"], strict=True)
    ]


@pytest.fixture(scope="module")
def big() -> dict:
    return mg.generate_examples(3000, seed=0)


def test_deterministic_and_seeded():
    a = mg.generate_examples(300, seed=0)
    assert a == mg.generate_examples(300, seed=0)
    assert a != mg.generate_examples(300, seed=1)
    assert a != mg.generate_examples(300, 0, "validation")
    assert a != mg.generate_examples(300, 0, vocab=150)


@pytest.mark.parametrize("n", [3, 300, 301, 302])
def test_labels_balanced(n):
    counts = [mg.generate_examples(n, seed=4)["label"].count(y) for y in range(3)]
    assert sum(counts) == n and max(counts) - min(counts) <= 1


@pytest.mark.parametrize("vocab", [20, 24, 150])
def test_every_example_follows_the_label_rules(vocab):
    rows = _rows(mg.generate_examples(600, seed=2, vocab=vocab))
    allowed = set(mg.GENERATED_WORDS[:vocab])
    assert len({w for pw, _, _ in rows for w in pw}) == vocab  # every word gets used
    for pw, hw, y in rows:
        content = [w for w in hw if w != "not"]
        assert 4 <= len(pw) <= 8 and len(set(pw)) == len(pw) and set(pw) <= allowed
        assert 2 <= len(content) <= 4 and len(set(content)) == len(content)
        assert set(content) <= allowed and hw.count("not") <= 1
        found = [w in pw for w in content]
        if y == ENT:
            assert all(found) and "not" not in hw
        elif y == CON:
            assert all(found) and "not" in hw
        else:
            assert not all(found)


def test_neutrals_mix_negation_and_present_words(big):
    neutral = [(pw, hw) for pw, hw, y in _rows(big) if y == NEU]
    negated = sum("not" in hw for _, hw in neutral) / len(neutral)
    some_found = sum(any(w in pw for w in hw if w != "not") for pw, hw in neutral)
    assert 0.45 < negated < 0.55  # "not" in half the neutrals
    assert 0.55 < some_found / len(neutral) < 0.75  # absent count is uniform in 1..k: ~64%


def test_single_cues_stay_at_two_thirds(big):
    """2/3 is the floor: N ("not") splits contradiction off, E (all words found) neutral.

    Both are exactly 2/3 on a balanced set (the best rule for N=1 is contradiction, n/3 of
    the examples, against n/6 negated neutrals). The in-sample fit of the other cues (at most
    16 values each) adds well under 1 point of noise on 3000 examples, so 0.68 bounds them;
    a model that combines E and N gets 1.0.
    """
    cues = mg.cue_baselines(big)
    assert set(cues) == set(mg.CUES)
    assert cues["not_in_hypothesis"] == cues["all_in_premise"] == pytest.approx(2 / 3)
    assert cues["any_in_premise"] < 0.5 and cues["content_length"] < 0.37
    assert mg.best_single_cue_accuracy(big) == max(cues.values()) <= 0.68
    for vocab in (20, 150):
        assert mg.best_single_cue_accuracy(mg.generate_examples(3000, 0, vocab=vocab)) <= 0.68


def test_cue_baselines_on_a_hand_made_set():
    ex = {
        "premise": ["a b c", "a b c", "a b c", "a b c", "a b c", "a b c"],
        "hypothesis": ["a b", "b not a", "x y", "not a x", "c", "c not"],
        "label": [ENT, CON, NEU, NEU, ENT, NEU],
    }
    cues = mg.cue_baselines(ex)
    # not: {False: [E, N, E] -> 2 right, True: [C, N, N] -> 2 right}
    assert cues["not_in_hypothesis"] == pytest.approx(4 / 6)
    # all found: {True: [E, C, E, N] -> 2, False: [N, N] -> 2}
    assert cues["all_in_premise"] == pytest.approx(4 / 6)
    # any found: {True: [E, C, N, E, N] -> 2, False: [N] -> 1}
    assert cues["any_in_premise"] == pytest.approx(3 / 6)
    # hypothesis tokens: {2: [E, N, N] -> 2, 3: [C, N] -> 1, 1: [E] -> 1}
    assert cues["hypothesis_length"] == pytest.approx(4 / 6)
    # overlap fraction: {1: [E, C, E, N] -> 2, 0: [N] -> 1, 1/2: [N] -> 1}
    assert cues["overlap_fraction"] == pytest.approx(4 / 6)
    assert cues["premise_length"] == pytest.approx(3 / 6)  # one value: the majority label
    # jaccard takes a different value on every example here (2/3, 1/2, 0, 1/5, 1/3, 1/4), so
    # its in-sample rule is perfect: why every cue has only a few values on real sets
    assert cues["jaccard"] == 1.0 and mg.best_single_cue_accuracy(ex) == 1.0
    with pytest.raises(ValueError, match="at least one"):
        mg.cue_baselines({"premise": [], "hypothesis": [], "label": []})


def test_vocab_too_small_is_an_error():
    with pytest.raises(ValueError, match="vocab=11"):
        mg.generate_examples(3, 0, vocab=11)
    with pytest.raises(ValueError, match="vocab=151"):
        mg.generate_examples(3, 0, vocab=151)


def test_files_round_trip(tmp_path):
    train, val, tok_path = mg.write_generated_files(tmp_path / "gen", 30, 12, seed=5, vocab=20)
    for path, split, n in ((train, "train", 30), (val, "validation", 12)):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        back = {k: [r[k] for r in rows] for k in ("premise", "hypothesis", "label")}
        assert back == mg.generate_examples(n, 5, split, vocab=20)
    tok = Tokenizer.from_file(str(tok_path))
    assert tok.get_vocab() == mg.build_generated_tokenizer().get_vocab()
    assert tok.get_vocab_size() == len(mg.SPECIAL_TOKENS) + 1 + len(mg.GENERATED_WORDS)
    enc = tok.encode("baba bade", "not baba")
    assert enc.tokens == ["[CLS]", "baba", "bade", "[SEP]", "not", "baba", "[SEP]"]
    assert not list(tmp_path.glob("gen/*.tmp"))
