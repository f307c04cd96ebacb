"""Rewards that score a whole group at once: a pairwise win rate within the group, a rank within it.

Every other reward is a per-sample function (:mod:`lit_flowgrpo.rewards.base`). A group reward says
so with ``scores_groups = True`` and is then called with whole groups and their ids::

    reward(inputs (n, ...), prompts, metadata, group_ids (n,)) -> Tensor (n,)   # NaN: unscored

where the n samples are every member of each group it is given, in the step's one-process order.
``inputs`` are what its optional ``prepare(images, prompts, metadata) -> Tensor (B, ...)`` made of
each rank's samples (a per-sample score, for a rank reward), or, without ``prepare``, the images
themselves as (n, 3, H, W) fp32 in [0, 1], after the round trip through uint8 that carried them (the
``round(x·255)`` of :func:`lit_flowgrpo.rewards.images.to_uint8`, which every image reward applies).

**Where a group is assembled.** ``GroupSampler`` spreads a group's members over the ranks, so no rank
holds a whole group. :func:`score_groups` runs once the rollout is done, on the training thread, on
every data-parallel peer alike: it gathers every rank's inputs, prompts, metadata and group ids (the
advantage stage gathers the rewards the same way, rank-major, in the one-process order), deals the
groups round-robin over the ranks in the order they first appear, has each rank score its own groups,
and gathers the values back, each from the rank that scored it. Each group is scored once and by one
rank, on the same inputs in the same order as one process would, so R ranks give one process's
values. The cost: one gather of the inputs, which for a reward on images (a pairwise judge) is every
rank's images as uint8, (R - 1)·B·3·H·W bytes received per rank and step, and held there while the
step's groups are judged (B samples per rank: 12 images of 512² from one other rank are 9 MB; the
1152 images of a flow_grpo step on 32 ranks, 0.9 GB on each); a reward with a
``prepare`` sends only what it makes (4 bytes a sample for a rank reward). The prompts and metadata go
by ``all_gather_object`` (pickled between the run's own ranks), and two small gathers of flags keep
the ranks in step when one fails: a group reward that raises on one rank raises on all of them.

The group step waits for the whole rollout; a ``prepare`` runs chunk by chunk beside the sampler, as
the per-sample rewards do (:mod:`lit_flowgrpo.rewards.overlap`), so a rank reward's base score costs
what the base reward alone would. Outside a training step (in validation, or a plain call of
:class:`~lit_flowgrpo.rewards.base.MultiReward`) there is no group: a group reward's samples are NaN
there, counted as unscored. Watch its base reward with weight 0 in validation.

Two are registered: ``pairwise_win_rate`` (Pref-GRPO's reward over any pairwise judge) and
``group_rank`` (Flow-Factory's ``PickScore_Rank``, over any per-sample reward).
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import Tensor

from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.errors import SettingsError
from lit_flowgrpo.rewards.base import Scored, checked_output, note, scores_groups, thread_safe
from lit_flowgrpo.rewards.images import ImageFormat, data_url, to_pil_resized, to_uint8
from lit_flowgrpo.rewards.registry import build_reward, qualname, register_reward
from lit_flowgrpo.rewards.remote import RemoteEndpoint, bearer_headers, chat_body, chat_reply

__all__ = [
    "JUDGES",
    "PairwiseJudge",
    "PairwiseWinRate",
    "RankReward",
    "RewardJudge",
    "VLMPairwiseJudge",
    "group_ranks",
    "prepare_inputs",
    "score_groups",
    "win_rates",
]

_FLAG = "--model.init_args.reward.init_args.config"


# --------------------------------------------------------------------------------------------------
# Assembling whole groups across ranks
# --------------------------------------------------------------------------------------------------


def prepare_inputs(
    name: str, reward: Any, images: Tensor, prompts: Sequence[str], metadata: Sequence[dict]
) -> Tensor | BaseException:
    """What travels of this rank's samples for a group reward: its ``prepare``'s (B, ...) output, on the
    CPU (a worker thread's CUDA stream hands nothing on), or (B, 3, H, W) uint8 images without one.

    What ``prepare`` raises is returned, not raised: :func:`score_groups` raises it on every rank alike.
    """
    try:
        prepare = getattr(reward, "prepare", None)
        if prepare is None:
            return to_uint8(images)
        local = torch.as_tensor(prepare(images, list(prompts), list(metadata))).detach().cpu()
        if local.shape[:1] != (images.shape[0],):
            raise ValueError(
                f"reward {name!r} ({qualname(reward)}).prepare returned shape {tuple(local.shape)} for "
                f"{images.shape[0]} samples: one row a sample"
            )
        return local
    except Exception as err:
        return err


def score_groups(
    name: str,
    reward: Any,
    images: Tensor,
    prompts: Sequence[str],
    metadata: Sequence[dict],
    group_ids: Tensor,
    dp: DataParallel,
    prepared: tuple[Tensor | BaseException, float] | None = None,
) -> Scored:
    """One group reward's values of this rank's B samples, each group scored whole (module doc).

    A collective: every data-parallel peer calls it at the same point, with its own batch.

    Args:
        name: the reward's name (its component key).
        reward: a reward with ``scores_groups = True``.
        images: (B, 3, H, W) this rank's images in [0, 1].
        prompts: this rank's prompts.
        metadata: this rank's metadata records.
        group_ids: (B,) the group of each sample, numbered for the whole step.
        dp: the data-parallel peers.
        prepared: :func:`prepare_inputs` of this rank's samples, made already (beside the sampler),
            and the seconds it took; ``None`` makes it here.

    Raises:
        RuntimeError: on every rank, when the reward raised on any (the rank that raised re-raises
            its own exception, with a note).
    """
    start = time.perf_counter()
    batch, device = images.shape[0], images.device
    label = f"reward {name!r} ({qualname(reward)})"
    if not scores_groups(reward):
        raise TypeError(f"{label} does not declare scores_groups = True")
    prompts, metadata = list(prompts), list(metadata)
    made, earlier_s = (
        prepared if prepared is not None else (prepare_inputs(name, reward, images, prompts, metadata), 0.0)
    )
    failure = made if isinstance(made, BaseException) else None
    local = torch.zeros(batch) if failure is not None else made
    prepare = getattr(reward, "prepare", None)
    _all_succeed(failure, dp, device, label, "preparing its inputs")

    inputs = _gather_rows(local.to(device), dp)  # (N, ...) rank-major: the one-process order
    ids = _gather_rows(group_ids.to(device), dp).cpu()
    texts = _gather_objects((prompts, metadata), dp)
    all_prompts = [p for part, _ in texts for p in part]
    all_metadata = [m for _, part in texts for m in part]
    if prepare is None:
        inputs = inputs.float() / 255  # what travelled, back in [0, 1]

    # Groups dealt round-robin in the order they first appear: each is scored whole, by one rank.
    order = list(dict.fromkeys(ids.tolist()))
    owner = {g: i % dp.size for i, g in enumerate(order)}
    owners = torch.tensor([owner[g] for g in ids.tolist()], dtype=torch.long)
    rows = (owners == dp.rank).nonzero().flatten()
    values = torch.zeros(len(ids))
    try:
        if len(rows):
            out = reward(
                inputs[rows.to(device)],
                [all_prompts[i] for i in rows.tolist()],
                [all_metadata[i] for i in rows.tolist()],
                ids[rows],
            )
            found = checked_output(out, len(rows), label)
            if list(found) != [None]:
                raise TypeError(
                    f"{label} returned components {sorted(found)}: a group reward returns one Tensor"
                )
            values[rows] = found[None]
    except Exception as err:
        failure = err
    _all_succeed(failure, dp, device, label, "scoring its groups")
    every = dp.stack(values.to(device)).cpu()  # (R, N): rank r's row holds the groups it scored
    gathered = every.gather(0, owners.unsqueeze(0)).squeeze(0)  # (N,) each from its owner, exactly
    mine = dp.mine(gathered, batch)
    return Scored({name: mine.float()}, time.perf_counter() - start + earlier_s)


def _all_succeed(
    failure: BaseException | None, dp: DataParallel, device: torch.device, label: str, doing: str
) -> None:
    """Raise on every rank when ``failure`` happened on any, so that no rank waits in a collective."""
    flags = dp.stack(torch.tensor([float(failure is not None)], device=device)).flatten().cpu()
    if failure is not None:
        note(failure, f"raised by {label} while {doing}, on data-parallel rank {dp.rank}")
        raise failure
    if bool(flags.any()):
        failed = [r for r, f in enumerate(flags.tolist()) if f]
        raise RuntimeError(f"{label} raised on data-parallel rank(s) {failed} while {doing}: see their error")


def _gather_rows(x: Tensor, dp: DataParallel) -> Tensor:
    """(B, ...) on each peer → (R·B, ...) rank-major on every peer."""
    return dp.stack(x).flatten(0, 1) if dp.size > 1 else x


def _gather_objects(obj: Any, dp: DataParallel) -> list[Any]:
    """Every peer's ``obj``, in rank order (pickled between the run's own ranks)."""
    if dp.size == 1:
        return [obj]
    out: list[Any] = [None] * dp.size
    torch.distributed.all_gather_object(out, obj, group=dp.group)
    return out


# --------------------------------------------------------------------------------------------------
# The rank within the group (Flow-Factory's PickScore_Rank)
# --------------------------------------------------------------------------------------------------


def group_ranks(scores: Tensor, group_ids: Tensor) -> Tensor:
    """Each sample's rank within its group over the size of the group: (r₀, …)/m in [0, 1).

    Flow-Factory's ``PickScoreRankRewardModel`` (src/flow_factory/rewards/pick_score.py):
    ``ranks = scores.argsort().argsort(); rewards = ranks / group_size``, the lowest score 0 and the
    highest (m − 1)/m. Here tied samples share their mean rank (``argsort`` would order them by
    chance), and the m are the group's scored members: a NaN score stays NaN and takes no rank.

    >>> group_ranks(torch.tensor([0.3, 0.1, 0.2, 5.0, 5.0]), torch.tensor([0, 0, 0, 1, 1]))
    tensor([0.6667, 0.0000, 0.3333, 0.2500, 0.2500])
    """
    out = torch.full(scores.shape, torch.nan)
    scores = scores.detach().cpu().double()
    for group in group_ids.unique():
        members = ((group_ids.cpu() == group) & torch.isfinite(scores)).nonzero().flatten()
        s = scores[members]
        below = (s.unsqueeze(0) < s.unsqueeze(1)).sum(1).double()  # (m,) members scoring lower
        ties = (s.unsqueeze(0) == s.unsqueeze(1)).sum(1).double() - 1
        out[members] = ((below + ties / 2) / max(len(members), 1)).float()
    return out


@register_reward("group_rank")
class RankReward:
    """Each sample's rank within its group by a per-sample reward, over the group's size, in [0, 1).

    Flow-Factory's ``PickScore_Rank`` is ``{group_rank: 1.0}`` with ``config: {group_rank: {reward:
    pickscore}}``. The base reward scores each rank's own samples; only its scores travel between
    ranks (:func:`score_groups`), and the ranks come from them (:func:`group_ranks`).

    Args:
        reward: the registered per-sample reward that orders the group.
        config: its constructor's arguments.
        component: which of its components orders the group, for a dict-valued reward (``None``: its
            ``primary``, or its only value).
    """

    scores_groups = True

    def __init__(
        self, reward: str = "pickscore", config: dict[str, Any] | None = None, component: str | None = None
    ) -> None:
        if reward in ("group_rank", "pairwise_win_rate"):
            raise SettingsError(f"{_FLAG}.group_rank.reward ({reward!r}) must be a per-sample reward")
        self.base = build_reward(reward, **dict(config or {}))
        self.name = reward
        self.component = component if component is not None else getattr(self.base, "primary", None)
        # What the base declares holds for its scores here: prepare calls it, chunk by chunk beside the
        # sampler unless the base must stay on the training loop's thread.
        self.modalities = getattr(self.base, "modalities", frozenset({"image"}))
        self.required_metadata = tuple(getattr(self.base, "required_metadata", ()))
        self.thread_safe = thread_safe(self.base)

    def check(self) -> None:
        check = getattr(self.base, "check", None)
        if callable(check):
            check()

    def problems(self, records: Sequence[dict]) -> list[str]:
        """The base reward's findings on the prompt records (its ``problems`` hook), if it has one."""
        hook = getattr(self.base, "problems", None)
        return list(hook(records)) if callable(hook) else []

    def prepare(self, images: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        """(B,) fp32: the base reward's score of each sample of this rank."""
        found = checked_output(self.base(images, prompts, metadata), images.shape[0], f"reward {self.name!r}")
        if self.component not in found:
            raise ValueError(
                f"{_FLAG}.group_rank.component ({self.component!r}) is not one of reward {self.name!r}'s "
                f"components {sorted(str(k) for k in found)}: name one (null for a Tensor-valued reward)"
            )
        return found[self.component]

    def __call__(self, scores: Tensor, prompts: list[str], metadata: list[dict], group_ids: Tensor) -> Tensor:
        return group_ranks(scores, group_ids)


# --------------------------------------------------------------------------------------------------
# Pairwise win rate (Pref-GRPO)
# --------------------------------------------------------------------------------------------------


class PairwiseJudge(Protocol):
    """Which of two samples of one prompt is better.

    ``judge(first (P, 3, H, W), second (P, 3, H, W), prompts, metadata) -> Tensor (P,)``: the first
    sample's share of the win, 1 (the first is better), 0 (the second is), 0.5 (a tie), or a
    probability between; NaN where the judge gave no verdict.
    """

    def __call__(self, first: Tensor, second: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor: ...


def win_rates(
    shares: Tensor, pairs: Sequence[tuple[int, int]], n: int, reversed_shares: Tensor | None = None
) -> Tensor:
    """Each sample's mean share of the win over its judged comparisons; NaN for a sample with none.

    Pref-GRPO (CodeGoat24/Pref-GRPO, fastvideo/rewards/unifiedreward_think.py ``_pairwise_win_rate``):
    each unordered pair of a group is judged once, the winner gets 1, a tie 0.5 each, and a sample's
    reward is its wins over its comparisons (G − 1 of them). There a comparison without a verdict
    counts as a tie; here it is left out, and a sample with no verdict at all is NaN (dropped).

    Args:
        shares: (P,) the first sample's share of each pair's win (NaN: no verdict).
        pairs: (i, j) indices of each pair, i judged first.
        n: the number of samples.
        reversed_shares: (P,) the same pairs judged in the other order (j first), when asked for; a
            pair's share for i is then the mean of ``shares`` and ``1 − reversed_shares`` over the
            verdicts there are.

    >>> win_rates(torch.tensor([1.0, 0.5, 0.0]), [(0, 1), (0, 2), (1, 2)], 3)
    tensor([0.7500, 0.0000, 0.7500])
    """
    share = shares.double()
    if reversed_shares is not None:
        both = torch.stack([share, 1 - reversed_shares.double()])
        share = torch.nanmean(both, dim=0)  # NaN only when neither order gave a verdict
    wins, count = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    for (i, j), s in zip(pairs, share.tolist(), strict=True):
        if math.isfinite(s):
            wins[i] += s
            wins[j] += 1 - s
            count[i] += 1
            count[j] += 1
    return torch.where(count > 0, wins / count.clamp(min=1), torch.nan).float()


@register_reward("pairwise_win_rate")
class PairwiseWinRate:
    """Each sample's win rate against the rest of its group, by a pairwise judge (Pref-GRPO).

    Pref-GRPO (arXiv:2508.20751) trains on the win rate in place of a pointwise score: every pair of
    the group is judged (G·(G − 1)/2 comparisons), and a sample's reward is the fraction it won
    (:func:`win_rates`). The images of a group meet on one rank first (:func:`score_groups`: one
    gather of every rank's images as uint8).

    Args:
        judge: the pairwise judge, by name: ``vlm`` (:class:`VLMPairwiseJudge`, a served
            vision-language model such as UnifiedReward-Think) or ``reward`` (:class:`RewardJudge`,
            the higher score of a per-sample reward wins).
        judge_config: the judge's constructor's arguments.
        both_orders: judge each pair twice, each sample first once, and average (a judge's preference
            for the first or the second image cancels); Pref-GRPO judges each pair once.
    """

    scores_groups = True

    def __init__(
        self, judge: str = "vlm", judge_config: dict[str, Any] | None = None, both_orders: bool = False
    ) -> None:
        if judge not in JUDGES:
            raise SettingsError(
                f"{_FLAG}.pairwise_win_rate.judge ({judge!r}) must be one of {sorted(JUDGES)}"
            )
        self.judge = JUDGES[judge](**dict(judge_config or {}))
        self.both_orders = both_orders

    def check(self) -> None:
        check = getattr(self.judge, "check", None)
        if callable(check):
            check()

    def __call__(self, images: Tensor, prompts: list[str], metadata: list[dict], group_ids: Tensor) -> Tensor:
        pairs = [
            pair
            for group in dict.fromkeys(group_ids.tolist())
            for pair in itertools.combinations((group_ids == group).nonzero().flatten().tolist(), 2)
        ]
        if not pairs:
            return torch.full((len(group_ids),), torch.nan)
        first, second = [i for i, _ in pairs], [j for _, j in pairs]
        judged = [prompts[i] for i in first]
        meta = [metadata[i] for i in first]
        shares = self._judge(images[first], images[second], judged, meta, len(pairs))
        flipped = (
            self._judge(images[second], images[first], judged, meta, len(pairs)) if self.both_orders else None
        )
        return win_rates(shares, pairs, len(group_ids), flipped)

    def _judge(self, a: Tensor, b: Tensor, prompts: list[str], metadata: list[dict], pairs: int) -> Tensor:
        found = checked_output(
            self.judge(a, b, prompts, metadata), pairs, f"pairwise judge {qualname(self.judge)}"
        )
        if list(found) != [None]:
            raise TypeError(f"pairwise judge {qualname(self.judge)} must return one Tensor (P,)")
        return found[None]


class RewardJudge:
    """A pairwise judge from a per-sample reward: the higher score wins, equal scores tie.

    With it, ``pairwise_win_rate`` is the fraction of the group a sample outscores (ties half): the
    win counting of Pref-GRPO with a pointwise scorer as the judge. Each sample of a pair is scored
    anew (a group of G is scored G·(G − 1) times); ``group_rank`` orders a group by the same scores at
    one score a sample.

    Args:
        reward: the registered per-sample reward.
        config: its constructor's arguments.
    """

    def __init__(self, reward: str = "pickscore", config: dict[str, Any] | None = None) -> None:
        self.base = build_reward(reward, **dict(config or {}))
        self.name = reward

    def __call__(self, first: Tensor, second: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        n = first.shape[0]
        both = torch.cat([first, second])
        found = checked_output(
            self.base(both, prompts + prompts, metadata + metadata), 2 * n, f"reward {self.name!r}"
        )
        key = getattr(self.base, "primary", None) if None not in found else None
        if key not in found:
            raise ValueError(
                f"reward {self.name!r} returned components {sorted(str(k) for k in found)} and declares no "
                "primary one: a pairwise judge compares one score (give the reward a primary component)"
            )
        s = found[key]
        a, b = s[:n], s[n:]
        share = (a > b).float() + 0.5 * (a == b).float()
        return torch.where(torch.isfinite(a) & torch.isfinite(b), share, torch.nan)


#: UnifiedReward-Think's pairwise question (Pref-GRPO, fastvideo/rewards/templates.py), in our words.
DEFAULT_PAIR_TEMPLATE = (
    "You are given a text caption and two images generated from it, Image 1 and Image 2. Judge which "
    "image matches the caption better (objects, counts, attributes, relations) and has the better "
    "quality (clarity, detail, aesthetics). Think it through, then give your conclusion inside "
    "<answer></answer> as 'Image 1 is better' or 'Image 2 is better'.\nCaption: [{prompt}]"
)


class VLMPairwiseJudge:
    """A vision-language model behind an OpenAI-compatible chat API compares two images.

    One ``POST {base_url}/chat/completions`` per pair, both images inline as ``data:`` URLs, then the
    question. The verdict is read as Pref-GRPO reads UnifiedReward-Think's reply
    (fastvideo/rewards/unifiedreward_think.py): the text inside ``answer_pattern`` names the winner
    (``first_pattern`` → 1, ``second_pattern`` → 0, neither → 0.5, a tie). A reply without an answer,
    or a failed request, is no verdict (NaN), where Pref-GRPO counts a tie.

    Args:
        base_url: the server's API root, e.g. ``http://127.0.0.1:8000/v1``.
        model: the served model's name.
        template: the question, ``{prompt}`` filled in (``{metadata[key]}`` reads a metadata field).
        answer_pattern: a regex whose first group is the answer.
        first_pattern: a regex that, found in the answer, means the first image won.
        second_pattern: a regex that, found in the answer, means the second image won.
        image_format: encoding of the images in the data URLs.
        resize: resize the images to this square size before sending; ``None`` sends them as they are.
        max_tokens: completion budget of one reply.
        temperature: sampling temperature of the judge.
        api_key: sent as ``Authorization: Bearer``; ``None`` sends none.
        timeout_s: limit of one request attempt, seconds.
        max_retries: further attempts after a failed one.
        backoff_s: sleep before the first retry (doubles each time).
        max_concurrency: requests in flight at once.
        max_consecutive_failures: failed batches in a row before the run stops.
    """

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8000/v1",
        model: str = "UnifiedReward-Think-qwen-7b",
        template: str = DEFAULT_PAIR_TEMPLATE,
        answer_pattern: str = r"<answer>(.*?)</answer>",
        first_pattern: str = r"Image 1 is better",
        second_pattern: str = r"Image 2 is better",
        image_format: ImageFormat = "jpeg",
        resize: int | None = 512,
        max_tokens: int = 2048,
        temperature: float = 0.0,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_concurrency: int = 16,
        max_consecutive_failures: int = 3,
    ) -> None:
        flag = f"{_FLAG}.pairwise_win_rate.judge_config"
        problems = []
        patterns: dict[str, re.Pattern[str]] = {}
        for key, value in (
            ("answer_pattern", answer_pattern),
            ("first_pattern", first_pattern),
            ("second_pattern", second_pattern),
        ):
            try:
                patterns[key] = re.compile(value, re.DOTALL)
            except re.error as err:
                problems.append(f"{flag}.{key} ({value!r}) is not a valid regex: {err}")
        if "answer_pattern" in patterns and patterns["answer_pattern"].groups < 1:
            problems.append(f"{flag}.answer_pattern ({answer_pattern!r}) needs a group around the answer")
        if "{prompt}" not in template:
            problems.append(f"{flag}.template must contain {{prompt}}, where the sample's prompt goes")
        if resize is not None and resize < 1:
            problems.append(f"{flag}.resize ({resize}) must be positive or null")
        if problems:
            raise SettingsError("; ".join(problems))
        self.patterns = patterns
        self.model, self.template = model, template
        self.image_format, self.resize = image_format, resize
        self.max_tokens, self.temperature = max_tokens, temperature
        self.endpoint = RemoteEndpoint(
            base_url,
            flag=flag,
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            max_concurrency=max_concurrency,
            max_consecutive_failures=max_consecutive_failures,
            headers=bearer_headers(api_key),
            url_key="base_url",
        )

    def check(self) -> None:
        self.endpoint.check("models")

    def __call__(self, first: Tensor, second: Tensor, prompts: list[str], metadata: list[dict]) -> Tensor:
        a, b = self._urls(first), self._urls(second)
        items = list(zip(a, b, prompts, metadata, strict=True))
        shares = self.endpoint.map(self._compare, items)
        return torch.tensor([math.nan if s is None else s for s in shares], dtype=torch.float32)

    def _urls(self, images: Tensor) -> list[str]:
        return [data_url(image, self.image_format) for image in to_pil_resized(images, self.resize)]

    def _compare(self, item: tuple[str, str, str, dict]) -> float:
        first, second, prompt, meta = item
        question = self.template.format(prompt=prompt, metadata=meta)
        content = [
            {"type": "image_url", "image_url": {"url": first}},
            {"type": "image_url", "image_url": {"url": second}},
            {"type": "text", "text": question},
        ]
        body = chat_body(self.model, content, self.max_tokens, self.temperature)
        return self.endpoint.request("chat/completions", body, "application/json", self._verdict)

    def _verdict(self, raw: bytes) -> float:
        text = chat_reply(raw) or ""
        found = self.patterns["answer_pattern"].search(text)
        if found is None:
            raise ValueError(
                f"no answer matching {self.patterns['answer_pattern'].pattern!r} in {text[-120:]!r}"
            )
        answer = found.group(1)
        if self.patterns["first_pattern"].search(answer):
            return 1.0
        if self.patterns["second_pattern"].search(answer):
            return 0.0
        return 0.5


#: The pairwise judges ``pairwise_win_rate`` builds by name.
JUDGES: dict[str, Callable[..., PairwiseJudge]] = {"vlm": VLMPairwiseJudge, "reward": RewardJudge}
