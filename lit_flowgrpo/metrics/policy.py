"""The policy update's statistics, per (image, denoising step) token: importance ratio, clip fractions,
KL and entropy (:class:`PolicyRatioStats`, ``actor/...``), Flow-DPPO's trust-region mask on top
(:class:`FlowDPPOStats`), their options (:class:`DiagnosticsSettings`), and the one rule of the clip
interval (1 − ε, 1 + ε_high) that the objectives and these metrics share."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor

from lit_flowgrpo.algorithms.losses import clip_range_problems, resolve_clip_range_high
from lit_flowgrpo.metrics.base import DictMetric, check_vector, sum_by_id

__all__ = [
    "DiagnosticsSettings",
    "FlowDPPOStats",
    "PolicyRatioStats",
    "clip_range_problems",
    "resolve_clip_range_high",
]

_F64 = torch.float64
# Differential entropy of N(μ, s²) per element: ½·log(2πe) + log s (Cover & Thomas, eq. 8.8).
_HALF_LOG_2PI_E = 0.5 * math.log(2.0 * math.pi * math.e)


# Columns of PolicyRatioStats' sum state, one row per denoising step (or a single row).
_SUM_FIELDS = (
    "count",  # finite tokens
    "nonfinite",  # tokens with a non-finite input, excluded
    "dev",  # Σ(r − 1)
    "dev_sq",  # Σ(r − 1)²
    "above",  # #(r − 1 > ε_high)
    "below",  # #(1 − r > ε)
    "clip_high",  # #clip active above (gated by A > 0 unless clip_gate="none")
    "clip_low",  # #clip active below (gated by A < 0 unless clip_gate="none")
    "k3",  # Σ e^d − d − 1
    "d",  # Σ d, d = logp_new − logp_old
    "new",  # Σ logp_new
    "old",  # Σ logp_old
    "ent",  # Σ per-element Gaussian entropy
    "ent_count",  # tokens with std_dev_t
    "step_kl",  # Σ exact Gaussian step KL(old‖new) (tokens given one)
    "step_kl_count",  # tokens with a finite step KL
)
_COL = {name: i for i, name in enumerate(_SUM_FIELDS)}
# Columns of the top-KL rows.
_TOPK_FIELDS = ("kl", "ratio", "new_logp", "old_logp", "sample_id", "step")


class PolicyRatioStats(DictMetric):
    r"""Importance ratio, clip fractions, KL and entropy of the policy update, per (image, step) token.

    One token is an (image, denoising step) pair with d = logp_new − logp_old (log-probs in the
    per-element-mean unit of Flow-GRPO) and r the ratio the loss clipped (``ratio``; by default e^d).
    With n finite tokens, ε = ``clip_range``, ε_h = ``clip_range_high``:

    - ``ratio_mean``, ``ratio_std`` (population), ``ratio_max``, ``ratio_min`` of r. Kept as sums of
      r − 1 so the variance of ratios within 1e-6 of 1 does not cancel away.
    - ``pg_clipfrac_higher`` = #{r > 1 + ε_h}/n, ``pg_clipfrac_lower`` = #{r < 1 − ε}/n, ``pg_clipfrac``
      their sum: the ratio outside the trust region whatever the advantage (verl-omni's
      ``compute_policy_loss_flow_grpo``).
    - ``clip_ratio_high`` = #{r > 1 + ε_h, A > 0}/n, ``clip_ratio_low`` = #{r < 1 − ε, A < 0}/n,
      ``clip_ratio`` their sum: tokens whose gradient the clip removed (TRL's GRPOTrainer
      ``is_high_clipped``/``is_low_clipped``, twinkle's ``GRPOMetric``). ``clip_gate="none"`` drops the
      advantage condition (twinkle's ``CISPOMetric``); ``clip_level="trajectory"`` applies it to each
      trajectory's geometric-mean ratio exp(mean_t log r_t) and advantage, over trajectories (twinkle's
      ``GSPOMetric``).
    - ``approx_kl`` = mean(e^d − d − 1), Schulman's K3 estimator of KL(old‖new) for tokens drawn from
      the old policy; ``kl_max`` = its largest token over all ranks; ``ppo_kl`` = mean(−d) (K1);
      ``logp_diff_mean`` = mean(d); ``mean_new_logp``, ``mean_old_logp``; ``policy_confidence`` =
      exp(mean_new_logp).
    - ``entropy`` = mean(½·log(2πe) + log(std_dev_t·sqrt_dt)): the differential entropy per element of
      the Gaussian transition. It depends only on the noise schedule (σ, noise level, step size), not
      on θ, which moves the mean alone: it is a check of the sampler's settings, not an exploration
      signal. Only present when ``std_dev_t`` was passed.
    - ``kl_new_old_mean`` = mean(KL_t), ``kl_new_old_max`` = its largest token over all ranks, with
      KL_t = mean((μ_θ − μ_old)²)/(2·(std_dev_t·sqrt_dt)²) the exact KL(old‖new) of the step's two
      Gaussian transitions per element (:func:`~lit_flowgrpo.algorithms.gaussian_step_kl` with √|dt|;
      Flow-DPPO's trust-region quantity, verl-omni's ``actor/kl_new_old_mean``/``_max``). Unlike
      ``approx_kl``, which estimates the KL from one drawn sample per token, it is exact per token,
      and it measures how far the update moved the policy on the recorded states. Only present
      when ``step_kl`` was passed.
    - ``count`` (n) and ``nonfinite_count`` (tokens with a NaN/inf input, excluded from the rest).

    Reading it: on-policy (first inner epoch, first micro-batch) the ratio is 1 and every clip fraction
    0. ``pg_clipfrac`` well above ``clip_ratio`` means many ratios leave the region in the direction the
    advantage does not push; ``kl_max`` or ``by_step/...`` rising at late steps is GRPO-Guard's symptom.

    With ``by_step=True`` every statistic is also kept per denoising step j and reported as
    ``by_step/<stat>/step_<j>`` for the steps that had tokens (logged as ``actor_by_step/<stat>/step_<j>``). With ``top_k_kl=k`` the k tokens of
    highest K3 over all ranks are kept as records (``kl``, ``ratio``, ``new_logp``, ``old_logp``,
    ``sample_id``, ``step``; −1 where not given), sorted by KL, in :attr:`top_kl_records` after each
    ``compute()``.

    Logged names (``compute_prefixed``): ``actor/<key>``.

    Args:
        clip_range: ε, the lower clip range (the ratio is clipped below at 1 − ε); in (0, 1).
        clip_range_high: ε_h, the upper clip range; defaults to ``clip_range``.
        by_step: also keep every statistic per denoising step (needs ``num_steps`` and ``step``).
        num_steps: number of denoising steps; ``step`` must lie in ``[0, num_steps)``.
        top_k_kl: keep this many highest-KL token records (0 keeps none).
        clip_level: ``"step"`` counts clipping per token; ``"trajectory"`` per trajectory, from the
            geometric-mean ratio over its steps (needs ``sample_id``).
        clip_gate: ``"advantage"`` counts clipping only where it removes the gradient (A > 0 above,
            A < 0 below); ``"none"`` counts every ratio outside the range.
        prefix: prefix of every key in :meth:`compute_prefixed`.

    Example:
        >>> metric = PolicyRatioStats(clip_range=0.1)
        >>> old = torch.zeros(4)
        >>> new = torch.log(torch.tensor([1.2, 0.8, 1.0, 1.05]))
        >>> advantages = torch.tensor([1.0, 1.0, -1.0, 1.0])
        >>> metric.update(new, old, advantages)
        >>> out = metric.compute()
        >>> [round(float(out[k]), 4) for k in ("ratio_mean", "pg_clipfrac", "clip_ratio_high", "clip_ratio_low")]
        [1.0125, 0.5, 0.25, 0.0]
        >>> round(float(out["approx_kl"]), 6)
        0.010508
    """

    def __init__(
        self,
        clip_range: float,
        clip_range_high: float | None = None,
        by_step: bool = False,
        num_steps: int | None = None,
        top_k_kl: int = 0,
        clip_level: Literal["step", "trajectory"] = "step",
        clip_gate: Literal["advantage", "none"] = "advantage",
        prefix: str = "actor/",
        process_group: Any = None,
    ) -> None:
        super().__init__(prefix, process_group)
        problems = clip_range_problems(clip_range, clip_range_high)
        if by_step and (num_steps is None or num_steps < 1):
            problems.append(f"by_step=True needs num_steps >= 1 (got {num_steps}): pass the number of steps")
        if num_steps is not None and num_steps < 1:
            problems.append(f"num_steps ({num_steps}) must be >= 1")
        if top_k_kl < 0:
            problems.append(f"top_k_kl ({top_k_kl}) must be >= 0 (0 keeps no records)")
        if clip_level not in ("step", "trajectory"):
            problems.append(f"clip_level ({clip_level!r}) must be 'step' or 'trajectory'")
        if clip_gate not in ("advantage", "none"):
            problems.append(f"clip_gate ({clip_gate!r}) must be 'advantage' or 'none'")
        if problems:
            raise ValueError("; ".join(problems))
        self.clip_range = float(clip_range)
        self.clip_range_high = resolve_clip_range_high(clip_range, clip_range_high)
        self.by_step = by_step
        self.num_steps = num_steps
        self.top_k_kl = int(top_k_kl)
        self.clip_level = clip_level
        self.clip_gate = clip_gate
        self.top_kl_records: list[dict[str, float]] = []

        rows = num_steps if by_step else 1
        assert rows is not None
        # One state per reduction (not one per statistic): a sync is then three gathers, not fifteen.
        self.add_state("sums", torch.zeros((rows, len(_SUM_FIELDS)), dtype=_F64), dist_reduce_fx="sum")
        # max of r, K3, step KL
        self.add_state("maxs", torch.full((rows, 3), -math.inf, dtype=_F64), dist_reduce_fx="max")
        self.add_state("mins", torch.full((rows,), math.inf, dtype=_F64), dist_reduce_fx="min")  # r
        if self.top_k_kl:
            self.add_row_state("topk_rows", (len(_TOPK_FIELDS),), _F64)
        if clip_level == "trajectory":
            self.add_row_state("traj_ids", (), torch.int64)
            self.add_row_state("traj_rows", (3,), _F64)  # (Σ log r, n, ΣA)

    @classmethod
    def from_settings(
        cls,
        settings: DiagnosticsSettings,
        *,
        clip_range: float,
        clip_range_high: float | None,
        num_steps: int,
        process_group: Any = None,
    ) -> PolicyRatioStats:
        """The metric that the update's diagnostics ``settings`` ask for, reducing over ``process_group``."""
        options = dataclasses.asdict(settings)
        # What the rollout records and what the visit runs; the metric logs what it is given.
        del options["step_kl"]
        return cls(
            clip_range=clip_range,
            clip_range_high=clip_range_high,
            num_steps=num_steps,
            process_group=process_group,
            **options,
        )

    def update(
        self,
        log_prob: Tensor,
        old_log_prob: Tensor,
        advantages: Tensor,
        *,
        ratio: Tensor | None = None,
        step: Tensor | int | None = None,
        sample_id: Tensor | None = None,
        std_dev_t: Tensor | None = None,
        sqrt_dt: Tensor | None = None,
        step_kl: Tensor | None = None,
    ) -> None:
        """Add N tokens (image, denoising step).

        Args:
            log_prob: (N,) log p_θ of the recorded transition under the current policy.
            old_log_prob: (N,) its log-prob under the policy that sampled it.
            advantages: (N,) advantage of each token's image.
            ratio: (N,) the ratio the loss actually clipped (GRPO-Guard's re-normalised one); default
                exp(log_prob − old_log_prob).
            step: (N,) int64 denoising-step index, or one int for all N. Required with ``by_step``.
            sample_id: (N,) int64 id of each token's trajectory (image), unique within one logging
                period: offset it per inner epoch if trajectories are revisited before ``compute()``.
                Required with ``clip_level="trajectory"``; recorded in the top-KL records.
            std_dev_t: (N,) std_dev_t of the transition, for ``entropy``.
            sqrt_dt: (N,) sqrt(|dt|); the transition std is std_dev_t·sqrt_dt. Leave it None when
                ``std_dev_t`` already is the transition's std.
            step_kl: (N,) the exact KL(old‖new) of each token's Gaussian step, for
                ``kl_new_old_mean``/``kl_new_old_max`` (needs μ_old, which not every rollout records).
        """
        n = check_vector("log_prob", log_prob)
        check_vector("old_log_prob", old_log_prob, n)
        check_vector("advantages", advantages, n)
        device = self.device
        if isinstance(step, int):
            step = torch.full((n,), step, dtype=torch.int64, device=device)
        for name, value in (("ratio", ratio), ("step", step), ("sample_id", sample_id)):
            if value is not None:
                check_vector(name, value, n)
        for name, value in (("std_dev_t", std_dev_t), ("sqrt_dt", sqrt_dt), ("step_kl", step_kl)):
            if value is not None:
                check_vector(name, value, n)
        if sqrt_dt is not None and std_dev_t is None:
            raise ValueError("sqrt_dt was given without std_dev_t: pass both to log the entropy, or neither")
        if self.by_step and step is None:
            raise ValueError("by_step=True needs step=(N,) denoising-step indices in update()")
        if self.clip_level == "trajectory" and sample_id is None:
            raise ValueError("clip_level='trajectory' needs sample_id=(N,) trajectory ids in update()")
        if step is not None:
            # Checked where reading it costs no device synchronisation (the module passes CPU steps).
            if self.by_step and n and step.device.type == "cpu":
                lo, hi = int(step.min()), int(step.max())
                if lo < 0 or hi >= (self.num_steps or 0):
                    raise ValueError(
                        f"step values lie in [{lo}, {hi}] but num_steps is {self.num_steps}: raise "
                        "num_steps or pass 0-based step indices"
                    )
            step = step.detach().to(device, torch.int64)

        new = log_prob.detach().to(device, _F64)
        old = old_log_prob.detach().to(device, _F64)
        adv = advantages.detach().to(device, _F64)
        d = new - old
        if ratio is None:
            dev = torch.expm1(d)  # r − 1, exact for small d
            r = dev + 1.0
            log_r = d
        else:
            r = ratio.detach().to(device, _F64)
            dev = r - 1.0
            log_r = torch.log(r)
        finite = torch.isfinite(d) & torch.isfinite(adv) & torch.isfinite(r)
        std = None
        if std_dev_t is not None:
            std = std_dev_t.detach().to(device, _F64)
            if sqrt_dt is not None:
                std = std * sqrt_dt.detach().to(device, _F64)
            # A deterministic (ODE) step (std 0) has no log-prob: such a token is excluded and counted
            # like a non-finite one, without reading the values back to the host.
            finite = finite & torch.isfinite(std) & (std > 0)

        row = step if self.by_step else torch.zeros(n, dtype=torch.int64, device=device)
        assert row is not None
        ok = finite
        eps_l, eps_h = self.clip_range, self.clip_range_high
        above = dev > eps_h
        below = -dev > eps_l
        if self.clip_gate == "advantage":
            clip_high, clip_low = above & (adv > 0), below & (adv < 0)
        else:
            clip_high, clip_low = above, below
        k3 = torch.expm1(d) - d  # K3 = e^d − d − 1 (Schulman, "Approximating KL divergence", 2020)
        ent = torch.zeros_like(d) if std is None else _HALF_LOG_2PI_E + torch.log(std)
        has_ent = torch.zeros_like(ok) if std is None else ok
        kl = torch.zeros_like(d) if step_kl is None else step_kl.detach().to(device, _F64)
        has_kl = ok & torch.isfinite(kl) if step_kl is not None else torch.zeros_like(ok)

        okf = ok.to(_F64)

        def z(x: Tensor) -> Tensor:  # zero the excluded tokens (NaN · 0 would stay NaN)
            return torch.where(ok, x, torch.zeros_like(x))

        columns = {
            "count": okf,
            "nonfinite": (~ok).to(_F64),
            "dev": z(dev),
            "dev_sq": z(dev * dev),
            "above": z(above.to(_F64)),
            "below": z(below.to(_F64)),
            "clip_high": z(clip_high.to(_F64)),
            "clip_low": z(clip_low.to(_F64)),
            "k3": z(k3),
            "d": z(d),
            "new": z(new),
            "old": z(old),
            "ent": torch.where(has_ent, ent, torch.zeros_like(ent)),
            "ent_count": has_ent.to(_F64),
            "step_kl": torch.where(has_kl, kl, torch.zeros_like(kl)),
            "step_kl_count": has_kl.to(_F64),
        }
        token_sums = torch.stack([columns[f] for f in _SUM_FIELDS], dim=1)  # (N, F) fp64
        self.sums.index_add_(0, row, token_sums)
        neg_inf = torch.full_like(r, -math.inf)
        self.maxs[:, 0].scatter_reduce_(0, row, torch.where(ok, r, neg_inf), reduce="amax")
        self.maxs[:, 1].scatter_reduce_(0, row, torch.where(ok, k3, neg_inf), reduce="amax")
        self.maxs[:, 2].scatter_reduce_(0, row, torch.where(has_kl, kl, neg_inf), reduce="amax")
        self.mins.scatter_reduce_(0, row, torch.where(ok, r, -neg_inf), reduce="amin")

        if self.top_k_kl:
            minus_one = torch.full_like(d, -1.0)
            records = torch.stack(
                [
                    k3,
                    r,
                    new,
                    old,
                    minus_one if sample_id is None else sample_id.detach().to(device, _F64),
                    minus_one if step is None else step.to(_F64),
                ],
                dim=1,
            )[ok]
            self.topk_rows = [_top_rows(torch.cat([self.gathered_rows("topk_rows"), records]), self.top_k_kl)]

        if self.clip_level == "trajectory":
            assert sample_id is not None
            ids = sample_id.detach().to(device, torch.int64)[ok]
            traj = torch.stack([log_r[ok], torch.ones_like(log_r[ok]), adv[ok]], dim=1)
            uniq, merged = sum_by_id(ids, traj)
            self.traj_ids.append(uniq)
            self.traj_rows.append(merged)

    def compute(self) -> dict[str, Tensor]:
        """The statistics described in the class docstring, keyed without prefix."""
        sums, maxs, mins = self.sums, self.maxs, self.mins
        out = self._summary(sums.sum(dim=0), maxs.max(dim=0).values, mins.min())
        if self.clip_level == "trajectory":
            out.update(self._trajectory_clip())
        if self.by_step:
            for j in range(sums.shape[0]):
                if sums[j, _COL["count"]] + sums[j, _COL["nonfinite"]] == 0:
                    continue
                for key, value in self._summary(sums[j], maxs[j], mins[j]).items():
                    if self.clip_level == "trajectory" and key.startswith("clip_ratio"):
                        continue  # clipping is counted per trajectory, not per step
                    out[f"by_step/{key}/step_{j}"] = value
        if self.top_k_kl:
            rows = _top_rows(self.gathered_rows("topk_rows"), self.top_k_kl).cpu().tolist()
            self.top_kl_records = [
                {**dict(zip(_TOPK_FIELDS, rec, strict=True)), "sample_id": int(rec[4]), "step": int(rec[5])}
                for rec in rows
            ]
        return out

    def _summary(self, s: Tensor, mx: Tensor, mn: Tensor) -> dict[str, Tensor]:
        c = {name: s[i] for name, i in _COL.items()}
        n = c["count"]
        nan = torch.tensor(math.nan, dtype=_F64, device=s.device)
        mean_dev = c["dev"] / n
        mean_new = c["new"] / n
        out = {
            "ratio_mean": 1.0 + mean_dev,
            # population variance from shifted sums, shift 1 (the on-policy ratio)
            "ratio_std": (c["dev_sq"] / n - mean_dev * mean_dev).clamp_min(0.0).sqrt(),
            "ratio_max": mx[0] if n > 0 else nan,
            "ratio_min": mn if n > 0 else nan,
            "pg_clipfrac": (c["above"] + c["below"]) / n,
            "pg_clipfrac_higher": c["above"] / n,
            "pg_clipfrac_lower": c["below"] / n,
            "clip_ratio": (c["clip_high"] + c["clip_low"]) / n,
            "clip_ratio_high": c["clip_high"] / n,
            "clip_ratio_low": c["clip_low"] / n,
            "approx_kl": c["k3"] / n,
            "kl_max": mx[1] if n > 0 else nan,
            "ppo_kl": -c["d"] / n,
            "logp_diff_mean": c["d"] / n,
            "mean_new_logp": mean_new,
            "mean_old_logp": c["old"] / n,
            "policy_confidence": torch.exp(mean_new),
            "count": n.clone(),
            "nonfinite_count": c["nonfinite"].clone(),
        }
        if c["ent_count"] > 0:
            out["entropy"] = c["ent"] / c["ent_count"]
        if c["step_kl_count"] > 0:
            out["kl_new_old_mean"] = c["step_kl"] / c["step_kl_count"]
            out["kl_new_old_max"] = mx[2]
        return out

    def _trajectory_clip(self) -> dict[str, Tensor]:
        ids, rows = self.gathered_rows("traj_ids"), self.gathered_rows("traj_rows")
        _, merged = sum_by_id(ids, rows)
        log_r_sum, steps, adv_sum = merged.unbind(dim=1)
        ratio = torch.exp(log_r_sum / steps)  # geometric mean over the trajectory's steps
        adv = adv_sum / steps
        above = ratio > 1.0 + self.clip_range_high
        below = ratio < 1.0 - self.clip_range
        if self.clip_gate == "advantage":
            above, below = above & (adv > 0), below & (adv < 0)
        count = torch.tensor(float(ratio.numel()), dtype=_F64, device=ratio.device)
        high, low = above.sum().to(_F64) / count, below.sum().to(_F64) / count
        return {"clip_ratio": high + low, "clip_ratio_high": high, "clip_ratio_low": low}

    def _prefixed_key(self, key: str) -> str:
        # Per-step keys go under their own top-level section (``actor_by_step/...``): dashboards
        # group panels by the first path component, and 18 statistics × the steps would bury the
        # ``actor/`` section.
        if key.startswith("by_step/"):
            return self.prefix.rstrip("/") + "_" + key
        return self.prefix + key

    def logged_values(self) -> dict[str, float]:
        """:meth:`compute_prefixed` as floats, and the k (image, step) pairs of highest KL over all ranks
        (``top_k_kl``) as ``<prefix>top_kl/<i>/<field>``."""
        values = super().logged_values()
        for i, record in enumerate(self.top_kl_records):
            values.update({f"{self.prefix}top_kl/{i}/{k}": float(v) for k, v in record.items()})
        return values

    def reset(self) -> None:
        super().reset()
        self.top_kl_records = []


def _top_rows(rows: Tensor, k: int) -> Tensor:
    """The k rows of highest KL (column 0); ties broken by sample id, then step, so any split agrees."""
    order = torch.argsort(rows[:, 5], stable=True)
    order = order[torch.argsort(rows[order, 4], stable=True)]
    order = order[torch.argsort(-rows[order, 0], stable=True)]
    return rows[order[:k]]


# Columns of FlowDPPOStats' mask counts, one row per denoising step (or a single row).
_DPPO_FIELDS = ("tokens", "high_kl", "pos_rm", "neg_rm")


class FlowDPPOStats(PolicyRatioStats):
    r""":class:`PolicyRatioStats` of a Flow-DPPO update, plus what its trust-region mask did.

    Flow-DPPO (:func:`~lit_flowgrpo.algorithms.flow_dppo_loss`) clips no ratio: it drops a token's
    gradient when its step KL is at least δ and the update still pushes away from the old policy.
    Over the n tokens (image, step) the loss saw, under verl-omni's names (``FlowDPPOLoss``):

    - ``kl_mask_fraction`` = #{KL_t ≥ δ}/n: outside the trust region, whatever the direction;
    - ``pos_rm_fraction`` = #{KL_t ≥ δ, r > 1, A > 0}/n, ``neg_rm_fraction`` = #{KL_t ≥ δ, r < 1, A < 0}/n:
      dropped on either side; ``masked_fraction`` their sum, the tokens whose gradient the mask removed.

    The inherited ``clip_ratio``, ``clip_ratio_high`` and ``clip_ratio_low`` are left out (no clip
    removes a gradient here; ``masked_fraction`` is their counterpart); ``pg_clipfrac*`` stay, as a
    reading of how far the ratios spread around 1 against ``clip_range``, which the loss does not use.
    Counts are sums over ranks and micro-batches, so any split gives the same fractions; with
    ``by_step`` each also comes per step (``by_step/<stat>/step_<j>``).

    Example:
        >>> metric = FlowDPPOStats(clip_range=1e-4)
        >>> ratio = torch.tensor([1.2, 0.8, 1.1, 0.9])
        >>> high = torch.tensor([True, True, False, True])
        >>> adv = torch.tensor([1.0, -1.0, 1.0, 1.0])
        >>> metric.update(ratio.log(), torch.zeros(4), adv, high_kl=high,
        ...               pos_rm=high & (ratio > 1) & (adv > 0), neg_rm=high & (ratio < 1) & (adv < 0))
        >>> out = metric.compute()
        >>> [float(out[k]) for k in ("kl_mask_fraction", "pos_rm_fraction", "neg_rm_fraction", "masked_fraction")]
        [0.75, 0.25, 0.25, 0.5]
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        rows = self.num_steps if self.by_step else 1
        self.add_state("dppo_sums", torch.zeros((rows, len(_DPPO_FIELDS)), dtype=_F64), dist_reduce_fx="sum")

    def update(  # type: ignore[override]
        self,
        log_prob: Tensor,
        old_log_prob: Tensor,
        advantages: Tensor,
        *,
        high_kl: Tensor | None = None,
        pos_rm: Tensor | None = None,
        neg_rm: Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """:meth:`PolicyRatioStats.update` plus the mask of each token (all (N,) bool):
        ``high_kl`` (KL ≥ δ), ``pos_rm`` and ``neg_rm`` (dropped with A > 0 / A < 0)."""
        super().update(log_prob, old_log_prob, advantages, **kwargs)
        n = log_prob.shape[0]
        if high_kl is None or pos_rm is None or neg_rm is None:
            raise ValueError("FlowDPPOStats.update needs high_kl, pos_rm and neg_rm: the mask of each token")
        for name, value in (("high_kl", high_kl), ("pos_rm", pos_rm), ("neg_rm", neg_rm)):
            check_vector(name, value, n)
        device = self.device
        step = kwargs.get("step")
        if self.by_step:
            row = (torch.full((n,), step) if isinstance(step, int) else step).to(device, torch.int64)
        else:
            row = torch.zeros(n, dtype=torch.int64, device=device)
        masks = [torch.ones(n, dtype=torch.bool, device=device), high_kl, pos_rm, neg_rm]
        self.dppo_sums.index_add_(0, row, torch.stack([m.detach().to(device, _F64) for m in masks], dim=1))

    def compute(self) -> dict[str, Tensor]:
        out = {k: v for k, v in super().compute().items() if "clip_ratio" not in k}
        sums = self.dppo_sums
        out.update(self._mask_fractions(sums.sum(dim=0)))
        if self.by_step:
            for j in range(sums.shape[0]):
                if sums[j, 0] > 0:
                    out.update({f"by_step/{k}/step_{j}": v for k, v in self._mask_fractions(sums[j]).items()})
        return out

    @staticmethod
    def _mask_fractions(s: Tensor) -> dict[str, Tensor]:
        n, high, pos, neg = s.unbind()
        return {
            "kl_mask_fraction": high / n,
            "pos_rm_fraction": pos / n,
            "neg_rm_fraction": neg / n,
            "masked_fraction": (pos + neg) / n,
        }


@dataclass
class DiagnosticsSettings:
    """Options of the update's ratio/clip/KL statistics (:class:`~lit_flowgrpo.metrics.PolicyRatioStats`).

    Args:
        by_step: also log every statistic per denoising step (``actor_by_step/<stat>/step_<j>``).
        top_k_kl: log the k (image, step) pairs of highest KL over all ranks (``actor/top_kl/<i>/...``).
        clip_level: ``"step"`` counts clipping per (image, step); ``"trajectory"`` per image, from
            the geometric-mean ratio over its steps (GSPO-style).
        clip_gate: ``"advantage"`` counts clipping only where it removes the gradient;
            ``"none"`` counts every ratio outside the range (CISPO-style).
        step_kl: log the exact KL(old‖new) of each trained step's Gaussian transition
            (``actor/kl_new_old_mean``, ``actor/kl_new_old_max``): how far the update moved the
            policy. It needs μ_old, so on it makes every ratio objective's rollout record it: one fp32
            latent per trained step and sample, half again what the trajectory holds (x and
            x_next). SD3.5-M at 512 px: 16×64×64 fp32 = 256 KiB per step, 2.25 MiB per sample over
            the 9 trained steps of 10 (less with a window), 108 MiB for 48 samples on a rank.
            Off, objectives that record μ_old for their loss (GRPO-Guard, Flow-DPPO) still log it.
    """

    by_step: bool = True
    top_k_kl: int = 0
    clip_level: Literal["step", "trajectory"] = "step"
    clip_gate: Literal["advantage", "none"] = "advantage"
    step_kl: bool = True
