"""From rewards to advantages: the settings of the advantage stage and its one function.

The math is :func:`lit_flowgrpo.algorithms.group_advantages` (``aggregation: sum``: the weighted sum of
the reward components, normalised within its group) or :func:`~lit_flowgrpo.algorithms.gdpo_advantages`
(``aggregation: gdpo``: each weighted component normalised within its group, then combined and
normalised over the batch). This stage adds what a run needs around it: every rank's rewards are
gathered first, so a group that spans ranks is normalised whole and N ranks compute what one would;
unscored samples are dropped (never turned into a number), counted and reported; and a batch that fails
too often stops the run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from lit_flowgrpo.algorithms import (
    diversity_multipliers,
    gardo_uncertainty,
    gated_kl_weights,
    gdpo_advantages,
    group_advantages,
)
from lit_flowgrpo.distributed import DataParallel
from lit_flowgrpo.errors import MODEL
from lit_flowgrpo.errors import flag as flag_of
from lit_flowgrpo.rewards.base import CallableReward, MultiReward, RewardOutput

__all__ = ["AGGREGATIONS", "AdvantageSettings", "BatchAdvantages", "DiversityBonus", "KLGate"]

#: How the reward components become one advantage (:attr:`AdvantageSettings.aggregation`).
AGGREGATIONS = ("sum", "gdpo")


@dataclass
class KLGate:
    """GARDO's gated KL (arXiv:2512.24138, Sec. 4.1): the KL penalty only on the samples whose trained
    reward looks least trustworthy, the rest trained freely.

    Each sample's uncertainty is how much more the trained (``proxy``) reward ranks it than the
    ``auxiliary`` rewards do (:func:`~lit_flowgrpo.algorithms.gardo_uncertainty`, over every rank's
    batch); the top ``fraction`` of the samples it over-rates carry the KL, as a mean over them
    (:func:`~lit_flowgrpo.algorithms.gated_kl_weights`). The auxiliary rewards are reward components
    scored but not trained on (weight 0 in the ``MultiReward``), as GARDO's aesthetic and ImageReward
    scores are beside its proxy.

    ``adaptive``: GARDO's controller moves ``fraction`` with the risk it sees: the batch's mean positive
    uncertainty above every one of the last ``window`` batches multiplies it by 1 + ``rate``, below
    every one by 1 − ``rate``, kept within ``fraction_range`` (the released script: 0.1 to start, ×1.1 or
    ×0.9, window 20, range [0.02, 0.2]). Its state is checkpointed.

    The penalty's unit differs from GARDO's code, so its β and ``kl_thres`` do not carry over as they
    are. Here β multiplies the mean KL over every gated sample the update trains (the weights of
    :func:`~lit_flowgrpo.algorithms.gated_kl_weights`), whatever the micro-batches. GARDO's script takes
    the mean over the gated samples of each micro-batch, and 0 for a micro-batch with none, so its
    penalty, and the KL it logs and compares with ``kl_thres``, is ours times the share P of its
    micro-batches that hold a gated sample: P ≈ 1 − (1 − g)^b for a gated share g of the trained
    samples and b samples a micro-batch (GARDO's OCR recipe: g ≈ 0.05, half the batch over-rated times
    its fraction 0.1, and b = 9 give P ≈ 0.37; the 5% gated in this package's shapes-world runs with
    b = 32 give P ≈ 0.8). So β_ours ≈ P·β_GARDO, and ``reference.refresh_kl`` ≈ ``kl_thres``/P
    (:class:`~lit_flowgrpo.lora.ReferenceSettings` says how the refresh itself differs).

    Args:
        proxy: the reward component trained on (a key of the reward's components, e.g. ``shapes_color``).
        auxiliary: the components that judge it (at least one).
        fraction: the share of the over-rated samples gated (to start with, when ``adaptive``), in (0, 1].
        adaptive: move ``fraction`` with the uncertainty, as above.
        fraction_range: ``adaptive``: the bounds of ``fraction``.
        rate: ``adaptive``: the relative step of ``fraction``.
        window: ``adaptive``: the batches the risk is compared with.
    """

    proxy: str = ""
    auxiliary: list[str] = field(default_factory=list)
    fraction: float = 0.1
    adaptive: bool = True
    fraction_range: tuple[float, float] = (0.02, 0.2)
    rate: float = 0.1
    window: int = 20

    def __post_init__(self) -> None:
        self.fraction_range = tuple(self.fraction_range)  # type: ignore[assignment]
        self._current = self.fraction
        self._risks: list[float] = []

    def problems(self, flag: str, weights: dict[str, float] | None) -> list[str]:
        """Every problem with these settings, and with the reward's component ``weights`` where known."""
        p = []
        if not 0 < self.fraction <= 1:
            p.append(
                f"{flag}.fraction ({self.fraction}) must lie in (0, 1]: the share of over-rated samples gated"
            )
        low, high = self.fraction_range
        if not 0 < low <= high <= 1:
            p.append(f"{flag}.fraction_range ({list(self.fraction_range)}) must satisfy 0 < low <= high <= 1")
        elif self.adaptive and not low <= self.fraction <= high:
            p.append(
                f"{flag}.fraction ({self.fraction}) must lie within fraction_range {list(self.fraction_range)}"
            )
        if not 0 < self.rate < 1:
            p.append(f"{flag}.rate ({self.rate}) must lie in (0, 1)")
        if self.window < 1:
            p.append(f"{flag}.window ({self.window}) must be at least 1")
        if not self.proxy:
            p.append(f"{flag}.proxy is empty: name the reward component trained on, e.g. shapes_color")
        if not self.auxiliary:
            p.append(
                f"{flag}.auxiliary is empty: name at least one reward component that judges the proxy "
                "(scored with weight 0), e.g. [shapes/partial]"
            )
        if self.proxy and self.proxy in self.auxiliary:
            p.append(
                f"{flag}.auxiliary names the proxy {self.proxy!r} itself: a reward judged by itself is never "
                "over-rated (uncertainty 0), so no sample would carry the KL; name other components"
            )
        if weights is not None:
            unknown = [c for c in [self.proxy, *self.auxiliary] if c and c not in weights]
            if unknown:
                p.append(
                    f"{flag} names {unknown}, which the reward does not compute (its components: "
                    f"{list(weights)}): add them to the reward's weights (weight 0 scores without training on it)"
                )
            elif self.proxy and weights[self.proxy] == 0:
                trained = [c for c, w in weights.items() if w != 0]
                p.append(
                    f"{flag}.proxy ({self.proxy!r}) has weight 0 in {flag_of('reward')}.weights: the gate "
                    f"judges the reward that is trained, so name a trained component ({trained}) or weight it"
                )
        return p

    def weights(
        self, proxy: Tensor, auxiliary: Tensor, trained: Tensor | None = None
    ) -> tuple[Tensor, dict[str, float]]:
        """(N,) KL weights of every rank's samples and what to log; moves ``fraction`` when adaptive.

        ``trained``: (N,) bool, the samples the update trains; the weights are normalised over them (all
        when ``None``). ``actor/kl_gated_fraction`` is the share of the whole batch the gate picks."""
        u = gardo_uncertainty(proxy, auxiliary)
        positive = u[u > 0]
        if self.adaptive and positive.numel():
            # GARDO's risk controller, on the mean positive uncertainty of this batch.
            risk = float(positive.mean())
            if self._risks and risk > max(self._risks):
                self._current *= 1 + self.rate
            elif self._risks and risk < min(self._risks):
                self._current *= 1 - self.rate
            self._current = min(max(self._current, self.fraction_range[0]), self.fraction_range[1])
            self._risks = [*self._risks, risk][-self.window :]
        w = gated_kl_weights(u, self._current, trained)
        # The gate's pick over the whole batch, before the update drops any sample (GARDO's decision).
        picked = w if trained is None else gated_kl_weights(u, self._current)
        gated = float((picked > 0).float().mean())
        return w, {"actor/kl_gated_fraction": gated, "actor/kl_gate_target": self._current}

    def state_dict(self) -> dict[str, Any]:
        return {"fraction": self._current, "risks": list(self._risks)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._current = float(state["fraction"])
        self._risks = [float(r) for r in state["risks"]]


@dataclass
class DiversityBonus:
    """GARDO's diversity-aware advantage (arXiv:2512.24138, Sec. 4.3): each positive advantage scaled by
    its sample's distance to the nearest other sample of its group, over the group's mean
    (:func:`~lit_flowgrpo.algorithms.diversity_multipliers`).

    The features are the images averaged down to ``pool``×``pool`` cells
    (:func:`~lit_flowgrpo.diversity.pooled_pixels`: no model to download); GARDO uses DINOv3 embeddings
    with ``cosine``. Layout and colour are what pooled pixels keep, which is what tells two drawings of
    one prompt apart in the shapes world. An all-black image pools to the zero vector, which has no
    cosine distance: it keeps its advantage and is nobody's neighbour.

    The multipliers scale the advantages after their normalisation (``std``), where GARDO's script
    scales the raw centred rewards: with ``std: global`` the same direction at a β divided by the
    batch's std + 1e-4 (:func:`~lit_flowgrpo.algorithms.diversity_multipliers`).

    Args:
        pool: cells a side of the pooled image.
        distance: ``cosine`` (1 − cos, GARDO's) or ``mse`` (mean squared difference per feature).
    """

    pool: int = 16
    distance: Literal["mse", "cosine"] = "cosine"

    def problems(self, flag: str) -> list[str]:
        p = []
        if self.pool < 1:
            p.append(f"{flag}.pool ({self.pool}) must be at least 1")
        if self.distance not in ("mse", "cosine"):
            p.append(f"{flag}.distance ({self.distance!r}) must be mse or cosine")
        return p

    def features(self, images: Tensor) -> Tensor:
        from lit_flowgrpo.diversity import pooled_pixels

        return pooled_pixels(images, self.pool)


@dataclass
class AdvantageSettings:
    """From rewards to advantages.

    Args:
        std: normalise by the std of all rewards (``"global"``) or of each group. Under
            ``aggregation: gdpo``: the scale of each component's normalisation, its std within the group
            (``"group"``, the GDPO paper's) or over the batch (``"global"``).
        filter_zero: skip samples whose advantage is exactly 0 (saturated groups carry no gradient).
        max_reward_failure_rate: stop the run when more than this fraction of a batch fails to be
            scored (1.0 never stops on that ground).
        max_idle_rollouts: stop the run after this many consecutive rollouts without an optimizer step
            (every sample unscored or filtered, or every gradient non-finite): such a run would never
            reach ``max_steps``.
        aggregation: ``"sum"``: the weighted sum of the reward components is normalised within its
            group (Flow-GRPO). ``"gdpo"``: each weighted component is normalised within its group, the
            weighted sum of those is normalised over the batch (GDPO, arXiv:2601.05242), so a component
            with a wide spread cannot drown one with a narrow spread, and distinct combinations of
            component scores keep distinct advantages. Needs a ``MultiReward`` with at least two non-zero
            weights. A component a sample lacks (NaN) is left out of that sample's sum (its other
            components keep their weights); a component a whole group lacks is left out of that group,
            counted in ``reward/nan_groups/<component>``; a group no component scored is not trained on
            (``reward/unscored_groups``).
        kl_gate: GARDO's gated KL (:class:`KLGate`): the KL penalty on the samples the trained reward
            over-rates only; ``None`` puts it on every sample.
        diversity_bonus: GARDO's diversity-aware advantage (:class:`DiversityBonus`); ``None``: off.
    """

    std: Literal["global", "group"] = "global"
    filter_zero: bool = False
    max_reward_failure_rate: float = 1.0
    max_idle_rollouts: int = 5
    aggregation: Literal["sum", "gdpo"] = "sum"
    kl_gate: KLGate | None = None
    diversity_bonus: DiversityBonus | None = None

    def problems(self, flag: str = "--model.init_args.advantage", reward: Any = None) -> list[str]:
        """Every problem with these settings, and with ``reward`` for this aggregation (empty when fine)."""
        p = []
        if not 0 < self.max_reward_failure_rate <= 1:
            p.append(f"{flag}.max_reward_failure_rate ({self.max_reward_failure_rate}) must lie in (0, 1]")
        if self.max_idle_rollouts < 1:
            p.append(f"{flag}.max_idle_rollouts ({self.max_idle_rollouts}) must be at least 1")
        if self.aggregation not in AGGREGATIONS:
            p.append(f"{flag}.aggregation ({self.aggregation!r}) must be one of {', '.join(AGGREGATIONS)}")
        elif self.aggregation == "gdpo" and reward is not None:
            p += _gdpo_reward_problems(flag, reward)
        if self.kl_gate is not None:
            weights = dict(reward.weights) if isinstance(reward, MultiReward) else None
            p += self.kl_gate.problems(f"{flag}.kl_gate", weights)
        if self.diversity_bonus is not None:
            p += self.diversity_bonus.problems(f"{flag}.diversity_bonus")
        return p

    def advantages(self, rewards: Tensor, group_ids: Tensor) -> tuple[Tensor, float]:
        """Advantages of every rank's samples from their total rewards (``aggregation: sum``), and the
        fraction that could not be scored.

        Args:
            rewards: (N,) rewards of all ranks; NaN/inf where a sample could not be scored.
            group_ids: (N,) integer group of each sample.

        Returns:
            ((N,) advantages, 0 where unscored; the failure rate). Raises when the failure rate is
            above ``max_reward_failure_rate``.
        """
        valid = torch.isfinite(rewards)
        failure_rate = self._failure_rate(valid)
        adv = torch.zeros_like(rewards)
        if failure_rate < 1:
            adv[valid] = group_advantages(rewards[valid], group_ids[valid], std=self.std)
        return adv, failure_rate

    def for_batch(
        self,
        rewards: RewardOutput,
        group_ids: Tensor,
        reward: MultiReward,
        dp: DataParallel,
        images: Tensor | None = None,
    ) -> BatchAdvantages:
        """This rank's advantages of one rollout batch, from every rank's rewards.

        Args:
            rewards: this rank's :class:`~lit_flowgrpo.rewards.base.RewardOutput` (B samples).
            group_ids: (B,) int64 group of each sample, on the device the advantages are wanted on.
            reward: the reward that produced ``rewards`` (its weights, for ``aggregation: gdpo``).
            dp: the data-parallel peers whose rewards are gathered.
            images: (B, 3, H, W) this rank's samples; read by ``diversity_bonus`` only.
        """
        device, batch = group_ids.device, len(group_ids)
        terms = reward.weighted_components(rewards.components) if self.aggregation == "gdpo" else {}
        rows = [rewards.total, group_ids.float(), *(value for _, value in terms.values())]
        gate = self.kl_gate
        if gate is not None:
            rows += [rewards.components[name] for name in (gate.proxy, *gate.auxiliary)]
        num_rows = len(rows)
        if self.diversity_bonus is not None:
            if images is None:
                raise ValueError("diversity_bonus needs the rollout's images")
            rows += list(self.diversity_bonus.features(images).T)  # F rows of (B,)
        # One gather of every rank's rows (rank-major: the one-process order of the step's samples).
        gathered = dp.gather(torch.stack([r.to(device, torch.float32) for r in rows]))  # (R, W·B)
        ids = gathered[1].long()
        log: dict[str, float] = {}
        if self.aggregation == "gdpo":
            done = gdpo_advantages(gathered[2:], [w for w, _ in terms.values()], ids, std=self.std)
            failure_rate = self._failure_rate(done.scored)
            adv, scored = done.advantages, done.scored
            log.update(_gdpo_report(list(terms), done.empty_groups, ids, scored))
        else:
            adv, failure_rate = self.advantages(gathered[0], ids)
            scored = torch.isfinite(gathered[0])
        log["reward/failure_rate"] = failure_rate
        if self.diversity_bonus is not None:
            mult = diversity_multipliers(
                gathered[num_rows:].T, ids, adv, distance=self.diversity_bonus.distance
            ).to(adv.device)
            adv = adv * mult
            boosted = mult[adv > 0]
            log["critic/advantages/diversity_scale_max"] = float(boosted.max()) if boosted.numel() else 1.0
        # What the update trains, over all ranks: its loss is a mean over these rows.
        trained = scored & (adv != 0) if self.filter_zero else scored
        kl_weights = torch.ones_like(adv)
        if gate is not None:
            signals = gathered[num_rows - 1 - len(gate.auxiliary) : num_rows]
            kl_weights, gate_log = gate.weights(signals[0], signals[1:], trained.to(signals.device))
            log.update(gate_log)
        mine = dp.mine(scored, batch)
        # Over all ranks: rank 0 warns for every rank's, and the module's counter counts them all.
        dropped = int((~scored).sum())
        if dropped:
            rank_zero_warn(
                f"{dropped} of {scored.numel()} samples have no finite reward: dropped from the advantages"
            )
        return BatchAdvantages(
            dp.mine(adv, batch),
            mine,
            dropped,
            log,
            dp.mine(kl_weights.to(adv.device), batch),
            dp.mine(trained.to(adv.device), batch),
        )

    def _failure_rate(self, scored: Tensor) -> float:
        """The fraction of ``scored`` that is False; raises above ``max_reward_failure_rate``."""
        failure_rate = 1 - int(scored.sum()) / max(scored.numel(), 1)  # one host read per rollout
        if failure_rate > self.max_reward_failure_rate:
            raise RuntimeError(
                f"{failure_rate:.0%} of the batch could not be scored (more than "
                f"--model.init_args.advantage.max_reward_failure_rate {self.max_reward_failure_rate}): check the "
                "reward's endpoint or inputs"
            )
        return failure_rate


@dataclass
class BatchAdvantages:
    """One rollout batch's advantages as this rank trains them, and what the stage reports."""

    values: Tensor
    """(B,) fp32: this rank's advantages, 0 where unscored."""
    scored: Tensor
    """(B,) bool: this rank's samples that have an advantage; the rest are never trained on."""
    dropped: int
    """The samples without one, over all ranks."""
    log: dict[str, float] = field(default_factory=dict)
    """Over all ranks: ``reward/failure_rate``; under ``aggregation: gdpo`` also
    ``reward/nan_groups/<component>`` and ``reward/unscored_groups``; under ``kl_gate``
    ``actor/kl_gated_fraction`` and ``actor/kl_gate_target``; under ``diversity_bonus``
    ``critic/advantages/diversity_scale_max``."""
    kl_weights: Tensor | None = None
    """(B,) fp32: this rank's weights of the KL penalty (all 1 without ``kl_gate``); their mean over
    every rank's trained samples is 1 where any is gated."""
    keep: Tensor | None = None
    """(B,) bool: this rank's samples the update trains: ``scored``, and a non-zero advantage under
    ``filter_zero`` (``None``: ``scored``)."""


def _gdpo_reward_problems(flag: str, reward: Any) -> list[str]:
    """GDPO normalises each weighted component on its own: a reward with fewer than two is refused."""
    fix = f"or use {flag}.aggregation=sum"
    if isinstance(reward, CallableReward) or not isinstance(reward, MultiReward):
        return [
            f"{flag}.aggregation=gdpo normalises each weighted reward component on its own, but "
            f"{MODEL}.reward is a plain callable (one total): give a MultiReward "
            f"with at least two non-zero weights, e.g. {{shapes/strict: 1.0, shapes/partial: 0.5}}, {fix}"
        ]
    weighted = [key for key, weight in reward.weights.items() if weight != 0]
    if len(weighted) >= 2:
        return []
    return [
        f"{flag}.aggregation=gdpo normalises each weighted reward component on its own and needs at least "
        f"two, but {flag_of('reward')}.weights gives {len(weighted)} a non-zero weight ({reward.weights}): "
        f"weight a second component, e.g. {{shapes/strict: 1.0, shapes/partial: 0.5}}, {fix}"
    ]


def _gdpo_report(keys: list[str], empty_groups: Tensor, ids: Tensor, scored: Tensor) -> dict[str, float]:
    """``reward/nan_groups/<component>`` and ``reward/unscored_groups`` of one batch (all ranks), each
    warned about when not 0: never a silent gap in what is trained."""
    num_groups = int(torch.unique(ids).numel())
    log = {}
    for key, count in zip(keys, empty_groups.tolist(), strict=True):
        log[f"reward/nan_groups/{key}"] = float(count)
        if count:
            rank_zero_warn(
                f"reward component {key!r} scored no sample of {count} of {num_groups} groups: left out of "
                f"those groups' advantages (reward/nan_groups/{key})"
            )
    unscored = num_groups - int(torch.unique(ids[scored]).numel())
    log["reward/unscored_groups"] = float(unscored)
    if unscored:
        rank_zero_warn(
            f"{unscored} of {num_groups} groups have no scored sample (every weighted reward component "
            "failed on each): not trained on (reward/unscored_groups)"
        )
    return log
