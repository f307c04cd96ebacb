"""GARDO's gated KL (arXiv:2512.24138, Sec. 4.1): its settings (:class:`KLGate`), the controller that
moves the gated share along the run (:class:`KLGateController`, a :class:`~lit_flowgrpo.parts.Part`:
its state is checkpointed), and the transform that turns the gathered reward components into KL weights
(:class:`GatedKL`).

The settings hold no run state: a settings object can be shared, copied or compared, and the controller
of each run is its own (:meth:`~lit_flowgrpo.advantages.AdvantageSettings.parts`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from lit_flowgrpo.advantages.columns import AdvantageState
from lit_flowgrpo.algorithms import gardo_uncertainty, gated_kl_weights
from lit_flowgrpo.errors import MODEL
from lit_flowgrpo.errors import flag as flag_of
from lit_flowgrpo.parts import AfterUpdate

__all__ = ["GatedKL", "KLGate", "KLGateController"]


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
    ×0.9, window 20, range [0.02, 0.2]). Its state is checkpointed (:class:`KLGateController`).

    The penalty's unit differs from GARDO's code, so its β and ``kl_thres`` do not carry over as they
    are. Here β multiplies the mean KL over every gated sample the update trains (the weights of
    :func:`~lit_flowgrpo.algorithms.gated_kl_weights`), whatever the micro-batches. GARDO's script takes
    the mean over the gated samples of each micro-batch, and 0 for a micro-batch with none, so its
    penalty, and the KL it logs and compares with ``kl_thres``, is ours times the share P of its
    micro-batches that hold a gated sample: P ≈ 1 − (1 − g)^b for a gated share g of the trained
    samples and b samples a micro-batch (GARDO's OCR recipe: g ≈ 0.05, half the batch over-rated times
    its fraction 0.1, and b = 9 give P ≈ 0.37; the 5% gated in this package's shapes-world runs with
    b = 32 give P ≈ 0.8). So β_ours ≈ P·β_GARDO, and ``reference.refresh_kl`` ≈ ``kl_thres``/P
    (:class:`~lit_flowgrpo.copies.ReferenceSettings` says how the refresh itself differs).

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
        self.fraction_range = tuple(self.fraction_range)  # type: ignore[assignment]  # YAML gives a list

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


class KLGateController:
    """The gated share of one run (a :class:`~lit_flowgrpo.parts.Part`): GARDO's risk controller when the
    gate is ``adaptive``, the fixed ``fraction`` otherwise.

    It moves in the advantage stage, once per rollout batch, on that batch's uncertainties (GARDO moves
    it before the update, from the batch it gates): :meth:`weights`. ``after_update`` leaves it alone,
    and logging only reads it.

    Its checkpoint entry is ``{"fraction": float, "risks": [float, ...]}`` under ``kl_gate``, the form
    checkpoints have always held; a checkpoint without one (written without a gate) leaves the
    controller where it starts.

    Args:
        gate: the settings it follows.
    """

    key = "kl_gate"

    def __init__(self, gate: KLGate) -> None:
        self.gate = gate
        self.fraction = float(gate.fraction)
        self.risks: list[float] = []

    def observe(self, uncertainty: Tensor) -> float:
        """Move the gated share with this batch's risk (when adaptive) and return the share to gate.

        GARDO's controller (``adaptive``): the risk is the mean positive uncertainty; above every one of
        the last ``window`` batches' the share grows by 1 + ``rate``, below every one it shrinks by
        1 − ``rate``, within ``fraction_range``. A batch with no positive uncertainty says nothing of the
        risk and moves nothing."""
        positive = uncertainty[uncertainty > 0]
        if self.gate.adaptive and positive.numel():
            risk = float(positive.mean())
            if self.risks and risk > max(self.risks):
                self.fraction *= 1 + self.gate.rate
            elif self.risks and risk < min(self.risks):
                self.fraction *= 1 - self.gate.rate
            low, high = self.gate.fraction_range
            self.fraction = min(max(self.fraction, low), high)
            self.risks = [*self.risks, risk][-self.gate.window :]
        return self.fraction

    def weights(
        self, proxy: Tensor, auxiliary: Tensor, trained: Tensor | None = None
    ) -> tuple[Tensor, dict[str, float]]:
        """(N,) KL weights of every rank's samples and what to log; moves the share when adaptive.

        Args:
            proxy: (N,) the trained reward of every rank's samples.
            auxiliary: (K, N) the rewards that judge it.
            trained: (N,) bool, the samples the update trains; the weights are normalised over them (all
                when ``None``).

        Returns:
            ((N,) fp32 weights, ``actor/kl_gated_fraction``: the share of the whole batch the gate picks,
            and ``actor/kl_gate_target``: the share it aims at).
        """
        u = gardo_uncertainty(proxy, auxiliary)
        fraction = self.observe(u)
        w = gated_kl_weights(u, fraction, trained)
        # The gate's pick over the whole batch, before the update drops any sample (GARDO's decision).
        picked = w if trained is None else gated_kl_weights(u, fraction)
        gated = float((picked > 0).float().mean())
        return w, {"actor/kl_gated_fraction": gated, "actor/kl_gate_target": fraction}

    def state_dict(self) -> dict[str, Any]:
        return {"fraction": self.fraction, "risks": list(self.risks)}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if not state:  # written without a gate (or before it had state): start afresh
            return
        missing = [k for k in ("fraction", "risks") if k not in state]
        if missing:
            raise ValueError(
                f"the checkpoint's kl_gate entry lacks {missing} (it holds {sorted(state)}): it was not "
                "written by the KL gate's controller; resume with the run's own checkpoint"
            )
        self.fraction = float(state["fraction"])
        self.risks = [float(r) for r in state["risks"]]

    def after_update(self, done: AfterUpdate) -> None:
        pass  # it moved in the advantage stage, on the batch it gated


@dataclass(frozen=True)
class GatedKL:
    """The KL gate as a transform: the proxy and auxiliary components in, every rank's KL weights out,
    normalised over the samples the update trains (so it runs after ``filter_zero``).

    Args:
        controller: the run's controller (it moves here).
    """

    controller: KLGateController
    label: str = f"{MODEL}.advantage.kl_gate"

    @property
    def columns(self) -> tuple[str, ...]:
        return (self.controller.gate.proxy, *self.controller.gate.auxiliary)

    def __call__(self, state: AdvantageState) -> AdvantageState:
        gate = self.controller.gate
        proxy = state.columns[gate.proxy]
        auxiliary = torch.stack([state.columns[name] for name in gate.auxiliary])  # (K, N)
        weights, log = self.controller.weights(proxy, auxiliary, state.keep.to(proxy.device))
        return state.replace(kl_weights=weights.to(state.values.device), log=log)
