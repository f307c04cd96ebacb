"""`as_reward`: every reward spec becomes a MultiReward whose outputs are checked where they are
produced; unscored counts; the `problems(records)` hook; the hint for a plugin's reward."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

import lit_flowgrpo.rewards.registry as registry
from lit_flowgrpo.rewards import MultiReward, RewardOutput, as_reward, build_reward
from lit_flowgrpo.rewards.base import CallableReward

IMAGES = torch.rand(4, 3, 8, 8)
PROMPTS = ["p0", "p1", "p2", "p3"]
META: list[dict] = [{}] * 4


def brightness(images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
    return images.mean(dim=(1, 2, 3))


class TwoParts:
    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        return {"a": torch.tensor([1.0, math.inf, 3.0, 4.0], dtype=torch.float64), "b": torch.ones(4)}


def test_specs_become_multirewards() -> None:
    multi = MultiReward({"jpeg_compressibility": 1.0})
    assert as_reward(multi) is multi
    from_dict = as_reward({"jpeg_compressibility": 2.0})
    assert type(from_dict) is MultiReward and from_dict.weights == {"jpeg_compressibility": 2.0}
    assert isinstance(as_reward(brightness), CallableReward)
    with pytest.raises(TypeError, match=r"--model\.init_args\.reward \(int\) must be a MultiReward"):
        as_reward(3)  # type: ignore[arg-type]


def test_plain_callable_keeps_the_module_semantics() -> None:
    out = as_reward(brightness)(IMAGES, PROMPTS, META)
    assert isinstance(out, RewardOutput)
    expected = IMAGES.mean(dim=(1, 2, 3))
    assert set(out.components) == {"reward"}
    assert torch.equal(out.components["reward"], expected) and torch.equal(out.total, expected)
    assert out.failures == {"reward": 0} and set(out.latency_s) == {"reward"}

    out = as_reward(TwoParts())(IMAGES, PROMPTS, META)
    assert set(out.components) == {"a", "b"}  # a dict keeps its own names, unprefixed
    assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in out.components.values())
    # inf is a failed sample: NaN, never a number, in the component and in the total (a + b).
    torch.testing.assert_close(out.components["a"], torch.tensor([1.0, math.nan, 3.0, 4.0]), equal_nan=True)
    torch.testing.assert_close(out.total, torch.tensor([2.0, math.nan, 4.0, 5.0]), equal_nan=True)
    assert out.failures == {"reward": 1}


@pytest.mark.parametrize(
    ("value", "got"),
    [(torch.zeros(4, 1), r"\(4, 1\)"), (torch.zeros(3), r"\(3,\)"), (torch.tensor(0.5), r"\(\)")],
)
def test_wrong_shape_names_the_callable_and_the_shapes(value: Tensor, got: str) -> None:
    def scorer(images, prompts, metadata):
        return value

    expected = rf"reward '.*scorer' returned shape {got} for 4 images; expected \(B,\) = \(4,\)"
    with pytest.raises(ValueError, match=expected):
        as_reward(scorer)(IMAGES, PROMPTS, META)


def test_wrong_output_in_a_multireward_names_reward_and_component() -> None:
    class Wide:
        def __call__(self, images, prompts, metadata):
            return {"ok": torch.zeros(4), "wide": torch.zeros(4, 2)}

    multi = MultiReward({"mine": 1.0, "jpeg_compressibility": 0.0}, rewards={"mine": Wide()})
    with pytest.raises(
        ValueError, match=r"reward 'mine' \(.*Wide\), component 'wide', returned shape \(4, 2\)"
    ):
        multi(IMAGES, PROMPTS, META)
    with pytest.raises(TypeError, match=r"reward 'none' \(.*\) returned a NoneType; expected a Tensor"):
        MultiReward({"none": 1.0}, rewards={"none": lambda i, p, m: None})(IMAGES, PROMPTS, META)
    with pytest.raises(ValueError, match=r"returned an empty dict"):
        as_reward(lambda i, p, m: {})(IMAGES, PROMPTS, META)


def test_unscored_count_per_component() -> None:
    def half(images, prompts, metadata):
        return {
            "x": torch.tensor([0.1, math.nan, math.nan, 0.4]),
            "y": torch.tensor([1.0, 1.0, math.inf, 1.0]),
        }

    out = MultiReward({"half/x": 1.0}, rewards={"half": half})(IMAGES, PROMPTS, META)
    assert out.unscored_count == {"half/x": 2, "half/y": 1}
    assert out.failures == {"half": 2}  # samples 1 and 2: unscored in some component
    assert as_reward(brightness)(IMAGES, PROMPTS, META).unscored_count == {"reward": 0}


class Picky:
    """Accepts only prompts that start with 'p'."""

    def problems(self, records):
        return [
            f"record {i} ({r['prompt']!r}) does not start with 'p'"
            for i, r in enumerate(records)
            if r["prompt"][0] != "p"
        ]

    def __call__(self, images, prompts, metadata):
        return torch.zeros(len(prompts))


def test_problems_hook_is_aggregated_with_the_reward_name() -> None:
    records = [{"prompt": "p0"}, {"prompt": "q1"}, {"prompt": "p2"}, {"prompt": "z3"}]
    multi = MultiReward({"picky": 1.0, "jpeg_compressibility": 1.0}, rewards={"picky": Picky()})
    assert multi.problems(records) == [
        "reward 'picky': record 1 ('q1') does not start with 'p'",
        "reward 'picky': record 3 ('z3') does not start with 'p'",
    ]
    assert multi.problems(records[:1]) == []
    assert as_reward(brightness).problems(records) == []  # a reward without the hook has nothing to say


def test_plugin_reward_unknown_names_the_import(monkeypatch: pytest.MonkeyPatch) -> None:
    # As in a process that never imported lit_flowgrpo.toy (this one may have).
    monkeypatch.delitem(registry._REGISTRY, "shapes", raising=False)
    hint = r"'shapes' is the toy world's reward, registered by `import lit_flowgrpo\.toy`.*lit_flowgrpo\.toy\.ToyPolicy"
    with pytest.raises(ValueError, match=r"unknown reward 'shapes': .*" + hint):
        build_reward("shapes")
    with pytest.raises(
        ValueError,
        match=r"--model\.init_args\.reward\.init_args\.weights names unregistered rewards \['shapes'\].*"
        + hint,
    ):
        MultiReward({"shapes": 1.0})
    with pytest.raises(ValueError, match="unknown reward 'nope'") as err:
        build_reward("nope")
    assert "lit_flowgrpo.toy" not in str(err.value)


# ---------------------------------------------------------------------------------------------------
# Core (accuracy-like) components: declared by each reward, split into val-core/ and val-aux/
# ---------------------------------------------------------------------------------------------------


def test_builtin_rewards_declare_their_accuracy_as_core() -> None:
    import lit_flowgrpo.toy  # noqa: F401  (registers `shapes`)

    multi = MultiReward(
        {"shapes/partial": 1.0, "geneval": 0.0, "ocr": 0.0, "pickscore": 0.0, "jpeg_compressibility": 0.0},
        config={"geneval": {"primary": "partial"}, "ocr": {"engine": lambda image: ""}},
    )
    # the weights name partial and primary components: the declaration, not the weight, makes a component core
    assert multi.core_components == {"shapes/strict", "geneval/strict", "ocr"}
    keys = {
        name: multi.validation_keys(name)
        for name in ("shapes/strict", "shapes/partial", "geneval/strict", "geneval/partial", "ocr")
    }
    assert keys == {
        "shapes/strict": ("val-core/shapes/strict/mean@1", "val-aux/shapes/strict/unscored_count"),
        "shapes/partial": ("val-aux/shapes/partial/mean@1", "val-aux/shapes/partial/unscored_count"),
        "geneval/strict": ("val-core/geneval/strict/mean@1", "val-aux/geneval/strict/unscored_count"),
        "geneval/partial": ("val-aux/geneval/partial/mean@1", "val-aux/geneval/partial/unscored_count"),
        "ocr": ("val-core/ocr/mean@1", "val-aux/ocr/unscored_count"),
    }
    assert multi.validation_keys("pickscore/score")[0] == "val-aux/pickscore/score/mean@1"


class Graded:
    """A dict-valued reward whose ``acc`` component is its accuracy."""

    core_components = ("acc",)

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> dict[str, Tensor]:
        return {"acc": torch.tensor([1.0, 0.0, 1.0, 1.0]), "margin": torch.rand(4)}


class Exact:
    """A Tensor-valued reward that is an accuracy: its one value is core."""

    core_components = (None,)

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        return torch.ones(4)


def test_core_declaration_passes_through_multireward_and_callables() -> None:
    multi = MultiReward(
        {"graded/acc": 1.0, "exact": 1.0, "bright": 0.0},
        rewards={"graded": Graded(), "exact": Exact(), "bright": brightness},
    )
    out = multi(IMAGES, PROMPTS, META)
    # keyed as the components are, so every logged component finds its section
    assert multi.core_components == {"graded/acc", "exact"}
    assert {multi.validation_keys(k)[0] for k in out.components} == {
        "val-core/graded/acc/mean@1",
        "val-core/exact/mean@1",
        "val-aux/graded/margin/mean@1",
        "val-aux/bright/mean@1",  # a plain callable declares nothing: auxiliary
    }
    # A bare callable keeps its own component names, and so does its declaration.
    assert as_reward(Graded()).core_components == {"acc"}
    assert as_reward(Exact()).core_components == {"reward"}
    assert as_reward(brightness).core_components == frozenset()


def test_bad_core_declarations_name_the_reward() -> None:
    class Letters(Graded):
        core_components = "acc"  # a string, not a tuple: would read as 'a', 'c', 'c'

    with pytest.raises(
        TypeError, match=r"reward 'mine' \(.*Letters\)\.core_components is 'acc': declare a tuple"
    ):
        _ = MultiReward({"mine": 1.0}, rewards={"mine": Letters()}).core_components

    class Absent(Graded):
        core_components = ("accuracy",)

    with pytest.raises(
        ValueError, match=r"reward 'mine' \(.*Absent\) declares core_components \['accuracy'\] but returned"
    ):
        MultiReward({"mine/acc": 1.0}, rewards={"mine": Absent()})(IMAGES, PROMPTS, META)
