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
    assert (
        problems[1].startswith(f"prompt record 3 ({good[1]['prompt']!r}):")
        and "include[0].class 'dog'" in problems[1]
    )
    assert (
        problems[2].startswith("prompt record 4 ('a red circle'):") and "non-empty 'include'" in problems[2]
    )
    assert problems[3] == f"the toy world's vocabulary is {list(world.VOCAB)}"  # once, not per record

    # Through the weighted sum, as the module's setup calls it: each message names the reward.
    multi = MultiReward({"shapes": 1.0})
    assert multi.problems(records) == [f"reward 'shapes': {p}" for p in problems]


def test_module_setup_names_bad_prompts_before_loading(tmp_path) -> None:
    import json

    import lightning as L
    import pytest

    from lit_flowgrpo import FlowGRPOModule, PromptDataModule, Sampler, UpdateSettings, WeightsSettings
    from lit_flowgrpo.toy import ToyPolicy

    records = world.load_prompts("train")[:8]
    records[5] = {**records[5], "prompt": "a red dragon"}
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in records))
    module = FlowGRPOModule(
        policy=ToyPolicy(),
        reward={"shapes/strict": 1.0},
        sampler=Sampler(num_steps=2, eval_num_steps=2, height=32, width=32),
        update=UpdateSettings(micro_batch_size=4),
        weights=WeightsSettings(lora=None),
    )
    data = PromptDataModule(train=str(train), prompts_per_step=2, group_size=2)
    trainer = L.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False)
    with pytest.raises(
        ValueError, match=r"--data.init_args.train: reward 'shapes': prompt record 5 \('a red dragon'\)"
    ):
        trainer.fit(module, datamodule=data)
    assert not module._configured  # failed in setup, before configure_model read any weight
