"""The ``shapes`` reward's setup check: every prompt record it cannot score, named by its index."""

from __future__ import annotations

from lit_flowgrpo.rewards import MultiReward, build_reward
from lit_flowgrpo.toy import world


def test_shipped_prompt_lists_have_no_problems() -> None:
    reward = build_reward("shapes")
    assert reward.problems(world.load_prompts("train") + world.load_prompts("val")) == []


def test_each_bad_record_is_named_with_its_index_and_reason() -> None:
    good = world.load_prompts("val")[:3]
    outside_vocab = {**good[0], "prompt": "a red dragon near the castle"}
    bad_metadata = {**good[1], "include": [{"class": "dog", "count": 1}]}
    no_metadata = {"prompt": "a red circle"}  # a .txt prompt file gives no metadata
    records = [good[0], outside_vocab, good[1], bad_metadata, no_metadata, good[2]]

    problems = build_reward("shapes").problems(records)
    assert len(problems) == 4
    assert problems[0] == (
        "prompt record 1 ('a red dragon near the castle'): words outside the toy world's vocabulary "
        "['dragon', 'near', 'castle']"
    )
    assert problems[1].startswith("prompt record 3 ('a square'):") and "include[0].class 'dog'" in problems[1]
    assert (
        problems[2].startswith("prompt record 4 ('a red circle'):") and "non-empty 'include'" in problems[2]
    )
    assert problems[3] == f"the toy world's vocabulary is {list(world.VOCAB)}"  # once, not per record

    # Through the weighted sum, as the module's setup calls it: each message names the reward.
    multi = MultiReward({"shapes": 1.0})
    assert multi.problems(records) == [f"reward 'shapes': {p}" for p in problems]
